"""Handlers: what a handler is, loading ``module:callable`` specs, and how its errors read.

A handler takes one ``handler.task.Task`` and returns a JSON value, or an awaitable of one;
raising ``RetryableError`` asks for another attempt. The calls themselves are made by
``calls.CallRun``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from broker_adapter.errors import ConfigError, RetryableError
from broker_adapter.handler.router import Router, load_router
from broker_adapter.handler.task import Task

#: A handler takes one ``Task`` and returns a JSON value, or an awaitable of one.
Handler = Callable[[Task], Any]

ERROR_TEXT_MAX_CHARS = 4000


def is_retryable(exc: BaseException) -> bool:
    """Whether a handler's exception asks for another attempt.

    Args:
        exc: what the handler raised.

    Returns:
        True for ``RetryableError`` and for any exception whose ``retryable`` is ``True``.
    """
    return isinstance(exc, RetryableError) or getattr(exc, "retryable", False) is True


def describe_error(exc: BaseException) -> str:
    """The error text carried in a reply: ``"ExcType: message"``, capped in length.

    Args:
        exc: the exception to describe.

    Returns:
        ``"ExcType: message"`` (just ``"ExcType"`` if the message is empty), at most
        ``ERROR_TEXT_MAX_CHARS`` characters.
    """
    text = str(exc)
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if len(out) > ERROR_TEXT_MAX_CHARS:
        out = out[: ERROR_TEXT_MAX_CHARS - 1] + "…"
    return out


def _searched(app_dir: str | Path | None) -> str:
    """Where ``load_handler`` looked for a module, for its "not found" message."""
    where = "on the import path"
    if app_dir is not None:
        where = f"in the app directory {os.path.abspath(app_dir)} or on the import path"
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or ".") == cwd for entry in sys.path):
        where += (
            f" (the current directory {cwd} is not on it; app_dir, --app-dir in the CLI,"
            " puts a directory first)"
        )
    return where


def load_app(spec: str, *, app_dir: str | Path | None = None) -> Router:
    """Import the ``Router`` named by ``"package.module:router"`` (``run --app``); a
    callable there is taken as a router of one (as ``--handler``).

    Raises:
        ConfigError: as ``load_handler``, or the object is neither a router nor a handler.
    """
    obj = _import_object(spec, app_dir, "app")
    if not isinstance(obj, Router):
        _check_callable(spec, obj)
    return load_router(obj, spec)


def load_handler(spec: str, *, app_dir: str | Path | None = None) -> Handler:
    """Import the handler named by ``"package.module:callable"``.

    The part after the colon may be dotted (``"pkg.mod:Class.method"``).

    Args:
        spec: the handler's import path.
        app_dir: a directory put first on ``sys.path`` (once) before the import, so that
            a module beside the caller's files is found; ``None`` leaves the path as it
            is (a console script's path does not hold the current directory).

    Returns:
        the callable (sync, or ``async def``).

    Raises:
        ConfigError: the spec is malformed, the module is not found or fails to import, the
            attribute is missing, or the object is not callable with one argument.
    """
    obj = _import_object(spec, app_dir, "handler")
    _check_callable(spec, obj)
    return cast(Handler, obj)


def _import_object(spec: str, app_dir: str | Path | None, what: str) -> Any:
    """The object ``"package.module:attr"`` names (``load_handler``'s errors)."""
    module_name, sep, attr_path = spec.strip().partition(":")
    names_ok = all(p.isidentifier() for p in module_name.split(".")) and all(
        p.isidentifier() for p in attr_path.split(".")
    )
    if not sep or not module_name or not attr_path or not names_ok:
        raise ConfigError(
            f"{what} {spec!r} is malformed: expected 'package.module:{_ATTR[what]}', "
            f"e.g. 'myapp.handlers:{_EXAMPLE[what]}'"
        )
    if app_dir is not None:
        first = os.path.abspath(app_dir)
        if first not in sys.path:
            sys.path.insert(0, first)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"{what} {spec!r}: module {missing!r} not found {_searched(app_dir)}"
            ) from exc
        raise ConfigError(
            f"{what} {spec!r}: importing {module_name!r} failed: {describe_error(exc)}"
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"{what} {spec!r}: importing {module_name!r} failed: {describe_error(exc)}"
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    return obj


_ATTR = {"handler": "callable", "app": "router"}
_EXAMPLE = {"handler": "summarise", "app": "router"}


def _check_callable(spec: str, obj: Any) -> None:
    if not callable(obj):
        raise ConfigError(
            f"handler {spec!r}: {spec.partition(':')[2].strip()!r} is a"
            f" {type(obj).__name__}, not callable"
        )
    _check_arity(spec, obj)


def _check_arity(spec: str, obj: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind(None)
    except TypeError:
        raise ConfigError(
            f"handler {spec!r} must accept one positional argument (the task); "
            f"its signature is {signature}"
        ) from None
