"""The command line's help, defaults and environment variables, checked against the
variable table of docs/CONFIGURATION.md and the settings models (so that neither drifts from
the parser).

``python -m tests.unit.test_cli_help`` prints that table from the parser, and the table of
``run``'s settings from the settings tree, to paste into the page when a command, a variable
or a setting changes."""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import broker_adapter
from broker_adapter.app.adapter_config import AdapterConfig
from broker_adapter.app.cli import build_parser
from broker_adapter.app.options import settings_from
from broker_adapter.config import derive, flag_of, is_section
from broker_adapter.protocol.envelope import Envelope
from broker_adapter.stages.reconcile.reconciler import ReconcilePolicy
from broker_adapter.store.task_types import TaskPolicy

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md"
ENV_COMMANDS = ("run", "publish", "receive")
_ENV = re.compile(r"env (BA_[A-Z0-9_]+)\]")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command with its parser: ``run``, ..., ``dead-letters replay``."""
    for name, sub in _subparsers(build_parser()).items():
        yield name, sub
        for inner, parser in _subparsers(sub).items():
            yield f"{name} {inner}", parser


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    ]


def _env_of(action: argparse.Action) -> str | None:
    match = _ENV.search(action.help or "")
    return match.group(1) if match else None


def _parser_variables() -> dict[tuple[str, str], set[str]]:
    """(variable, flag) -> the top-level commands whose parser reads it."""
    found: dict[tuple[str, str], set[str]] = {}
    for name, parser in _commands():
        for action in _options(parser):
            env = _env_of(action)
            if env is not None:
                flag = next(o for o in action.option_strings if o.startswith("--"))
                found.setdefault((env, flag), set()).add(name.split()[0])
    return found


def variable_table() -> str:
    """The Markdown table of every variable the parser reads, in the parser's order."""
    order = [name for name, _ in _commands() if " " not in name]
    rows = ["| variable | flag | commands |", "|---|---|---|"]
    for (env, flag), commands in _parser_variables().items():
        listed = ", ".join(sorted(commands, key=order.index))
        rows.append(f"| `{env}` | `{flag}` | {listed} |")
    return "\n".join(rows)


def _documented_variables() -> dict[tuple[str, str], set[str]]:
    """The table of docs/CONFIGURATION.md's "Environment variables": (variable, flag) ->
    commands."""
    text = CONFIGURATION.read_text(encoding="utf-8")
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(BA_[A-Z0-9_]+)` \| `(--[a-z-]+)` \| ([^|]+) \|$", section, re.M)
    return {
        (env, flag): {c.split("(")[0].strip() for c in commands.split(",")}
        for env, flag, commands in rows
    }


def test_every_option_of_every_command_has_help_text() -> None:
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in _commands()
        for action in _options(parser)
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert missing == []


@pytest.mark.parametrize("command", ENV_COMMANDS)
def test_every_flag_of_run_publish_and_receive_has_a_variable(command: str) -> None:
    parser = dict(_commands())[command]
    without = [a.option_strings for a in _options(parser) if _env_of(a) is None]
    assert without == []


def test_the_docs_list_exactly_the_variables_the_parser_reads() -> None:
    assert _documented_variables() == _parser_variables()


def test_help_shows_defaults_and_variables() -> None:
    text = dict(_commands())["run"].format_help()
    assert "[default: 30.0; env BA_LEASE_S]" in " ".join(text.split())
    assert "[required; env BA_REDIS_URL]" in " ".join(text.split())


def test_the_flag_defaults_are_the_settings_defaults() -> None:
    run = {a.dest: a.default for a in _options(dict(_commands())["run"])}
    for dest in (
        "workers",
        "lease_s",
        "worker.grace_s",
        "ingest.claim_min_idle_ms",
        "prefix",
        "ingest.mode",
        "ingest.rate_limit",
        "ingest.rate_burst",
        "ingest.max_open_tasks",
    ):
        assert run[dest] == _field(dest).default, dest
    publish = {a.dest: a.default for a in _options(dict(_commands())["publish"])}
    envelope = inspect.signature(Envelope.__init__).parameters
    assert publish["max_attempts"] == envelope["max_attempts"].default


def _field(path: str) -> FieldInfo:
    """The field of the settings tree at ``path`` (``ingest.rate_limit``)."""
    model: type[BaseModel] = AdapterConfig
    *sections, name = path.split(".")
    for part in sections:
        kind = model.model_fields[part].annotation
        assert isinstance(kind, type)
        assert issubclass(kind, BaseModel)
        model = kind
    return model.model_fields[name]


def _tree(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every setting of the tree under ``model``, sections walked, with its path."""
    for name, field in model.model_fields.items():
        kind = field.annotation
        if is_section(field):
            assert isinstance(kind, type)
            assert issubclass(kind, BaseModel)
            yield from _tree(kind, f"{path}{name}.")
        else:
            yield f"{path}{name}", field


def test_every_setting_of_the_tree_with_a_flag_is_a_flag_of_run_with_its_default() -> None:
    run = {a.dest: a for a in _options(dict(_commands())["run"])}
    settings = dict(_tree(AdapterConfig))
    # every setting of the tree has a flag but these: the four the commands share (--redis,
    # --db, --handler or --app, --keyring) and the reconciler's inner workings
    wiring = {"redis_url", "db_path", "handler", "keyring_path"}
    unflagged = {path for path, field in settings.items() if flag_of(field) is None}
    assert unflagged - wiring == {
        f"reconcile.{name}"
        for name in ReconcilePolicy.model_fields
        if not name.startswith("operator_timeout")
    }
    for dest, field in settings.items():
        cli = flag_of(field)
        if cli is None:
            continue
        action = run[dest]
        assert action.option_strings[0] == cli.flag, dest
        assert cli.env in (action.help or ""), dest
        if cli.cli_default is None:
            default = list(field.default) if isinstance(field.default, tuple) else field.default
            assert action.default == default, dest
    # the settings the review found unreachable from the command line
    for dest in ("worker.call_timeout_s", "worker_publish", "tasks.max_hops"):
        assert dest in run


def settings_table() -> str:
    """The Markdown table of every setting of ``run`` in the settings tree: its path, flag,
    variable, default and help, in the tree's order."""
    rows = ["| setting | flag | variable | default | meaning |", "|---|---|---|---|---|"]
    for path, field in _tree(AdapterConfig):
        cli = flag_of(field)
        if cli is None:
            continue
        if cli.shown is not None:
            default = cli.shown
        elif cli.cli_default is not None:
            default = f"`{cli.cli_default}`"
        elif field.annotation is bool:
            default = "on" if field.default else "off"
        elif isinstance(field.default, tuple):
            default = "none" if not field.default else ", ".join(field.default)
        else:
            default = f"`{field.default}`"
        rows.append(f"| `{path}` | `{cli.flag}` | `{cli.env}` | {default} | {field.description} |")
    return "\n".join(rows)


def _documented_settings() -> str:
    text = CONFIGURATION.read_text(encoding="utf-8")
    section = text.split("\n## Settings of run\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_the_docs_table_of_run_settings_is_the_settings_tree() -> None:
    assert _documented_settings() == settings_table()


_RUN = ["run", "--redis", "redis://127.0.0.1:1/0", "--db", "a.db", "--handler", "m:f"]


@pytest.mark.parametrize(
    ("flag", "value", "ok"),
    [
        ("--claim-min-idle-ms", "0", False),  # the ingest refuses it: so does the parser
        ("--claim-min-idle-ms", "1", True),
        ("--workers", "0", False),
        ("--workers", "64", True),
        ("--workers", "65", False),
        ("--lease", "0", False),
        ("--lease", "inf", False),
        ("--lease", "0.001", True),
        ("--max-entry-bytes", "1023", False),
        ("--max-entry-bytes", "1024", True),
        ("--max-entry-fields", "7", False),
        ("--max-entry-fields", "8", True),
        ("--max-hops", "-1", False),
        ("--max-hops", "0", True),
        ("--partitions", "0", False),
        ("--partitions", "1024", True),
        ("--partitions", "1025", False),
    ],
)
def test_a_bound_of_the_settings_is_checked_as_the_flag_is_parsed(
    flag: str, value: str, ok: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    if ok:
        build_parser().parse_args([*_RUN, flag, value])
        return
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args([*_RUN, flag, value])
    assert caught.value.code == 2
    assert f"argument {flag}: {value!r}: " in capsys.readouterr().err


def test_a_variable_out_of_bounds_fails_at_parse_time_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BA_CLAIM_MIN_IDLE_MS", "0")
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(_RUN)
    assert caught.value.code == 2
    assert "--claim-min-idle-ms: '0': Input should be greater than or equal to 1" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("BA_CLAIM_MIN_IDLE_MS", "1")
    assert getattr(build_parser().parse_args(_RUN), "ingest.claim_min_idle_ms") == 1


def test_the_flags_of_run_build_the_settings_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BA_WORKER_PUBLISH", "false")
    monkeypatch.setenv("BA_OPERATOR_TIMEOUT_S", "60")
    args = build_parser().parse_args(
        [*_RUN, "--max-hops", "3", "--call-timeout", "5", "--operator-timeout-action", "fail"]
    )
    config = AdapterConfig(
        redis_url=args.redis,
        db_path=args.db,
        handler=args.handler,
        keyring_path=Path("k.json"),
        **settings_from(args, AdapterConfig),
    )
    assert (config.tasks.max_hops, config.worker.call_timeout_s, config.worker_publish) == (
        3,
        5.0,
        False,
    )
    assert config.reconcile.operator_timeout_s == 60.0
    assert config.reconcile.operator_timeout_action == "fail"
    assert config.app_dir == Path()  # the command line's default: the working directory
    policy = derive(TaskPolicy, config, config.tasks)
    assert (policy.max_hops, policy.lease_s, policy.retention_s) == (3, 30.0, 604800.0)
    ingest = config.ingest_config("a-ingest")
    assert (ingest.claim_min_idle_ms, ingest.prefix, ingest.max_entry_bytes) == (
        60_000,
        "ba",
        256 * 1024,
    )


def test_variables_are_defaults_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["run", "--redis", "redis://127.0.0.1:1/0", "--db", "a.db", "--handler", "m:f"]
    monkeypatch.setenv("BA_WORKERS", "5")
    monkeypatch.setenv("BA_ACL_PRINCIPALS", "alice, bob")
    monkeypatch.setenv("BA_APP_DIR", "/srv/app")
    args = build_parser().parse_args(base)
    principals = getattr(args, "ingest.acl_principals")
    assert (args.workers, principals, args.app_dir) == (5, ["alice", "bob"], "/srv/app")
    args = build_parser().parse_args(
        [*base, "--workers", "3", "--acl-principal", "carol", "--acl-principal", "dave"]
    )
    assert (args.workers, getattr(args, "ingest.acl_principals")) == (3, ["carol", "dave"])
    monkeypatch.setenv("BA_REDIS_URL", "redis://127.0.0.1:2/0")
    monkeypatch.setenv("BA_DB", "b.db")
    monkeypatch.setenv("BA_HANDLER", "n:g")
    args = build_parser().parse_args(["run"])  # required flags come from the environment
    assert (args.redis, args.db, args.handler) == ("redis://127.0.0.1:2/0", "b.db", "n:g")


def test_a_bad_variable_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BA_WORKERS", "many")
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["run", "--redis", "redis://x", "--db", "a", "--handler", "m:f"])
    assert caught.value.code == 2


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.strip() == f"broker-adapter {broker_adapter.__version__}"


if __name__ == "__main__":
    print(variable_table(), settings_table(), sep="\n\n")
