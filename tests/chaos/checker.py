"""The checker: the rules of docs/RULES.md over final reads, with the history only for what agents
were told (acknowledged or not, when) and when faults ran.

Every rule below adds to one named anomaly class. Classes in ``VIOLATIONS`` fail the run;
everything else is reported as information. Each class keeps its count and its first
``max_examples`` examples.

Notation: a *key* is ``(principal, message_id)``; ``OK`` the keys an
agent saw acknowledged (XADD returned an id); ``ING`` the keys in the inbox; ``DLQ`` the
inbound dead-letter stream; ``TERM[k]`` the final task state; ``EFF[k]`` the committed
handler effects; ``RCPT[r]`` the receiver's effects for reply ``r``.

Loss windows (NL~): with ``mode="everysec"`` a publish acknowledged within
``loss_window_s`` before a redis-server kill, or between the start of a ``redis-tail-loss``
fault and its end, may be lost; with ``mode="ephemeral"`` every
publish acknowledged before a wipe (or any restart, which wipes) may be. ``durable`` allows
none. A loss inside a window is reported (``lost_attributed``), one outside is a violation.

Hostile entries (``hostile``): inbound poison is a planted bad input like any other (its
``chaos_key`` and reasons); forged and poisoned reply entries (``chaos_forged``, history
``forge``) must each sit in their reply dead-letter stream with an expected reason and
leave no receipt and no receiver effect; byte-identical replays (history ``replay``) must
stay duplicates of their key. Exits are judged without any fault window: an entry that
stops a process is an ``unexpected_exit`` whatever the nemesis was doing then.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.model import (
    EFFECT_ALLOWED,
    TASK_CLASS,
    TERMINAL,
    DeadLetterRec,
    EffectRec,
    FinalState,
    Forgery,
    HistoryModel,
    OutboxRec,
    Publish,
    ReceiptRec,
    TaskRec,
)

MODES = ("durable", "everysec", "ephemeral")
DEFAULT_LOSS_WINDOW_S = 2.5
DEFAULT_WAL_LIMIT_BYTES = 64 * 1024 * 1024

#: Anomaly classes that fail a run, with the rule each one breaks.
VIOLATIONS: dict[str, str] = {
    "unexpected_ingest": "NU: an inbox/task key or content its principal never published",
    "unexpected_reply": "NU: a reply, receipt or receiver effect for an unknown reply id",
    "charged_to_claimed_principal": "0R/2: a spoofed envelope charged to the principal it claims",
    "duplicate_tasks": "1E: more than one task for one key",
    "lost": "NL: an acknowledged publish in neither the inbox nor the dead-letter stream",
    "not_terminal": "BD: an ingested task not terminal after the drain",
    "live_lease": "CL: a task still running (a live lease) after the drain",
    "duplicated_effect": "1E: more than one committed handler effect for one key",
    "missing_effect": "1E: a task done without its committed effect",
    "effect_without_outcome": "1E: an effect for a key that never ran to an outcome",
    "rejected_ingested": "0R: a rejected input stored as a task",
    "rejected_not_in_dlq": "0R: an acknowledged bad input missing from the dead-letter stream",
    "reject_wrong_reason": "0R: a bad input dead-lettered with an unexpected reason",
    "missing_reply": "1R: a terminal task without its outbox reply",
    "unsent_outbox": "CL: an outbox reply still pending or sending",
    "dead_reply": "1R: an outbox reply that went dead (no trusted confirmation)",
    "missing_receipt": "1R: a reply with no receipt at its receiver",
    "receipt_mismatch": "1R: a receipt whose content differs from the outbox reply",
    "missing_receiver_effect": "1R: a receipt without its receiver effect",
    "duplicated_receiver_effect": "1R: a reply applied more than once by its receiver",
    "missing_conflict_reply": "3: a conflicting re-publish without its conflict answer",
    "stale_commit": "FN: a commit, effect, reply or receipt under a fence other than the final",
    "pending_left": "CL: entries left in a consumer group's pending list",
    "undelivered_left": "CL: entries never delivered to a consumer group",
    "legit_dead_lettered": "CL: a well-formed, authentic request dead-lettered",
    "unexplained_dead_letter": "CL: a dead letter that is neither a planted bad input nor a key",
    "reply_dead_lettered": "CL: a reply dead-lettered by its receiver, not one planted",
    "forged_reply_applied": "0R: a receipt or receiver effect made from a forged reply entry",
    "forgery_not_dead_lettered": "0R: a forged or poisoned reply entry missing from the DLQ",
    "forgery_wrong_reason": "0R: a forged or poisoned reply entry dead-lettered for another reason",
    "replay_ran_twice": "1E: a byte-identical replay of a request stored or run as a new task",
    "integrity": "CL: PRAGMA integrity_check is not ok",
    "wal_too_big": "CL: a WAL file above the bound",
    "unexpected_exit": "liveness: a component exited without being killed",
    "drain_timeout": "BD: the drain did not finish within T_heal",
}


@dataclass(frozen=True)
class CheckConfig:
    """How strict the checker is.

    Attributes:
        mode: ``durable`` (AOF always: no loss), ``everysec`` or ``ephemeral``.
        loss_window_s: NL~ window before a redis-server kill in ``everysec`` mode, seconds.
        max_examples: examples kept per anomaly class.
        wal_limit_bytes: the largest acceptable ``-wal`` file.
    """

    mode: str = "durable"
    loss_window_s: float = DEFAULT_LOSS_WINDOW_S
    max_examples: int = 32
    wal_limit_bytes: int = DEFAULT_WAL_LIMIT_BYTES

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


@dataclass
class CheckResult:
    """``valid`` is False when any violation class has a count."""

    valid: bool
    counts: dict[str, int]
    examples: dict[str, list[Any]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def violations(self) -> dict[str, int]:
        return {k: n for k, n in self.counts.items() if k in VIOLATIONS and n}

    def as_json(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "violations": self.violations,
            "counts": self.counts,
            "examples": self.examples,
            "info": self.info,
        }


class _Anomalies:
    def __init__(self, max_examples: int) -> None:
        self.max_examples = max_examples
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[Any]] = defaultdict(list)

    def add(self, cls: str, example: Any) -> None:
        self.counts[cls] += 1
        if len(self.examples[cls]) < self.max_examples:
            self.examples[cls].append(example)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def loss_windows(model: HistoryModel, cfg: CheckConfig) -> list[tuple[float, float, str]]:
    """The (start, end, fault) windows in which an acknowledged write may be lost."""
    windows: list[tuple[float, float, str]] = []
    for f in model.faults:
        if cfg.mode == "ephemeral" and f.fault in ("redis-wipe", "redis-kill"):
            windows.append((-math.inf, f.stop_t, f.fault))
        elif cfg.mode == "everysec" and f.fault == "redis-kill":
            windows.append((f.start_t - cfg.loss_window_s, f.start_t + 0.5, f.fault))
        elif cfg.mode == "everysec" and f.fault == "redis-tail-loss":
            # the cut is among the commands appended after the fault started
            windows.append((f.start_t, f.stop_t, f.fault))
    return windows


def _in_window(ts: list[float], windows: list[tuple[float, float, str]]) -> str | None:
    """The fault that explains losing writes acknowledged at every time in ``ts``."""
    if not ts or not windows:
        return None
    faults: set[str] = set()
    for t in ts:
        hit = next((w for w in windows if w[0] <= t <= w[1]), None)
        if hit is None:
            return None
        faults.add(hit[2])
    return ",".join(sorted(faults))


def _key(principal: str, message_id: str) -> str:
    return f"{principal}:{message_id}"


def _result_fence(result: Any) -> int | None:
    if isinstance(result, str):
        try:
            result = json.loads(result)
        except ValueError:
            return None
    if isinstance(result, dict) and isinstance(result.get("fence"), int):
        return int(result["fence"])
    return None


def check(model: HistoryModel, final: FinalState, cfg: CheckConfig | None = None) -> CheckResult:
    """Apply every rule; see the module docstring."""
    cfg = cfg or CheckConfig()
    a = _Anomalies(cfg.max_examples)
    info: dict[str, Any] = {}
    windows = loss_windows(model, cfg)

    legit: dict[str, Publish] = {}
    rejects: dict[str, Publish] = {}
    for each in model.publishes.values():
        (legit if each.cls == TASK_CLASS else rejects)[each.key] = each
    spoof_claims: dict[str, set[str]] = defaultdict(set)  # claimed key -> spoof fingerprints
    for each in rejects.values():
        if each.claims:
            spoof_claims[each.claims] |= each.fingerprints
    pub: Publish | None

    tasks_by_id = {t.task_id: t for t in final.tasks}
    tasks_by_key: dict[str, list[TaskRec]] = defaultdict(list)
    for t in final.tasks:
        tasks_by_key[_key(t.principal, t.message_id)].append(t)
    inbox = {_key(r.principal, r.message_id): r for r in final.inbox}
    outbox_by_id = {o.reply_id: o for o in final.outbox}
    outbox_by_task = {o.task_id: o for o in final.outbox if o.task_id is not None}
    receipts: dict[str, ReceiptRec] = {r.reply_id: r for r in final.receipts}
    effects_by_key: dict[str, list[EffectRec]] = defaultdict(list)
    for eff in final.effects:
        effects_by_key[_key(eff.principal, eff.message_id)].append(eff)
    ledger_fence: dict[str, int] = {}
    starts: Counter[str] = Counter()
    for att in final.attempts:
        ledger_fence[att.task_id] = max(ledger_fence.get(att.task_id, 0), att.fence)
        if att.event == "start":
            starts[att.task_id] += 1
    dl_by_chaos: dict[str, list[DeadLetterRec]] = defaultdict(list)
    dl_legit: dict[str, list[DeadLetterRec]] = defaultdict(list)
    for dl in final.dead_letters:
        if dl.chaos_key:
            dl_by_chaos[dl.chaos_key].append(dl)
        elif dl.sender and dl.message_id and _key(dl.sender, dl.message_id) in legit:
            dl_legit[_key(dl.sender, dl.message_id)].append(dl)
        else:
            a.add("unexplained_dead_letter", {"entry_id": dl.entry_id, "reason": dl.reason})
    for key, dls in dl_legit.items():
        a.add("legit_dead_lettered", {"key": key, "reasons": sorted({d.reason for d in dls})})

    # 1. Nothing unexpected --------------------------------------------------------------
    for key, rec in inbox.items():
        pub = legit.get(key)
        if pub is None:
            if rec.fingerprint in spoof_claims.get(key, set()):
                a.add("charged_to_claimed_principal", {"key": key, "where": "inbox"})
            else:
                a.add("unexpected_ingest", {"key": key, "why": "never published"})
        elif rec.fingerprint not in pub.fingerprints:
            if rec.fingerprint in spoof_claims.get(key, set()):
                a.add("charged_to_claimed_principal", {"key": key, "where": "inbox"})
            else:
                a.add("unexpected_ingest", {"key": key, "why": "content never published"})
    for key, ts in tasks_by_key.items():
        if len(ts) > 1:
            a.add("duplicate_tasks", {"key": key, "task_ids": [t.task_id for t in ts]})
        if key not in legit and key not in inbox:
            a.add("unexpected_ingest", {"key": key, "why": "task never published"})
    for o in final.outbox:
        if o.task_id is not None and o.task_id not in tasks_by_id:
            a.add("unexpected_reply", {"reply_id": o.reply_id, "why": "outbox row of no task"})
        if o.task_id is None and o.status == "conflict":
            key = _key(o.principal, o.message_id)
            pub = legit.get(key)
            if pub is None or (o.fingerprint is not None and o.fingerprint not in pub.fingerprints):
                if o.fingerprint in spoof_claims.get(key, set()):
                    a.add("charged_to_claimed_principal", {"key": key, "where": "conflict reply"})
                else:
                    a.add("unexpected_reply", {"reply_id": o.reply_id, "why": "conflict unknown"})
    for rid in receipts:
        if rid not in outbox_by_id:
            a.add("unexpected_reply", {"reply_id": rid, "why": "receipt of an unknown reply"})
    for rid in final.reply_copies:
        if rid not in outbox_by_id:
            a.add("unexpected_reply", {"reply_id": rid, "why": "stream entry of an unknown reply"})
    for rid in final.receiver_effects:
        if rid not in outbox_by_id:
            a.add("unexpected_reply", {"reply_id": rid, "why": "receiver effect, unknown reply"})

    # 2./3. Lost and recovered -----------------------------------------------------------
    lost_attributed: list[dict[str, Any]] = []
    lost_keys: dict[str, list[Publish]] = defaultdict(list)
    recovered = 0
    for key, pub in legit.items():
        found = key in inbox or key in dl_legit
        if pub.indeterminate and found:
            recovered += 1
        if not pub.acked or found:
            continue
        all_ts = [t for ts in pub.ack_ts.values() for t in ts]
        fault = _in_window(all_ts, windows)
        if fault is not None:
            lost_attributed.append({"key": key, "fault": fault})
        else:
            a.add("lost", {"key": key, "kind": pub.kind, "acks": pub.acks})
            lost_keys[pub.principal].append(pub)
    info["lost_attributed"] = {"count": len(lost_attributed), "examples": lost_attributed[:32]}
    info["recovered_indeterminate"] = recovered
    info["lost_shape"] = _loss_shape(legit, lost_keys)

    # 4. Terminal, and latency -------------------------------------------------------------
    latencies: list[float] = []
    by_state: Counter[str] = Counter()
    for t in final.tasks:
        by_state[t.state] += 1
        key = _key(t.principal, t.message_id)
        if t.state == "running":
            a.add("live_lease", {"key": key, "owner": t.owner, "lease_until": t.lease_until})
        if t.state not in TERMINAL:
            a.add("not_terminal", {"key": key, "state": t.state, "attempts": t.attempts})
            continue
        pub = legit.get(key)
        reply = outbox_by_task.get(t.task_id)
        receipt = receipts.get(reply.reply_id) if reply else None
        if pub is not None and pub.first_ack_wall is not None and receipt is not None:
            latencies.append(receipt.received_at - pub.first_ack_wall)
    info["tasks_by_state"] = dict(sorted(by_state.items()))
    info["latency_s"] = {
        "n": len(latencies),
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "max": max(latencies) if latencies else None,
    }

    # 5. Effects ---------------------------------------------------------------------------
    orphan_effects: Counter[str] = Counter()
    absorbed = 0
    for key, effs in effects_by_key.items():
        absorbed += sum(e.applications - 1 for e in effs)
        if len(effs) > 1:
            a.add("duplicated_effect", {"key": key, "task_ids": [e.task_id for e in effs]})
        for eff in effs:
            task = tasks_by_id.get(eff.task_id)
            if task is None or task.state not in EFFECT_ALLOWED:
                a.add(
                    "effect_without_outcome",
                    {"key": key, "task_id": eff.task_id, "state": task.state if task else None},
                )
            elif task.state != "done":
                orphan_effects[task.state] += 1
            if task is not None and eff.last_fence > task.fence:
                a.add("stale_commit", {"key": key, "why": "effect fence above the task's"})
    for t in final.tasks:
        if t.state != "done":
            continue
        key = _key(t.principal, t.message_id)
        mine = [e for e in effects_by_key.get(key, []) if e.task_id == t.task_id]
        if not mine:
            a.add("missing_effect", {"key": key, "task_id": t.task_id})
        elif mine[0].last_fence != t.fence:
            a.add(
                "stale_commit",
                {
                    "key": key,
                    "why": "done, last effect fence differs",
                    "effect": mine[0].last_fence,
                    "task": t.fence,
                },
            )
    info["effects"] = {
        "committed": len(final.effects),
        "absorbed_reapplications": absorbed,
        "without_done_by_state": dict(orphan_effects),
        "tasks_run_more_than_once": sum(1 for n in starts.values() if n > 1),
        "max_runs_of_one_task": max(starts.values(), default=0),
    }

    # 6. Rejected input --------------------------------------------------------------------
    rejected_in_dlq = 0
    for key, pub in rejects.items():
        principal, ident = pub.principal, pub.ident
        if key in inbox or _key(principal, ident) in tasks_by_key:
            a.add("rejected_ingested", {"key": key, "kind": pub.kind})
        if key in effects_by_key:
            a.add("effect_without_outcome", {"key": key, "why": "effect for a rejected input"})
        dls = dl_by_chaos.get(key, [])
        if dls:
            rejected_in_dlq += 1
            wrong = [d.reason for d in dls if pub.reasons and d.reason not in pub.reasons]
            if wrong:
                a.add(
                    "reject_wrong_reason",
                    {"key": key, "kind": pub.kind, "got": wrong, "expected": list(pub.reasons)},
                )
        elif pub.acked:
            all_ts = [t for ts in pub.ack_ts.values() for t in ts]
            if _in_window(all_ts, windows) is None:
                a.add("rejected_not_in_dlq", {"key": key, "kind": pub.kind})
    info["rejected"] = {"published": len(rejects), "in_dlq": rejected_in_dlq}

    # 7. Replies and receivers -------------------------------------------------------------
    for t in final.tasks:
        if t.state in TERMINAL and t.task_id not in outbox_by_task:
            a.add("missing_reply", {"key": _key(t.principal, t.message_id), "state": t.state})
    copies = Counter(final.reply_copies.values())
    for o in final.outbox:
        _check_reply(a, o, receipts.get(o.reply_id), final)
    info["reply_copies"] = {
        "replies_on_streams": len(final.reply_copies),
        "with_duplicates": sum(n for c, n in copies.items() if c > 1),
        "max_copies": max(final.reply_copies.values(), default=0),
    }
    info["conflict_replies"] = sum(1 for o in final.outbox if o.status == "conflict")

    # 8. Fences ----------------------------------------------------------------------------
    for t in final.tasks:
        key = _key(t.principal, t.message_id)
        if ledger_fence.get(t.task_id, 0) > t.fence:
            a.add("stale_commit", {"key": key, "why": "a handler ran above the final fence"})
        if t.state == "done":
            rf = _result_fence(t.result)
            if rf is not None and rf != t.fence:
                a.add(
                    "stale_commit",
                    {
                        "key": key,
                        "why": "done by an older claim",
                        "result_fence": rf,
                        "task_fence": t.fence,
                    },
                )
        reply = outbox_by_task.get(t.task_id)
        if reply is not None and reply.fence is not None and reply.fence != t.fence:
            a.add("stale_commit", {"key": key, "why": "reply fence", "reply_fence": reply.fence})
        receipt = receipts.get(reply.reply_id) if reply is not None else None
        if receipt is not None and receipt.fence is not None and receipt.fence != t.fence:
            a.add("stale_commit", {"key": key, "why": "receipt fence", "fence": receipt.fence})

    # 9. Idempotency consistency -----------------------------------------------------------
    conflicting = 0
    answers: dict[str, set[str | None]] = defaultdict(set)
    for o in final.outbox:
        if o.task_id is None:
            answers[_key(o.principal, o.message_id)].add(o.fingerprint)
    for key, pub in legit.items():
        if len(pub.acked_fingerprints) < 2 or key not in inbox:
            continue
        conflicting += 1
        stored = inbox[key].fingerprint
        answered = answers.get(key, set())
        for fp in pub.acked_fingerprints - {stored}:
            if fp not in answered and _in_window(pub.ack_ts.get(fp, []), windows) is None:
                a.add("missing_conflict_reply", {"key": key, "fingerprint": fp[:16]})
    info["keys_republished_with_other_content"] = conflicting

    # 10. Clean end ------------------------------------------------------------------------
    for where, n in final.pending.items():
        if n:
            a.add("pending_left", {"where": where, "pending": n})
    for where, n in final.undelivered.items():
        if n:
            a.add("undelivered_left", {"where": where, "entries": n})
    for db, verdict in final.integrity.items():
        if verdict != "ok":
            a.add("integrity", {"db": db, "result": verdict})
    for db, size in final.wal_bytes.items():
        if size > cfg.wal_limit_bytes:
            a.add("wal_too_big", {"db": db, "bytes": size})
    _check_hostile(a, model, final, windows, info, tasks_by_key, effects_by_key)

    # 11. Liveness -------------------------------------------------------------------------
    for exit_ in model.unexpected_exits:
        a.add("unexpected_exit", exit_)
    if model.drain_ok is False:
        a.add("drain_timeout", {"seconds": model.drain_s})

    info["publishes"] = {
        "keys": len(legit),
        "acked": sum(1 for p in legit.values() if p.acked),
        "indeterminate": sum(1 for p in legit.values() if p.indeterminate),
        "failed": sum(1 for p in legit.values() if p.fails and not p.acked and not p.infos),
    }
    info["messages_by_kind"] = dict(sorted(model.kinds.items()))
    info["faults_by_kind"] = dict(sorted(model.fault_counts.items()))
    info["cancels"] = dict(sorted(model.cancels.items()))
    info["recovery_s"] = model.drain_s
    counts = {k: a.counts.get(k, 0) for k in VIOLATIONS}
    valid = not any(counts.values())
    return CheckResult(valid, counts, {k: v for k, v in a.examples.items()}, info)


def _check_reply(
    a: _Anomalies, o: OutboxRec, receipt: ReceiptRec | None, final: FinalState
) -> None:
    ex = {"reply_id": o.reply_id, "key": _key(o.principal, o.message_id), "status": o.status}
    if o.state in ("pending", "sending"):
        a.add("unsent_outbox", dict(ex, state=o.state, last_error=o.last_error))
    elif o.state == "dead":
        a.add("dead_reply", dict(ex, last_error=o.last_error))
    if receipt is None:
        a.add("missing_receipt", ex)
        return
    if receipt.content_hash != o.content_hash:
        a.add("receipt_mismatch", ex)
    if o.principal in final.ledger_principals:
        n = final.receiver_effects.get(o.reply_id, 0)
        if n == 0:
            a.add("missing_receiver_effect", ex)
        elif n > 1:
            a.add("duplicated_receiver_effect", dict(ex, effects=n))
    elif receipt.effects != 1:
        a.add("missing_receiver_effect", dict(ex, effects=receipt.effects))


def _mark_of(planted: Forgery) -> dict[str, str]:
    """A planted reply entry's mark and shape, for examples."""
    return {"mark": planted.mark, "shape": planted.shape}


def _check_hostile(
    a: _Anomalies,
    model: HistoryModel,
    final: FinalState,
    windows: list[tuple[float, float, str]],
    info: dict[str, Any],
    tasks_by_key: dict[str, list[TaskRec]],
    effects_by_key: dict[str, list[EffectRec]],
) -> None:
    """Reply dead letters, forged replies applied, and replays that ran again."""
    forged = model.forgeries
    dead: set[str] = set()
    for dl in final.reply_dead_letters:
        planted = forged.get(dl.chaos_forged) if dl.chaos_forged else None
        ex = {"entry_id": dl.entry_id, "reason": dl.reason, "stream": dl.stream}
        if planted is None:
            a.add("reply_dead_lettered", ex)
            continue
        dead.add(planted.mark)
        if planted.reasons and dl.reason not in planted.reasons:
            expected = list(planted.reasons)
            a.add("forgery_wrong_reason", dict(ex, **_mark_of(planted), expected=expected))
    for mark, planted in forged.items():
        if planted.acked and mark not in dead and _in_window(planted.ack_ts, windows) is None:
            a.add("forgery_not_dead_lettered", dict(_mark_of(planted), reply_id=planted.reply_id))
    by_hash = {p.body_hash: p for p in forged.values()}
    invented = {p.reply_id for p in forged.values() if p.target == "invented"}
    targeted = {p.reply_id for p in forged.values() if p.target == "real"}
    outbox_hash = {o.reply_id: o.content_hash for o in final.outbox}
    applied: dict[str, str] = {}
    for r in final.receipts:
        if r.forged is not None:
            applied.setdefault(r.reply_id, f"receipt of forged body {r.forged}")
        elif r.content_hash in by_hash:
            applied.setdefault(r.reply_id, f"receipt hash of {by_hash[r.content_hash].mark}")
        elif r.reply_id in invented:
            applied.setdefault(r.reply_id, "receipt under an invented reply id")
        elif r.reply_id in targeted and outbox_hash.get(r.reply_id) != r.content_hash:
            applied.setdefault(r.reply_id, "receipt of a forged reply id, not the outbox's")
    for rid in final.forged_effects:
        applied.setdefault(rid, "receiver effect of a forged body")
    for rid in final.receiver_effects:
        if rid in invented:
            applied.setdefault(rid, "receiver effect under an invented reply id")
    for rid, why in applied.items():
        a.add("forged_reply_applied", {"reply_id": rid, "why": why})
    replays = [r for rs in model.replays.values() for r in rs]
    for key in model.replays:
        tasks, effects = tasks_by_key.get(key, []), effects_by_key.get(key, [])
        if len(tasks) > 1 or len(effects) > 1:
            ids = [t.task_id for t in tasks]
            a.add("replay_ran_twice", {"key": key, "tasks": ids, "effects": len(effects)})
    info["hostile"] = {
        "forgeries": len(forged),
        "forgeries_dead_lettered": len(dead),
        "forgery_shapes": dict(sorted(Counter(p.shape for p in forged.values()).items())),
        "planted_on_reply_streams": final.forged_on_streams,
        "replays": len(replays),
        "replays_acked": sum(1 for r in replays if r.entry_id is not None),
        "replays_after_terminal": sum(1 for r in replays if r.state in TERMINAL),
    }


def _loss_shape(legit: dict[str, Publish], lost: dict[str, list[Publish]]) -> dict[str, int]:
    """Lost keys per agent split into prefix, middle and postfix of its acknowledged keys."""
    shape = {"prefix": 0, "middle": 0, "postfix": 0}
    for principal, gone in lost.items():
        acked = sorted(p.seq for p in legit.values() if p.principal == principal and p.acked)
        gone_seqs = {p.seq for p in gone}
        kept = [s for s in acked if s not in gone_seqs]
        for s in gone_seqs:
            if not kept or s < kept[0]:
                shape["prefix"] += 1
            elif s > kept[-1]:
                shape["postfix"] += 1
            else:
                shape["middle"] += 1
    return shape


def format_summary(result: CheckResult) -> str:
    """The human summary table."""
    i = result.info
    lat = i.get("latency_s", {})

    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    rows: list[tuple[str, str]] = [
        ("verdict", "VALID" if result.valid else "INVALID"),
        ("messages by kind", _kv(i.get("messages_by_kind", {}))),
        ("publishes", _kv(i.get("publishes", {}))),
        ("faults by kind", _kv(i.get("faults_by_kind", {}))),
        ("faults total", str(sum(i.get("faults_by_kind", {}).values()))),
        ("tasks by state", _kv(i.get("tasks_by_state", {}))),
        ("lost (violations)", str(result.counts.get("lost", 0))),
        ("lost (in a fault window)", str(i.get("lost_attributed", {}).get("count", 0))),
        ("recovered indeterminate", str(i.get("recovered_indeterminate", 0))),
        ("duplicated effects", str(result.counts.get("duplicated_effect", 0))),
        ("duplicated receiver effects", str(result.counts.get("duplicated_receiver_effect", 0))),
        ("stale commits", str(result.counts.get("stale_commit", 0))),
        ("effects", _kv(i.get("effects", {}))),
        ("rejected", _kv(i.get("rejected", {}))),
        ("hostile", _kv({k: v for k, v in i.get("hostile", {}).items() if k != "forgery_shapes"})),
        ("reply copies", _kv(i.get("reply_copies", {}))),
        ("cancels", _kv(i.get("cancels", {}))),
        ("latency publish->effect p50 (s)", fmt(lat.get("p50"))),
        ("latency publish->effect p99 (s)", fmt(lat.get("p99"))),
        ("latency publish->effect max (s)", fmt(lat.get("max"))),
        ("recovery after last heal (s)", fmt(i.get("recovery_s"))),
    ]
    for name, n in result.violations.items():
        rows.append((f"VIOLATION {name}", f"{n}: {VIOLATIONS[name]}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    for name in result.violations:
        for ex in result.examples.get(name, [])[:5]:
            lines.append(f"  {name}: {json.dumps(ex, sort_keys=True, default=str)}")
    return "\n".join(lines)


def _kv(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items()) or "-"
