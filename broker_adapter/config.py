"""The base of every settings model: checked when built, refused as one ``ConfigError``.

Each settings class (``AdapterConfig``, ``IngestConfig``, ``WorkerConfig``, ``TaskPolicy``,
``ReaderConfig``, ...) subclasses ``ConfigModel`` and states its bounds as pydantic fields
and validators. ``Model(...)`` stays the way to build one; what it refuses comes out as a
``ConfigError`` (a ``ValueError``, like pydantic's own error) naming the model and each
field at fault, so callers and the CLI handle one error class and never see a pydantic
traceback.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from broker_adapter.errors import ConfigError, EnvelopeError

#: A claimed task's lease, and a publisher's claim on an outbox row, seconds.
DEFAULT_LEASE_S = 30.0
#: Pending stream entries idle this long are taken over from a consumer presumed dead.
DEFAULT_CLAIM_MIN_IDLE_MS = 60_000


def refusal(model: str, exc: ValidationError) -> ConfigError:
    """One ``ConfigError`` for everything ``exc`` found wrong: ``Model.field: why; ...``."""
    problems = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err.get("loc", ()))
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, EnvelopeError):  # its text repeats the field: keep the rest
            why = f"{cause.detail} [{cause.reason}]"
        else:
            why = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(f"{model}.{where}: {why}" if where else f"{model}: {why}")
    return ConfigError("; ".join(problems) or f"{model}: invalid")


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
