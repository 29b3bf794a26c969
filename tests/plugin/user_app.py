"""An application's router, as a user would write it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from broker_adapter import RetryableError, Router, Task

router = Router()
flaky_calls: list[int] = []


class Add(BaseModel):
    a: int
    b: int


class Sum(BaseModel):
    total: int


class Flaky(BaseModel):
    fail_times: int = Field(ge=0, le=5)


@router.task("add", payload=Add)
def add(task: Task) -> Sum:
    """Add two integers."""
    return Sum(total=task.args.a + task.args.b)


@router.task("flaky", payload=Flaky, max_attempts=5)
def flaky(task: Task) -> dict[str, int]:
    """Fail the first ``fail_times`` attempts, then succeed."""
    flaky_calls.append(task.attempt)
    if task.attempt <= task.args.fail_times:
        raise RetryableError("the target is busy", retry_after_s=30)
    return {"attempt": task.attempt}
