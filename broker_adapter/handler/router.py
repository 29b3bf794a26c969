"""Named tasks: a ``Router`` maps the envelope's ``task`` name to a handler, the pydantic
model its payload must validate against, the model of its result, and per-task settings.

    router = Router()

    @router.task("restart", payload=RestartArgs, call_timeout_s=30, concurrency=2)
    async def restart(task): ...

An envelope without a ``task`` member goes to the router's default task (``default=True``,
or the only handler of a router of one: ``Router.of_handler``). The worker routes each
claimed task (``resolve``): an unknown name or a payload that does not validate ends the
task ``failed`` without calling any handler and without a retry (``RouteError``).
``validate_payload`` makes the same check where a request is published, and ``schemas``
gives every task's payload and result JSON Schema (usable as tool definitions).

This module holds handlers only as opaque callables: it is shared by the worker (stages)
and the publishing client, which import nothing of each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, get_type_hints

from pydantic import BaseModel, ValidationError

from broker_adapter.errors import ConfigError
from broker_adapter.protocol.envelope import MAX_ATTEMPTS_LIMIT, check_task_name

H = TypeVar("H", bound=Callable[..., Any])

#: Validation errors quoted in a reply, at most.
MAX_REPORTED_ERRORS = 20


class RouteError(Exception):
    """A claimed task that no handler may run: its name is unknown, or its payload does not
    validate. Never retried (the same request would fail the same way).

    Attributes:
        reason: ``"unknown_task"`` or ``"invalid_payload"``.
        errors: for ``invalid_payload``, pydantic's errors (location, message, type).
    """

    retryable = False

    def __init__(self, reason: str, detail: str, errors: list[dict[str, Any]] | None = None):
        self.reason = reason
        self.errors = errors or []
        super().__init__(detail)


@dataclass(frozen=True)
class TaskDef:
    """One named task of a ``Router``.

    Attributes:
        name: the ``task`` name in the envelope (``None``: the default of a router of one).
        handler: called with the ``Task`` (sync, or ``async def``).
        payload: the pydantic model the payload must validate against; the handler reads
            the validated instance as ``task.args``. ``None``: an untyped payload (a dict).
        result: the model of the result, for its schema (a returned model is sent as its
            JSON form whatever this says); read from the handler's return annotation when
            not given.
        call_timeout_s: this task's call timeout (still capped by the deadline); ``None``:
            the worker's ``--call-timeout``.
        max_attempts: the most attempts this task gets, whatever the envelope asks for, and
            the default a client publishes with; ``None``: the envelope's.
        concurrency: at most this many calls of this task at once in one worker process
            (a target that accepts only N calls); ``None``: no limit of its own.
        description: the handler's docstring (the tool description in ``schemas``).
    """

    name: str | None
    handler: Callable[..., Any]
    payload: type[BaseModel] | None = None
    result: type[BaseModel] | None = None
    call_timeout_s: float | None = None
    max_attempts: int | None = None
    concurrency: int | None = None
    description: str | None = None

    def validate(self, payload: dict[str, Any]) -> BaseModel | None:
        """The payload as this task's model (``None`` for an untyped task).

        Raises:
            RouteError: ``invalid_payload``, with pydantic's errors.
        """
        if self.payload is None:
            return None
        try:
            return self.payload.model_validate(payload)
        except ValidationError as exc:
            errors = [
                {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                for e in exc.errors(include_url=False, include_input=False)
            ][:MAX_REPORTED_ERRORS]
            where = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(payload)'}: {e['msg']}" for e in errors
            )
            raise RouteError(
                "invalid_payload",
                f"payload of task {self.name!r} does not validate against"
                f" {self.payload.__name__}: {where}",
                errors,
            ) from None


class Router:
    """Named tasks, each with its handler, payload model and settings (see the module).

    Args:
        default: the name an envelope without ``task`` goes to (or mark a task
            ``default=True``); ``None``: such an envelope ends ``failed`` (unknown task),
            unless the router has a nameless handler (``of_handler``).
    """

    def __init__(self, *, default: str | None = None) -> None:
        self._tasks: dict[str | None, TaskDef] = {}
        self._default = None if default is None else check_task_name(default)

    @classmethod
    def of_handler(cls, handler: Callable[..., Any]) -> Router:
        """A router of one: ``handler`` serves every envelope without a ``task`` name."""
        router = cls()
        router._tasks[None] = TaskDef(None, handler, description=inspect.getdoc(handler))
        return router

    def task(
        self,
        name: str,
        *,
        payload: type[BaseModel] | None = None,
        result: type[BaseModel] | None = None,
        call_timeout_s: float | None = None,
        max_attempts: int | None = None,
        concurrency: int | None = None,
        default: bool = False,
    ) -> Callable[[H], H]:
        """Register the decorated handler as task ``name`` (see ``TaskDef``); the handler is
        returned as it is, so ``effects.side_effect`` may decorate it too, in either order.

        Raises:
            ConfigError: a bad or repeated name, a payload that is not a pydantic model, a
                bad setting, or a second default.
        """

        def register(handler: H) -> H:
            self.add(
                name,
                handler,
                payload=payload,
                result=result,
                call_timeout_s=call_timeout_s,
                max_attempts=max_attempts,
                concurrency=concurrency,
                default=default,
            )
            return handler

        return register

    def add(
        self,
        name: str,
        handler: Callable[..., Any],
        *,
        payload: type[BaseModel] | None = None,
        result: type[BaseModel] | None = None,
        call_timeout_s: float | None = None,
        max_attempts: int | None = None,
        concurrency: int | None = None,
        default: bool = False,
    ) -> TaskDef:
        """``task`` without the decorator. Returns the registered ``TaskDef``."""
        try:
            if check_task_name(name) is None:
                raise ValueError("a task needs a name")
        except ValueError as exc:
            raise ConfigError(f"task name {name!r}: {exc}") from None
        if name in self._tasks:
            raise ConfigError(f"task {name!r} is registered twice")
        if not callable(handler):
            raise ConfigError(f"task {name!r}: the handler is not callable")
        for what, model in (("payload", payload), ("result", result)):
            if model is not None and not _is_model(model):
                raise ConfigError(f"task {name!r}: {what} must be a pydantic model class")
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ConfigError(f"task {name!r}: call_timeout_s must be > 0")
        if max_attempts is not None and not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise ConfigError(f"task {name!r}: max_attempts must be 1..{MAX_ATTEMPTS_LIMIT}")
        if concurrency is not None and concurrency < 1:
            raise ConfigError(f"task {name!r}: concurrency must be >= 1")
        if default:
            if self._default is not None and self._default != name:
                raise ConfigError(f"task {name!r}: the default is {self._default!r} already")
            self._default = name
        spec = TaskDef(
            name,
            handler,
            payload,
            result if result is not None else _returned_model(handler),
            call_timeout_s,
            max_attempts,
            concurrency,
            inspect.getdoc(handler),
        )
        self._tasks[name] = spec
        return spec

    # -- reading ---------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The registered names (without the nameless default of a router of one)."""
        return [n for n in self._tasks if n is not None]

    @property
    def default(self) -> str | None:
        return self._default

    def __iter__(self) -> Iterator[TaskDef]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, name: str | None) -> TaskDef | None:
        """The task an envelope naming ``name`` (``None``: none) goes to, or ``None``."""
        if name is None:
            return self._tasks.get(None) or (
                None if self._default is None else self._tasks.get(self._default)
            )
        return self._tasks.get(name)

    def resolve(self, name: str | None, payload: dict[str, Any]) -> tuple[TaskDef, Any]:
        """The task ``name`` goes to and its validated payload (``None`` if untyped).

        Raises:
            RouteError: ``unknown_task`` or ``invalid_payload``.
        """
        spec = self.get(name)
        if spec is None:
            known = ", ".join(repr(n) for n in self.names) or "none"
            asked = "no task name (and no default task)" if name is None else repr(name)
            raise RouteError("unknown_task", f"unknown task {asked}; this adapter serves {known}")
        return spec, spec.validate(payload)

    def validate_payload(self, task: str | None, payload: dict[str, Any]) -> Any:
        """``validate_payload(self, task, payload)``."""
        return validate_payload(self, task, payload)

    def schemas(self) -> list[dict[str, Any]]:
        """Every named task's ``{"name", "description", "payload", "result"}``, the last two
        JSON Schemas (``{"type": "object"}`` for an untyped payload, ``{}`` for an untyped
        result): the shape of a tool definition for LLM tool calling."""
        out = []
        for spec in self._tasks.values():
            out.append(
                {
                    "name": spec.name,
                    "description": spec.description or "",
                    "default": spec.name is not None and spec.name == self._default,
                    "payload": (
                        {"type": "object"}
                        if spec.payload is None
                        else spec.payload.model_json_schema()
                    ),
                    "result": {} if spec.result is None else spec.result.model_json_schema(),
                }
            )
        return out


def validate_payload(router: Router, task: str | None, payload: dict[str, Any]) -> Any:
    """Check a payload against ``router`` before publishing it, as the adapter will: the
    validated model (``None`` for an untyped task).

    Raises:
        RouteError: ``unknown_task`` or ``invalid_payload`` (a request the adapter would
            end ``failed``).
    """
    return router.resolve(task, payload)[1]


def load_router(obj: Any, spec: str) -> Router:
    """``obj`` (what ``spec`` named) as a router: a ``Router`` as it is, a callable as a
    router of one.

    Raises:
        ConfigError: neither.
    """
    if isinstance(obj, Router):
        if len(obj) == 0:
            raise ConfigError(f"app {spec!r}: the router has no task")
        return obj
    if callable(obj):
        return Router.of_handler(obj)
    raise ConfigError(f"app {spec!r} is a {type(obj).__name__}, not a Router")


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _returned_model(handler: Callable[..., Any]) -> type[BaseModel] | None:
    """The pydantic model ``handler`` is annotated to return, if any."""
    try:
        hints = get_type_hints(handler)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: no schema
        return None
    returned = hints.get("return")
    return returned if _is_model(returned) else None
