"""Every bad configuration is one ``ConfigError`` naming the model and field, and every
error the library raises is in the ``BrokerAdapterError`` tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker_adapter.app.adapter_config import AdapterConfig
from broker_adapter.backoff import Backoff
from broker_adapter.config import ConfigModel
from broker_adapter.errors import BrokerAdapterError, ConfigError, StageError
from broker_adapter.errors import RetryableError as RetryableFromHandlers
from broker_adapter.protocol.reply import BadReply
from broker_adapter.redis.client import check_redis_url, connect
from broker_adapter.redis.reader_config import ReaderConfig
from broker_adapter.stages.dispatch.dispatcher import DispatcherConfig
from broker_adapter.stages.ingest.config import IngestConfig
from broker_adapter.stages.receiver.receiver import ReceiverConfig
from broker_adapter.stages.worker.config import WorkerConfig
from broker_adapter.store.outbox_types import OutboxPolicy
from broker_adapter.store.task_types import TaskPolicy


def _run(**fields: Any) -> AdapterConfig:
    base: dict[str, Any] = {
        "redis_url": "redis://127.0.0.1:1/0",
        "db_path": Path("a.db"),
        "handler": "m:f",
        "keyring_path": Path("k.json"),
    }
    return AdapterConfig(**{**base, **fields})


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: _run(prefix="a b"), "AdapterConfig.prefix: bad key prefix 'a b'"),
        (lambda: _run(redis_url="http://x"), "AdapterConfig.redis_url: bad Redis URL: must start"),
        (lambda: _run(redis_url="redis://h:abc"), "AdapterConfig.redis_url: bad Redis URL: Port"),
        (lambda: _run(workers=0), "AdapterConfig.workers: "),
        (
            lambda: _run(ingest={"acl_principals": ("bad name",), "mode": "acl"}),
            "AdapterConfig.ingest.acl_principals.0:",
        ),
        (lambda: _run(keyring_path=None), "AdapterConfig: signed mode needs a keyring"),
        (lambda: IngestConfig(consumer="c", count=0), "IngestConfig.count: "),
        (lambda: ReceiverConfig(principal="a b"), "ReceiverConfig.principal: may hold only"),
        (lambda: DispatcherConfig(prefix="{x}"), "DispatcherConfig.prefix: bad key prefix"),
        (lambda: WorkerConfig(owner="w", prefix="{x}"), "WorkerConfig.prefix: bad key prefix"),
        (lambda: OutboxPolicy(max_attempts=0), "OutboxPolicy.max_attempts: "),
        (lambda: Backoff(base_s=-1), "Backoff.base_s: "),
        (lambda: TaskPolicy(lease_s=-5), "TaskPolicy.lease_s: "),
        (lambda: ReaderConfig(count=0), "ReaderConfig.count: "),
        (lambda: ReaderConfig.model_validate({"count": "many"}), "ReaderConfig.count: "),
    ],
)
def test_a_refused_setting_is_one_config_error_naming_its_field(build: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert needle in str(caught.value)
    assert isinstance(caught.value, ValueError)  # as pydantic's error was: callers keep working
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


def test_every_problem_is_named_once_without_repeating_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        _run(prefix="a b", workers=0)
    assert str(caught.value).count("AdapterConfig.") == 2
    with pytest.raises(ConfigError) as principal:
        ReceiverConfig(principal="")
    assert "principal: principal" not in str(principal.value)


@pytest.mark.parametrize(
    ("model", "fields", "ok"),
    [
        (TaskPolicy, {"lease_s": 0}, False),
        (TaskPolicy, {"lease_s": 0.001}, True),
        (TaskPolicy, {"lease_s": -5}, False),
        (TaskPolicy, {"lease_s": float("inf")}, False),
        (TaskPolicy, {"max_hops": -1}, False),
        (TaskPolicy, {"max_hops": 0}, True),
        (TaskPolicy, {"retention_s": 0}, False),
        (TaskPolicy, {"retention_s": 1}, True),
        (ReaderConfig, {"count": 0}, False),
        (ReaderConfig, {"count": 1}, True),
        (ReaderConfig, {"count": 10_000}, True),
        (ReaderConfig, {"count": 10_001}, False),
        (ReaderConfig, {"block_ms": 0}, False),  # BLOCK 0 would block for ever
        (ReaderConfig, {"block_ms": 1}, True),
        (ReaderConfig, {"claim_min_idle_ms": -1}, False),
        (ReaderConfig, {"claim_min_idle_ms": 0}, True),
        (ReaderConfig, {"max_deliveries": 0}, False),
        (ReaderConfig, {"max_deliveries": 1}, True),
        (ReaderConfig, {"max_entry_bytes": 0}, False),
        (ReaderConfig, {"max_entry_bytes": 1}, True),
    ],
)
def test_task_policy_and_reader_bounds_both_sides(
    model: type[ConfigModel], fields: dict[str, Any], ok: bool
) -> None:
    if ok:
        model(**fields)
    else:
        with pytest.raises(ConfigError, match=rf"{model.__name__}\.{next(iter(fields))}: "):
            model(**fields)


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        ({"ingest": {"claim_min_idle_ms": 0}}, False),  # the ingest's bound: refused at once
        ({"ingest": {"claim_min_idle_ms": 1}}, True),
        ({"ingest": {"max_entry_bytes": 1023}}, False),
        ({"ingest": {"max_entry_bytes": 1024}}, True),
        ({"ingest": {"mode": "signed", "acl_principals": ("alice",)}}, False),
        ({"name": "bad/name"}, False),  # the ingest's consumer name would refuse it
        ({"name": "adapter-1"}, True),
    ],
)
def test_the_adapter_refuses_what_its_ingest_would(fields: dict[str, Any], ok: bool) -> None:
    if ok:
        _run(**fields).ingest_config("a-ingest")
    else:
        with pytest.raises(ConfigError, match=r"^AdapterConfig"):
            _run(**fields)


@pytest.mark.parametrize(
    "model",
    [
        AdapterConfig,
        IngestConfig,
        ReceiverConfig,
        DispatcherConfig,
        WorkerConfig,
        TaskPolicy,
        OutboxPolicy,
        ReaderConfig,
        Backoff,
    ],
)
def test_every_settings_model_refuses_through_the_one_base(model: type[ConfigModel]) -> None:
    assert issubclass(model, ConfigModel)
    with pytest.raises(ConfigError, match=f"{model.__name__}.surprise: "):
        model(surprise=1)


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("redis://127.0.0.1:6390/0", True),
        ("rediss://:secret@host:6390", True),
        ("unix:///tmp/redis.sock", True),
        ("http://host", False),
        ("redis://host:abc", False),
        ("redis://host:65536", False),
        ("redis://host:65535", True),
        ("unix:///tmp/redis.sock?db=a", False),
    ],
)
def test_redis_urls_are_checked_before_any_client_exists(url: str, ok: bool) -> None:
    if ok:
        assert check_redis_url(url) == url
        connect(url).close()  # no connection is made until a command
        return
    with pytest.raises(ConfigError, match="bad Redis URL") as caught:
        connect(url)
    assert "secret" not in str(caught.value)


def test_a_refused_url_never_repeats_its_password() -> None:
    with pytest.raises(ConfigError) as caught:
        check_redis_url("redis://:hunter2-password@host:abc/0")
    assert "hunter2" not in str(caught.value)


def test_retryable_error_bad_reply_and_stage_error_are_in_the_tree() -> None:
    from broker_adapter import RetryableError

    assert RetryableError is RetryableFromHandlers  # the handlers' import keeps working
    assert issubclass(RetryableError, BrokerAdapterError)
    assert issubclass(BadReply, BrokerAdapterError)
    failed = StageError("ingest", RuntimeError("boom"))
    assert isinstance(failed, BrokerAdapterError)
    assert not isinstance(failed, ConfigError)
    assert str(failed) == "ingest stopped: RuntimeError: boom"
