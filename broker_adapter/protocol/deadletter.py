"""The dead-letter entry: what a reader writes when it refuses an entry, and how it is read
back (``DeadLetter.parse``).

A dead letter is one entry of the source stream's dead-letter stream (``Keys.dead_for``):

* notes, texts under ``dl.*`` names: ``dl.reason`` (a machine-readable code),
  ``dl.detail`` (for a person), ``dl.source`` (the stream), ``dl.entry_id`` (the entry's id
  there), ``dl.deliveries``, ``dl.group``, ``dl.consumer``; as the refusal has them,
  ``dl.field`` (the field at fault, ``""`` for the entry as a whole) and ``dl.principal``;
  ``dl.truncated`` when the copy below is not the whole entry; and of the minimal dead
  letter that replaces one that failed, ``dl.failed_reason``;
* then a copy of the entry's own fields, each name prefixed ``orig.``, in order and byte
  for byte, up to ``max_fields`` fields and ``max_bytes`` bytes (``copy_original``). Of a
  larger entry what fits is copied and ``dl.truncated`` says so; the entry itself stays in
  its stream under ``dl.entry_id`` until the stream's trim passes it. Of an entry that was
  not authenticated and admitted, at most ``UNTRUSTED_COPY_BYTES`` are copied.

A dead-letter stream keeps at most a cap of entries (``DEFAULT_DEAD_LETTER_CAP``): writing
one beyond it trims the oldest.

Every note is made encodable before it is written (``encodable``: a lone surrogate is
written as ``\\ud800``) and cut to ``DEAD_LETTER_TEXT_MAX_CHARS`` characters. Writing is
the group reader's (``broker_adapter.redis.dead_lettering``); reading back the operator's
(``broker_adapter.app.ops``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The notes' names.
REASON = "dl.reason"
DETAIL = "dl.detail"
SOURCE = "dl.source"
ENTRY_ID = "dl.entry_id"
DELIVERIES = "dl.deliveries"
GROUP = "dl.group"
CONSUMER = "dl.consumer"
FIELD = "dl.field"
PRINCIPAL = "dl.principal"
TRUNCATED = "dl.truncated"
FAILED_REASON = "dl.failed_reason"
#: What the copy of an original field's name starts with.
ORIGINAL_PREFIX = b"orig."
#: The reason of a dead letter written because handling the entry raised (a bug, or input
#: no check foresaw), and of the minimal one that replaces a dead letter that failed.
INTERNAL_ERROR = "internal_error"
#: Reasons whose copy cannot give back the entry as it was (a repeated name collapses).
_NOT_REPLAYABLE_REASONS = frozenset({"duplicate_field"})
#: How many characters of a text a dead letter keeps (``dl.detail`` and the other notes).
DEAD_LETTER_TEXT_MAX_CHARS = 1000
#: How many bytes of an entry a dead letter copies unless the entry was authenticated and
#: admitted (unsigned, forged, malformed, oversize, rate-limited entries): a prefix, so that
#: a flood of large entries costs the dead-letter stream this much per entry at most.
UNTRUSTED_COPY_BYTES = 16 * 1024
#: How many entries a dead-letter stream keeps at most by default: the function that
#: writes a dead letter trims the oldest beyond it (and the writer raises an alarm).
DEFAULT_DEAD_LETTER_CAP = 10_000


def encodable(value: str, limit: int = DEAD_LETTER_TEXT_MAX_CHARS) -> str:
    """``value`` cut to ``limit`` characters, with whatever UTF-8 cannot encode (lone
    surrogates, which ``json`` happily decodes from ``"\\ud800"``) written as backslash
    escapes: every text derived from input goes through this before Redis sees it."""
    value = value[:limit]
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def describe(exc: BaseException) -> str:
    """``"<class>: <message>"`` of ``exc`` in ASCII (escaped), for a dead letter's detail;
    never raises, whatever the exception's ``__str__`` does."""
    try:
        said = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - a broken __str__: the class name is enough
        said = type(exc).__name__
    return said.encode("ascii", "backslashreplace").decode("ascii")


def notes(
    reason: str,
    detail: str,
    *,
    source: str,
    entry_id: str,
    deliveries: int,
    group: str,
    consumer: str,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``dl.*`` notes of one dead letter (``extra`` adds notes, never replaces one)."""
    out = {
        REASON: reason,
        DETAIL: detail,
        SOURCE: source,
        ENTRY_ID: entry_id,
        DELIVERIES: str(deliveries),
        GROUP: group,
        CONSUMER: consumer,
    }
    for k, v in (extra or {}).items():
        out.setdefault(k, v)
    return out


def minimal_notes(
    failed_reason: str, exc: BaseException, *, source: str, entry_id: str
) -> dict[str, str]:
    """The notes of the minimal dead letter (no copied fields) that replaces one of reason
    ``failed_reason`` that could not be written because of ``exc``."""
    return {
        REASON: INTERNAL_ERROR,
        DETAIL: f"the {failed_reason} dead letter failed: {describe(exc)}",
        FIELD: "",
        SOURCE: source,
        ENTRY_ID: entry_id,
        FAILED_REASON: failed_reason,
    }


def copy_original(
    original: Sequence[bytes], *, max_fields: int, max_bytes: int, source: str
) -> tuple[list[bytes], str]:
    """The ``orig.<name>`` pairs of a dead letter and, when not all of ``original`` (flat
    name/value pairs) fits in ``max_fields`` fields and ``max_bytes`` bytes, a note of what
    was left out (else ``""``, for ``dl.truncated``). Names and values are copied in
    order, byte for byte; the pair that crosses the byte limit is cut, and copying stops
    there."""
    total = sum(map(len, original))
    if len(original) <= 2 * max_fields and total <= max_bytes:
        return [
            ORIGINAL_PREFIX + item if i % 2 == 0 else item for i, item in enumerate(original)
        ], ""
    copy: list[bytes] = []
    room = max_bytes
    for i in range(0, min(len(original) - 1, 2 * max_fields), 2):
        if room <= 0:
            break
        name = original[i][:room]
        value = original[i + 1][: room - len(name)]
        room -= len(name) + len(value)
        copy += [ORIGINAL_PREFIX + name, value]
    copied = max_bytes - room
    return copy, (
        f"copied {len(copy) // 2} of {len(original) // 2} fields, {copied} of {total} "
        f"bytes; the entry stays in {source} under dl.entry_id until the stream "
        "is trimmed past it"
    )


def entry_fields(notes: Mapping[str, str], copy: Sequence[bytes]) -> list[bytes | str]:
    """The dead-letter entry's flat field/value list: ``notes`` (texts, made encodable),
    then ``copy``."""
    out: list[bytes | str] = []
    for k, v in notes.items():
        out += [k, encodable(v)]
    out += copy
    return out


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


@dataclass(frozen=True)
class DeadLetter:
    """A dead letter read back from its stream.

    Attributes:
        fields: every field, names and values decoded (undecodable bytes replaced).
        original: the copied fields of the original entry by their own names, as bytes.
    """

    fields: dict[str, str]
    original: dict[bytes, bytes]

    @classmethod
    def parse(cls, raw: Mapping[bytes, bytes]) -> DeadLetter:
        """The dead letter of an entry's fields (as ``XRANGE`` returns them)."""
        return cls(
            fields={_text(k): _text(v) for k, v in raw.items()},
            original={
                k.removeprefix(ORIGINAL_PREFIX): v
                for k, v in raw.items()
                if k.startswith(ORIGINAL_PREFIX)
            },
        )

    @property
    def reason(self) -> str | None:
        return self.fields.get(REASON)

    @property
    def detail(self) -> str | None:
        return self.fields.get(DETAIL)

    @property
    def source(self) -> str | None:
        """The stream the entry was read from."""
        return self.fields.get(SOURCE)

    @property
    def source_entry_id(self) -> str | None:
        """The entry's id in ``source``."""
        return self.fields.get(ENTRY_ID)

    @property
    def deliveries(self) -> str | None:
        """How often the entry was delivered, as written (a decimal)."""
        return self.fields.get(DELIVERIES)

    @property
    def complete(self) -> bool:
        """Whether ``original`` gives back the entry as it was: nothing was left out
        (``dl.truncated``) and no repeated name collapsed (``duplicate_field``)."""
        return TRUNCATED not in self.fields and self.reason not in _NOT_REPLAYABLE_REASONS
