"""The client's pure parts: which error each reply status raises, the derived message ids,
and the arguments refused before anything is sent."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from broker_adapter import (
    ConfigError,
    RequestCancelled,
    RequestConflict,
    RequestError,
    RequestExpired,
    RequestFailed,
    RequestHopLimit,
    RequestTimeout,
)
from broker_adapter.client.request import (
    AsyncClient,
    cancel_message_id,
    message_id_for,
    outcome,
)
from broker_adapter.handler.router import Router
from broker_adapter.protocol.reply import Reply
from broker_adapter.protocol.signing import Keyring

KEYS = Keyring({"alice": {"k1": "alice's secret for the unit tests: 32+ bytes"}})


@pytest.mark.parametrize(
    ("status", "error"),
    [
        ("failed", RequestFailed),
        ("expired", RequestExpired),
        ("hop_limit", RequestHopLimit),
        ("cancelled", RequestCancelled),
        ("conflict", RequestConflict),
        ("something-new", RequestError),
    ],
)
def test_each_status_but_done_raises_its_error_with_the_reply(
    status: str, error: type[RequestError]
) -> None:
    reply = Reply(reply_id="r-1", status=status, message_id="m1", error="why")
    with pytest.raises(error) as raised:
        outcome(reply)
    assert type(raised.value) is error
    assert raised.value.reply is reply
    assert raised.value.message_id == "m1"
    done = Reply(reply_id="r-2", status="done", message_id="m2")
    assert outcome(done) is done


def test_a_timeout_is_a_timeout_error_naming_the_message_id() -> None:
    exc = RequestTimeout("m-7", 2.5)
    assert isinstance(exc, TimeoutError)
    assert "'m-7'" in str(exc)
    assert "2.5 s" in str(exc)


def test_derived_message_ids_are_stable_and_scoped_by_principal_and_instance() -> None:
    one = message_id_for("alice", "host-1", "restart-web")
    assert one == message_id_for("alice", "host-1", "restart-web")
    assert one.startswith("k-")
    assert len(one) == 42
    others = {
        message_id_for("bob", "host-1", "restart-web"),
        message_id_for("alice", "host-2", "restart-web"),
        message_id_for("alice", "host-1", "restart-db"),
    }
    assert one not in others
    assert len(others) == 3
    assert cancel_message_id("m1") == cancel_message_id("m1") != cancel_message_id("m2")


def test_a_client_with_the_router_refuses_a_payload_its_task_would_fail() -> None:
    router = Router()

    class Restart(BaseModel):
        service: str

    router.add("restart", lambda task: None, payload=Restart)
    client = AsyncClient("redis://127.0.0.1:1/0", "alice", KEYS, router=router)
    good = client.envelope("restart", {"service": "web"}, "m1", 60.0)
    assert good.task == "restart"
    with pytest.raises(ConfigError, match="service"):
        client.envelope("restart", {}, "m2", 60.0)
    with pytest.raises(ConfigError, match="unknown"):
        client.envelope("stop", {"service": "web"}, "m3", 60.0)
    assert (
        AsyncClient("redis://127.0.0.1:1/0", "alice", KEYS).envelope("stop", {}, "m4", 60.0).task
        == "stop"
    )  # without the router, the adapter decides


def test_client_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="resend_after_s"):
        AsyncClient("redis://127.0.0.1:1/0", "alice", KEYS, resend_after_s=0)
    with pytest.raises(ConfigError, match="resend_after_s"):
        AsyncClient("redis://127.0.0.1:1/0", "alice", KEYS, resend_after_s=5, resend_max_s=1)
    with pytest.raises(ConfigError, match="instance"):
        AsyncClient("redis://127.0.0.1:1/0", "alice", KEYS, instance="")
    with pytest.raises(ConfigError, match="no keys for principal"):
        AsyncClient("redis://127.0.0.1:1/0", "bob", KEYS)
    client = AsyncClient("redis://127.0.0.1:1/0", "alice", KEYS, instance="i1")
    assert client.message_id("given", None) == "given"
    assert client.message_id(None, "k") == message_id_for("alice", "i1", "k")
    with pytest.raises(ConfigError, match="message_id= or key="):
        client.message_id(None, None)
