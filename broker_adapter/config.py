"""The base of every settings model: checked when built, refused as one ``ConfigError``.

Each settings class (``AdapterConfig``, ``IngestConfig``, ``WorkerConfig``, ``TaskPolicy``,
``ReaderConfig``, ...) subclasses ``ConfigModel`` and states its bounds as pydantic fields
and validators. ``Model(...)`` stays the way to build one; what it refuses comes out as a
``ConfigError`` (a ``ValueError``, like pydantic's own error) naming the model and each
field at fault, so callers and the CLI handle one error class and never see a pydantic
traceback.

The settings form one tree: ``AdapterConfig`` at the root holds what the whole adapter
shares (the wiring, the lease, the retention window) and one ``section`` per stage, whose
model the stage declares next to its own settings (``IngestSettings``, ``WorkerSettings``,
``TaskSettings``, ``ReconcilePolicy``, ``MetricsSettings``). A setting is a field made with
``setting`` (its bound, default, help text, and the flag and ``BA_*`` variable that set it
on the command line), declared in one place: in its section, which the stage's full
settings model extends, or, for the few that several unrelated models hold, as a
``*_SETTING`` field named by each. ``derive`` builds a stage's model from the tree;
``app.options`` makes the command line's flags from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from broker_adapter.errors import ConfigError, EnvelopeError

#: A claimed task's lease, and a publisher's claim on an outbox row, seconds.
DEFAULT_LEASE_S = 30.0
#: Pending stream entries idle this long are taken over from a consumer presumed dead.
DEFAULT_CLAIM_MIN_IDLE_MS = 60_000
#: The dedupe window: how long a request's identity is remembered, seconds (seven days).
DEFAULT_RETENTION_S = 7 * 24 * 3600.0

M = TypeVar("M", bound="ConfigModel")


@dataclass(frozen=True)
class Flag:
    """How a setting is set on the command line (``app.options`` reads it).

    Attributes:
        flag: the option, e.g. ``--lease``.
        env: the ``BA_*`` variable that is its default (the flag wins).
        metavar: the value's name in ``--help``.
        shown: what ``--help`` shows as the default when it is not a value (e.g. "off").
        cli_default: the command line's default where it differs from the model's.
    """

    flag: str
    env: str
    metavar: str | None = None
    shown: str | None = None
    cli_default: Any = None


def setting(
    default: Any = ...,
    *,
    help: str,
    flag: str | None = None,
    env: str | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    cli_default: Any = None,
    **bounds: Any,
) -> Any:
    """A settings field: ``default``, pydantic ``bounds`` (``ge=``, ``gt=``, ``le=``...),
    its ``help`` text and, for a setting the command line sets, its ``flag`` and ``env``
    variable (``Flag``). A setting that several models hold is one such field, made once
    and named by each (``lease_s: float = LEASE_SETTING``)."""
    extra = None
    if flag is not None:
        if env is None:
            raise TypeError(f"setting {flag} needs its BA_* variable")
        extra = {"cli": Flag(flag, env, metavar, shown, cli_default)}
    return Field(default, description=help, json_schema_extra=extra, **bounds)  # type: ignore[arg-type]


def flag_of(field: FieldInfo) -> Flag | None:
    """The command-line side of a field made by ``setting``, or ``None``."""
    extra = field.json_schema_extra
    cli = extra.get("cli") if isinstance(extra, dict) else None
    return cli if isinstance(cli, Flag) else None


def field_type(field: FieldInfo) -> Any:
    """The field's type with its bounds and validators, for checking one value alone."""
    return Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation


def section(model: type[M]) -> Any:
    """A field holding a section of the settings tree: a ``model`` built with its defaults
    when not given (a dict of its fields is accepted too). The command line's flags are
    made from the settings of every section, at any depth (``app.options``); a nested
    model that is a plain field (not a section) is that model's own and gets no flags."""
    return Field(default_factory=model, json_schema_extra={"section": True})


def is_section(field: FieldInfo) -> bool:
    """Whether ``field`` was made by ``section``."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("section") is True


def derive(model: type[M], *sources: BaseModel, **given: Any) -> M:
    """``model`` built from the settings of ``sources`` it has a field of the same name for
    (a later source wins over an earlier one), and ``given`` (which wins over all): how a
    stage's settings come from the tree above it, without copying them one by one."""
    shared: dict[str, Any] = {}
    for source in sources:
        shared.update(
            (name, getattr(source, name))
            for name in model.model_fields
            if name in type(source).model_fields and name not in given
        )
    return model(**shared, **given)


class SettingsRefused(ConfigError):
    """A ``ConfigError`` of a settings model, with each problem apart: ``(path, why)``
    (``path`` ``""``: the model as a whole), so that a section's refusal is told from the
    root of the tree (``AdapterConfig.ingest.rate_limit: ...``)."""

    def __init__(self, model: str, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        text = "; ".join(
            f"{model}.{where}: {why}" if where else f"{model}: {why}" for where, why in problems
        )
        super().__init__(text or f"{model}: invalid")


def refusal(model: str, exc: ValidationError) -> ConfigError:
    """One ``ConfigError`` for everything ``exc`` found wrong: ``Model.field: why; ...``;
    what a section refused is named by its path from ``model``."""
    problems: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err.get("loc", ()))
        cause = err.get("ctx", {}).get("error")
        if where and isinstance(cause, SettingsRefused):  # a section's: paths under it
            problems.extend(
                (f"{where}.{inner}" if inner else where, why) for inner, why in cause.problems
            )
            continue
        if isinstance(cause, EnvelopeError):  # its text repeats the field: keep the rest
            why = f"{cause.detail} [{cause.reason}]"
        else:
            why = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append((where, why))
    return SettingsRefused(model, problems)


class ConfigModel(BaseModel):
    """Frozen, no unknown fields, no infinite or NaN numbers; refusals are ``ConfigError``."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise refusal(type(self).__name__, exc) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """``BaseModel.model_validate``, refusing with a ``ConfigError`` as ``__init__``."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise refusal(cls.__name__, exc) from None


#: A claimed task's lease (and a publisher's claim on an outbox row), seconds.
LEASE_SETTING = setting(
    DEFAULT_LEASE_S,
    gt=0,
    help="a claimed task's lease, seconds; renewed every third of it",
    flag="--lease",
    env="BA_LEASE_S",
    metavar="S",
)
#: The dedupe window (``DEFAULT_RETENTION_S``): what each stage forgets past it is said
#: where the stage holds it (``TaskPolicy``, ``IngestConfig``, ``ReceiverConfig``...).
RETENTION_SETTING = setting(
    DEFAULT_RETENTION_S,
    gt=0,
    help="the dedupe window, seconds",
    flag="--retention",
    env="BA_RETENTION_S",
    metavar="SECONDS",
)
