"""Command-line options with their ``BA_*`` variables, and the flags made from the settings.

``option`` adds one flag: its help shows ``[default: D; env NAME]``, and the variable, when
set, is its default, parsed like the flag's own value (the flag wins). ``add_settings`` adds
a flag for every field of a settings model (its sections included, at any depth) that
``config.setting`` gave a flag, with that declaration's help, default and variable; the
value is checked against the field's bounds as it is parsed, so a value out of bounds
fails at the command line, naming its flag. A flag's ``dest`` is the field's path in the
tree (``ingest.rate_limit``). ``settings_from`` reads those flags back as the model's fields.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from broker_adapter.config import Flag, field_type, flag_of, is_section

#: The type of ``option`` (a command module that is handed it names its parameter so).
Option = Callable[..., None]


class AppendOrEnv(argparse.Action):
    """``append``, except that the first flag replaces a list that came from the
    environment (the flag wins) instead of adding to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def option(
    p: argparse.ArgumentParser,
    flag: str,
    help: str,
    *,
    env: str | None = None,
    default: Any = None,
    shown: str | None = None,
    required: bool = False,
    **kwargs: Any,
) -> None:
    """Add ``flag`` to ``p`` with its help text, default and environment variable.

    ``--help`` shows ``[default: D; env NAME]`` (``shown`` names a default that is not a
    value, e.g. "off"), or ``[required; env NAME]``. When ``NAME`` is set it is the
    default, parsed like the flag's own value (a list option takes comma-separated
    values), and the flag is no longer required. The table of variables in
    docs/CONFIGURATION.md is checked against these (tests/unit/test_cli_help.py).
    """
    notes = []
    if required:
        notes.append("required")
    elif shown is not None or default not in (None, []):
        notes.append(f"default: {default if shown is None else shown}")
    if env is not None:
        notes.append(f"env {env}")
        value = os.environ.get(env)
        if value is not None:
            split = kwargs.get("action") is AppendOrEnv
            default = [v.strip() for v in value.split(",") if v.strip()] if split else value
            required = False
    text = f"{help} [{'; '.join(notes)}]" if notes else help
    p.add_argument(flag, default=default, required=required, help=text.replace("%", "%%"), **kwargs)


_CHECK = ConfigDict(allow_inf_nan=False)


def _checker(base: type, kind: Any) -> Any:
    """An argparse ``type`` that checks a value as ``kind`` within its bounds, refusing it
    with the bound it breaks (argparse's own "invalid int value" for one that is not a
    ``base`` at all); a number comes back parsed, any other value as it was typed (the model
    converts it when it is built)."""
    adapter: TypeAdapter[Any] = TypeAdapter(kind, config=_CHECK)

    def check(text: str) -> Any:
        try:
            value = adapter.validate_python(text)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            if all(e["type"].endswith("_parsing") for e in errors):
                raise ValueError(text) from None  # argparse: "invalid int value: 'x'"
            why = "; ".join(str(e.get("msg", "invalid")) for e in errors)
            raise argparse.ArgumentTypeError(
                f"{text!r}: {why.removeprefix('Value error, ')}"
            ) from None
        return value if isinstance(value, int | float) else text  # a path stays as typed

    check.__name__ = base.__name__  # argparse names the type in its messages
    return check


def _base(annotation: Any) -> type:
    """The plain type a value must parse as: ``int`` for ``int | None``, ..."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and candidate is not type(None):
            return candidate
    return str


def _flagged(model: type[BaseModel], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The paths of the fields of ``model`` that have a flag, and of its sections' at any
    depth (``config.section``; a nested model that is a plain field is its model's own)."""
    for name, field in model.model_fields.items():
        if flag_of(field) is not None:
            yield (*path, name)
        elif is_section(field):
            yield from _flagged(_section_model(model, name), (*path, name))


def _section_model(model: type[BaseModel], name: str) -> type[BaseModel]:
    kind = model.model_fields[name].annotation
    assert isinstance(kind, type)
    assert issubclass(kind, BaseModel)
    return kind


def _field_info(model: type[BaseModel], path: tuple[str, ...]) -> FieldInfo:
    for name in path[:-1]:
        model = _section_model(model, name)
    return model.model_fields[path[-1]]


def _dest(path: tuple[str, ...]) -> str:
    return ".".join(path)


def add_settings(
    p: argparse.ArgumentParser,
    model: type[BaseModel],
    names: Iterable[str] | None = None,
    *,
    exclude: Iterable[str] = (),
    what: dict[str, str] | None = None,
) -> None:
    """Add to ``p`` a flag for each setting of ``model`` that has one (``config.setting``),
    in the model's order: all of them, or those named (a nested model's as
    ``reconcile.operator_timeout_s``) less ``exclude``. ``what`` adds, by name, what the
    setting does for this command to its help text."""
    wanted = list(_flagged(model)) if names is None else [tuple(n.split(".")) for n in names]
    skip = {tuple(n.split(".")) for n in exclude}
    for path in wanted:
        if path in skip:
            continue
        field = _field_info(model, path)
        cli = flag_of(field)
        assert cli is not None, f"{model.__name__}.{_dest(path)} has no flag"
        more = (what or {}).get(_dest(path))
        text = f"{field.description}: {more}" if more else str(field.description)
        _add(p, path, field, cli, text)


def _add(
    p: argparse.ArgumentParser, path: tuple[str, ...], field: FieldInfo, cli: Flag, text: str
) -> None:
    default = field.default if cli.cli_default is None else cli.cli_default
    kind = field_type(field)
    given: dict[str, Any] = {"dest": _dest(path), "shown": cli.shown}
    if cli.metavar is not None:
        given["metavar"] = cli.metavar
    if field.annotation is bool:
        value = os.environ.get(cli.env)
        if value is not None:  # an unreadable one is left for the model to refuse
            try:
                default = TypeAdapter(bool).validate_python(value)
            except ValidationError:
                default = value
        p.add_argument(
            cli.flag,
            action=argparse.BooleanOptionalAction,
            default=default,
            dest=_dest(path),
            help=f"{text} [default: {'on' if field.default else 'off'}; env {cli.env}]",
        )
        return
    if get_origin(field.annotation) is tuple:
        item = get_args(field.annotation)[0]
        given["type"] = _checker(str, item)
        option(p, cli.flag, text, env=cli.env, default=[], action=AppendOrEnv, **given)
        return
    if get_origin(field.annotation) is Literal:
        given["choices"] = get_args(field.annotation)
    else:
        given["type"] = _checker(_base(field.annotation), kind)
    option(p, cli.flag, text, env=cli.env, default=default, **given)


def settings_from(
    args: argparse.Namespace, model: type[BaseModel], names: Iterable[str] | None = None
) -> dict[str, Any]:
    """The values of ``model``'s flags in ``args`` (those ``add_settings`` added), nested as
    the model nests them: keyword arguments for ``model``."""
    wanted = list(_flagged(model)) if names is None else [tuple(n.split(".")) for n in names]
    values: dict[str, Any] = {}
    for path in wanted:
        dest = _dest(path)
        if not hasattr(args, dest):
            continue
        level = values
        for name in path[:-1]:
            level = level.setdefault(name, {})
        level[path[-1]] = getattr(args, dest)
    return values
