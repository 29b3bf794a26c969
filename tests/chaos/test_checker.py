"""The checker's rules on hand-made histories and final states (no Redis, no processes)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.chaos.checker import VIOLATIONS, CheckConfig, CheckResult, check, percentile
from tests.chaos.history import Event
from tests.chaos.model import (
    AttemptRec,
    DeadLetterRec,
    EffectRec,
    FinalState,
    HistoryModel,
    InboxRec,
    OutboxRec,
    ReceiptRec,
    TaskRec,
)
from tests.chaos.nemesis import command_starts

pytestmark = pytest.mark.chaos

FP = "f" * 64
FP2 = "e" * 64


class H:
    """A tiny history builder: events at increasing monotonic times."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.t = 100.0

    def _e(self, proc: str, typ: str, f: str, **kw: Any) -> None:
        self.t += 1.0
        self.events.append(
            {"t": self.t, "wall": 1000.0 + self.t, "proc": proc, "type": typ, "f": f, **kw}
        )

    def publish(
        self,
        key: str,
        *,
        fp: str = FP,
        kind: str = "ok",
        cls: str = "task",
        seq: int = 1,
        outcome: str = "ok",
        reasons: tuple[str, ...] = (),
        claims: str | None = None,
    ) -> None:
        proc = f"agent-{key.split(':')[0]}"
        value = {
            "kind": kind,
            "class": cls,
            "seq": seq,
            "fingerprint": fp,
            "reasons": list(reasons),
            "claims": claims,
        }
        self._e(proc, "invoke", "publish", key=key, value=value)
        if outcome == "ok":
            self._e(proc, "ok", "publish", key=key, value={"fingerprint": fp, "entry_id": "1-0"})
        else:
            self._e(proc, outcome, "publish", key=key, value={"fingerprint": fp}, error="timeout")

    def fault(self, fault: str, fid: str = "1") -> None:
        self._e("nemesis", "info", "start", value={"id": fid, "fault": fault, "target": "x"})
        self._e("nemesis", "info", "stop", value={"id": fid, "fault": fault, "target": "x"})

    def forge(
        self,
        mark: str = "1.0",
        *,
        reply_id: str = "r-ghost",
        target: str = "invented",
        body_hash: str = "hf",
        reasons: tuple[str, ...] = ("bad_signature",),
        outcome: str = "ok",
    ) -> None:
        value = {
            "mark": mark,
            "principal": "p1",
            "shape": "wrong_secret",
            "reply_id": reply_id,
            "target": target,
            "hash": body_hash,
            "reasons": list(reasons),
        }
        self._e("nemesis", "invoke", "forge", value=value)
        self._e("nemesis", outcome, "forge", value={"mark": mark, "entry_id": "9-0"})

    def replay(self, key: str = "p1:m000001", state: str | None = "done") -> None:
        value = {"source": "1-0", "state": state}
        self._e("nemesis", "invoke", "replay", key=key, value=value)
        self._e("nemesis", "ok", "replay", key=key, value=dict(value, entry_id="8-0"))

    def model(self) -> HistoryModel:
        return HistoryModel.from_events(self.events)


def done_task(
    key: str = "p1:m000001", task_id: str = "t1", fence: int = 1, *, fp: str = FP
) -> FinalState:
    """A final state in which ``key`` ran once, was answered and applied: all rules hold."""
    principal, _, mid = key.partition(":")
    rid = f"r-{task_id}"
    return FinalState(
        tasks=[
            TaskRec(
                task_id,
                principal,
                mid,
                "done",
                fence,
                fingerprint=fp,
                result={"fence": fence, "attempt": fence},
            )
        ],
        inbox=[InboxRec(principal, mid, fp, task_id)],
        outbox=[OutboxRec(rid, task_id, principal, mid, "done", "sent", "h1", fence=fence)],
        receipts=[ReceiptRec(rid, principal, "h1", task_id, "done", fence, received_at=1110.0)],
        receiver_effects={rid: 1},
        ledger_principals={principal},
        effects=[EffectRec(f"ba:{task_id}", task_id, principal, mid, fence, fence)],
        attempts=[AttemptRec(task_id, principal, mid, fence, fence, "start")],
        reply_copies={rid: 1},
        pending={"in ba-ingest": 0},
        undelivered={"in ba-ingest": 0},
        integrity={"adapter": "ok"},
        wal_bytes={"adapter": 0},
    )


def published(key: str = "p1:m000001", **kw: Any) -> H:
    h = H()
    h.publish(key, **kw)
    return h


def violations(result: CheckResult) -> set[str]:
    return set(result.violations)


def test_checker_accepts_a_clean_run() -> None:
    result = check(published().model(), done_task())
    assert result.valid, result.violations
    assert result.info["latency_s"]["n"] == 1
    assert result.info["tasks_by_state"] == {"done": 1}


def test_checker_flags_an_acknowledged_publish_that_vanished_as_lost() -> None:
    result = check(published().model(), FinalState())
    assert "lost" in violations(result)
    assert result.examples["lost"][0]["key"] == "p1:m000001"


def test_checker_allows_a_loss_before_a_wipe_in_ephemeral_mode_only() -> None:
    h = published()
    h.fault("redis-wipe")
    ephemeral = check(h.model(), FinalState(), CheckConfig(mode="ephemeral"))
    assert "lost" not in violations(ephemeral)
    assert ephemeral.info["lost_attributed"]["count"] == 1
    assert "lost" in violations(check(h.model(), FinalState(), CheckConfig(mode="durable")))


def test_checker_allows_an_everysec_loss_only_inside_the_window_before_a_kill() -> None:
    near = published()
    near.fault("redis-kill")  # starts 1 s after the ack: inside a 2.5 s window
    cfg = CheckConfig(mode="everysec", loss_window_s=2.5)
    assert "lost" not in violations(check(near.model(), FinalState(), cfg))
    far = published()
    far.t += 30.0
    far.fault("redis-kill")
    assert "lost" in violations(check(far.model(), FinalState(), cfg))


def test_checker_does_not_count_an_indeterminate_publish_as_lost() -> None:
    h = published(outcome="info")
    result = check(h.model(), FinalState())
    assert result.valid, result.violations
    recovered = check(h.model(), done_task())
    assert recovered.info["recovered_indeterminate"] == 1


def test_checker_flags_a_key_nobody_published() -> None:
    result = check(H().model(), done_task())
    assert "unexpected_ingest" in violations(result)


def test_checker_flags_stored_content_the_principal_never_sent() -> None:
    result = check(published(fp=FP2).model(), done_task())
    assert "unexpected_ingest" in violations(result)


def test_checker_flags_a_spoof_charged_to_the_principal_it_claims() -> None:
    h = published()
    h.publish(
        "p2:x000003",
        fp=FP2,
        kind="spoof",
        cls="reject",
        claims="p1:m000001",
        reasons=("sender_mismatch",),
    )
    final = done_task(fp=FP2)
    final.dead_letters.append(DeadLetterRec("dead", "9-0", "sender_mismatch", "p2:x000003"))
    assert "charged_to_claimed_principal" in violations(check(h.model(), final))


def test_checker_flags_two_tasks_and_two_effects_for_one_key() -> None:
    final = done_task()
    second = done_task(task_id="t2")
    for name in ("tasks", "outbox", "receipts", "effects"):
        getattr(final, name).extend(getattr(second, name))
    final.receiver_effects.update(second.receiver_effects)
    final.reply_copies.update(second.reply_copies)
    got = violations(check(published().model(), final))
    assert {"duplicate_tasks", "duplicated_effect"} <= got


def test_checker_flags_a_done_task_without_its_effect() -> None:
    final = replace(done_task(), effects=[])
    assert violations(check(published().model(), final)) == {"missing_effect"}


def test_checker_allows_an_effect_of_a_cancelled_task_but_not_of_a_live_one() -> None:
    cancelled = done_task()
    cancelled.tasks[0] = replace(cancelled.tasks[0], state="cancelled", result=None)
    result = check(published().model(), cancelled)
    assert result.valid, result.violations
    assert result.info["effects"]["without_done_by_state"] == {"cancelled": 1}
    pending = done_task()
    pending.tasks[0] = replace(pending.tasks[0], state="pending", result=None)
    got = violations(check(published().model(), pending))
    assert {"not_terminal", "effect_without_outcome"} <= got


def test_checker_flags_a_commit_under_an_older_fence() -> None:
    final = done_task(fence=2)
    final.tasks[0] = replace(final.tasks[0], result={"fence": 1})
    result = check(published().model(), final)
    assert violations(result) == {"stale_commit"}
    assert result.examples["stale_commit"][0]["result_fence"] == 1


def test_checker_flags_a_reply_or_receipt_under_another_fence() -> None:
    final = done_task(fence=2)
    final.outbox[0] = replace(final.outbox[0], fence=1)
    final.receipts[0] = replace(final.receipts[0], fence=1)
    result = check(published().model(), final)
    assert violations(result) == {"stale_commit"}
    assert result.counts["stale_commit"] == 2


def test_checker_flags_a_handler_that_ran_above_the_final_fence() -> None:
    final = done_task()
    final.attempts.append(AttemptRec("t1", "p1", "m000001", 5, 5, "start"))
    assert "stale_commit" in violations(check(published().model(), final))


def test_checker_flags_missing_and_mismatched_receipts() -> None:
    missing = replace(done_task(), receipts=[], receiver_effects={})
    assert "missing_receipt" in violations(check(published().model(), missing))
    other = done_task()
    other.receipts[0] = replace(other.receipts[0], content_hash="h2")
    assert violations(check(published().model(), other)) == {"receipt_mismatch"}


def test_checker_flags_a_reply_applied_twice_by_its_receiver() -> None:
    final = done_task()
    final.receiver_effects["r-t1"] = 2
    assert violations(check(published().model(), final)) == {"duplicated_receiver_effect"}


def test_checker_uses_receipt_effects_for_receivers_without_a_ledger() -> None:
    final = replace(done_task(), ledger_principals=set(), receiver_effects={})
    assert check(published().model(), final).valid
    final.receipts[0] = replace(final.receipts[0], effects=0)
    assert violations(check(published().model(), final)) == {"missing_receiver_effect"}


@pytest.mark.parametrize(
    ("state", "expected"),
    [("pending", "unsent_outbox"), ("sending", "unsent_outbox"), ("dead", "dead_reply")],
)
def test_checker_flags_replies_not_confirmed_sent(state: str, expected: str) -> None:
    final = done_task()
    final.outbox[0] = replace(final.outbox[0], state=state)
    assert expected in violations(check(published().model(), final))


def test_checker_flags_a_terminal_task_without_its_reply() -> None:
    final = replace(done_task(), outbox=[], receipts=[], receiver_effects={}, reply_copies={})
    assert violations(check(published().model(), final)) == {"missing_reply"}


def test_checker_flags_a_task_still_running_as_live_lease_and_not_terminal() -> None:
    final = done_task()
    final.tasks[0] = replace(final.tasks[0], state="running", owner="a1-w0", result=None)
    final.effects.clear()
    final.outbox.clear()
    final.receipts.clear()
    final.receiver_effects.clear()
    final.reply_copies.clear()
    assert violations(check(published().model(), final)) == {"live_lease", "not_terminal"}


def test_checker_flags_receipts_and_entries_of_unknown_replies() -> None:
    final = done_task()
    final.receipts.append(ReceiptRec("r-ghost", "p1", "h9"))
    final.reply_copies["r-ghost2"] = 1
    result = check(published().model(), final)
    assert violations(result) == {"unexpected_reply"}
    assert result.counts["unexpected_reply"] == 2


def _reject_history(outcome: str = "ok") -> H:
    h = H()
    h.publish(
        "p1:x000002", kind="badsig", cls="reject", reasons=("bad_signature",), outcome=outcome
    )
    return h


def test_checker_requires_an_acknowledged_bad_input_in_the_dead_letter_stream() -> None:
    h = _reject_history()
    assert violations(check(h.model(), FinalState())) == {"rejected_not_in_dlq"}
    right = FinalState(dead_letters=[DeadLetterRec("d", "1-0", "bad_signature", "p1:x000002")])
    result = check(h.model(), right)
    assert result.valid, result.violations
    assert result.info["rejected"] == {"published": 1, "in_dlq": 1}
    wrong = FinalState(dead_letters=[DeadLetterRec("d", "1-0", "unparseable", "p1:x000002")])
    assert violations(check(h.model(), wrong)) == {"reject_wrong_reason"}


def test_checker_excuses_a_bad_input_that_never_reached_redis() -> None:
    assert check(_reject_history(outcome="info").model(), FinalState()).valid


def test_checker_flags_a_bad_input_stored_as_a_task() -> None:
    h = _reject_history()
    final = done_task("p1:x000002")
    final.dead_letters.append(DeadLetterRec("d", "1-0", "bad_signature", "p1:x000002"))
    got = violations(check(h.model(), final))
    assert {"rejected_ingested", "unexpected_ingest"} <= got


def test_checker_flags_a_good_request_in_the_dead_letter_stream() -> None:
    dl = DeadLetterRec("d", "1-0", "delivery_limit", None, "p1", "m000001")
    result = check(published().model(), FinalState(dead_letters=[dl]))
    assert violations(result) == {"legit_dead_lettered"}  # not lost, but never done
    unknown = DeadLetterRec("d", "2-0", "payload_deleted")
    assert "unexplained_dead_letter" in violations(
        check(H().model(), FinalState(dead_letters=[unknown]))
    )


def test_checker_requires_a_conflict_answer_for_other_content_under_a_known_id() -> None:
    h = published()
    h.publish("p1:m000001", fp=FP2, kind="dup_diff")
    assert violations(check(h.model(), done_task())) == {"missing_conflict_reply"}
    answered = done_task()
    answered.outbox.append(
        OutboxRec("c-1", None, "p1", "m000001", "conflict", "sent", "hc", fingerprint=FP2)
    )
    answered.receipts.append(ReceiptRec("c-1", "p1", "hc", None, "conflict"))
    answered.receiver_effects["c-1"] = 1
    result = check(h.model(), answered)
    assert result.valid, result.violations
    assert result.info["keys_republished_with_other_content"] == 1


def test_checker_flags_a_dirty_end() -> None:
    final = done_task()
    final.pending["replies ba-receiver"] = 2
    final.undelivered["in ba-ingest"] = 1
    final.integrity["receiver-p1"] = "*** in database main ***"
    final.wal_bytes["adapter"] = 10**9
    final.reply_dead_letters.append(DeadLetterRec("rd", "1-0", "bad_hash"))
    got = violations(check(published().model(), final))
    assert got == {
        "pending_left",
        "undelivered_left",
        "integrity",
        "wal_too_big",
        "reply_dead_lettered",
    }


def test_checker_flags_unexpected_exits_and_a_drain_timeout() -> None:
    h = published()
    h._e("supervisor", "info", "exit", value={"target": "a1", "rc": 1, "expected": False})
    h._e("supervisor", "info", "exit", value={"target": "a2", "rc": -9, "expected": True})
    h._e("run", "fail", "drain", value={"seconds": 90.0})
    result = check(h.model(), done_task())
    assert violations(result) == {"unexpected_exit", "drain_timeout"}
    assert result.examples["unexpected_exit"][0]["target"] == "a1"


def test_checker_keeps_at_most_max_examples_per_class() -> None:
    h = H()
    for i in range(50):
        h.publish(f"p1:m{i:06d}", seq=i)
    result = check(h.model(), FinalState(), CheckConfig(max_examples=32))
    assert result.counts["lost"] == 50
    assert len(result.examples["lost"]) == 32


def test_checker_splits_losses_into_prefix_middle_and_postfix() -> None:
    h = H()
    for i in range(5):
        h.publish(f"p1:m{i:06d}", seq=i)
    final = FinalState()
    for i in (1, 3):
        part = done_task(f"p1:m{i:06d}", task_id=f"t{i}")
        for name in ("tasks", "inbox", "outbox", "receipts", "effects"):
            getattr(final, name).extend(getattr(part, name))
        final.receiver_effects.update(part.receiver_effects)
        final.ledger_principals |= part.ledger_principals
    result = check(h.model(), final)
    assert result.info["lost_shape"] == {"prefix": 1, "middle": 1, "postfix": 1}


def test_history_model_pairs_fault_starts_with_stops() -> None:
    h = H()
    h._e("nemesis", "info", "start", value={"id": "1", "fault": "pause-adapter"})
    h._e("nemesis", "info", "start", value={"id": "2", "fault": "net-delay"})
    h._e("nemesis", "info", "stop", value={"id": "1", "fault": "pause-adapter"})
    model = h.model()  # fault 2 never stopped: its window runs to the last event
    windows = {f.fault: (f.start_t, f.stop_t) for f in model.faults}
    assert windows == {"pause-adapter": (101.0, 103.0), "net-delay": (102.0, 103.0)}
    assert model.fault_counts == {"pause-adapter": 1, "net-delay": 1}


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([], 50) is None


def test_check_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        CheckConfig(mode="lossy")


def test_every_violation_class_has_a_rule() -> None:
    assert all(VIOLATIONS.values())
    assert not check(H().model(), FinalState()).violations


def test_checker_allows_a_tail_loss_only_inside_its_fault_window() -> None:
    inside = H()
    inside._e("nemesis", "info", "start", value={"id": "1", "fault": "redis-tail-loss"})
    inside.publish("p1:m000001")
    inside._e("nemesis", "info", "stop", value={"id": "1", "fault": "redis-tail-loss"})
    cfg = CheckConfig(mode="everysec")
    assert "lost" not in violations(check(inside.model(), FinalState(), cfg))
    before = published()  # acknowledged before the fault started: the cut cannot reach it
    before.fault("redis-tail-loss")
    assert "lost" in violations(check(before.model(), FinalState(), cfg))


def test_command_starts_finds_whole_resp_commands_only() -> None:
    data = b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*3\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\nb\r\n*1\r\n$4\r\nPI"
    assert command_starts(data, 0) == [0, 20]
    assert command_starts(data, 20) == [20]
    assert command_starts(b"", 0) == []


def _forged_dl(mark: str = "1.0", reason: str = "bad_signature") -> DeadLetterRec:
    return DeadLetterRec("p1-dead", "5-0", reason, chaos_forged=mark)


def test_checker_accepts_a_forged_reply_in_the_reply_dead_letter_stream() -> None:
    h = published()
    h.forge()
    final = done_task()
    final.reply_dead_letters.append(_forged_dl())
    result = check(h.model(), final)
    assert result.valid, result.violations
    assert result.info["hostile"]["forgeries_dead_lettered"] == 1
    final.reply_dead_letters.append(DeadLetterRec("p1-dead", "6-0", "bad_signature"))
    assert violations(check(h.model(), final)) == {"reply_dead_lettered"}  # not planted


def test_checker_flags_a_forgery_dead_lettered_for_another_reason_or_not_at_all() -> None:
    h = published()
    h.forge()
    wrong = done_task()
    wrong.reply_dead_letters.append(_forged_dl(reason="bad_hash"))
    assert violations(check(h.model(), wrong)) == {"forgery_wrong_reason"}
    assert violations(check(h.model(), done_task())) == {"forgery_not_dead_lettered"}
    never_landed = published()
    never_landed.forge(outcome="info")  # the XADD may not have run: nothing to find
    assert check(never_landed.model(), done_task()).valid


@pytest.mark.parametrize("how", ["hash", "marker", "invented", "ledger", "real_id"])
def test_checker_flags_a_forged_reply_applied(how: str) -> None:
    h = published()
    final = done_task()
    if how == "real_id":  # the forgery took the real reply's id and its place
        h.forge(reply_id="r-t1", target="real", body_hash="h-forged")
        final.receipts[0] = replace(final.receipts[0], content_hash="h-other")
    else:
        h.forge(body_hash="h-forged")
    if how == "hash":
        final.receipts.append(ReceiptRec("r-ghost", "p1", "h-forged"))
    elif how == "marker":
        final.receipts.append(ReceiptRec("r-ghost", "p1", "h9", forged="1.0"))
    elif how == "invented":
        final.receipts.append(ReceiptRec("r-ghost", "p1", "h9"))
    elif how == "ledger":
        final.forged_effects["r-t1"] = 1
    final.reply_dead_letters.append(_forged_dl())
    result = check(h.model(), final)
    assert result.counts["forged_reply_applied"] == 1, result.examples
    assert "forged_reply_applied" in VIOLATIONS


def test_checker_flags_a_replay_that_ran_as_a_second_task() -> None:
    h = published()
    h.replay(state="done")
    h.replay(state=None)
    once = check(h.model(), done_task())
    assert once.valid, once.violations
    assert once.info["hostile"]["replays"] == 2
    assert once.info["hostile"]["replays_after_terminal"] == 1
    twice = done_task()
    twice.tasks.append(replace(twice.tasks[0], task_id="t2"))
    assert {"replay_ran_twice", "duplicate_tasks"} <= violations(check(h.model(), twice))


def test_checker_excuses_no_exit_inside_a_hostile_fault_window() -> None:
    h = published()
    h._e("nemesis", "info", "start", value={"id": "1", "fault": "poison-reply", "target": "x"})
    h._e("supervisor", "info", "exit", value={"target": "recv-p1", "rc": 1, "expected": False})
    h._e("nemesis", "info", "stop", value={"id": "1", "fault": "poison-reply", "target": "x"})
    assert violations(check(h.model(), done_task())) == {"unexpected_exit"}
