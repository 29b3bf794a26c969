"""``StreamEntry``: one stream entry as a reader delivers it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

#: An entry's fields by name.
Fields = dict[bytes, bytes]


class StreamEntry(NamedTuple):
    """One delivered entry. ``fields`` is None when its payload was deleted or trimmed.
    (A tuple: one is made per entry read.)

    Attributes:
        entry_id: the stream entry id.
        fields: the fields by name (of an entry the reader passed, names are unique).
        deliveries: how often the group delivered it (XPENDING), 1 for a new entry.
        pairs: the fields as Redis keeps them, ``[name, value, name, value, ...]`` with
            any repeated name; ``None`` for an entry made from ``fields`` alone.
    """

    entry_id: str
    fields: Fields | None
    deliveries: int = 1
    pairs: Sequence[bytes] | None = None

    def flat(self) -> Sequence[bytes]:
        """The name/value pairs, flat (from ``fields`` when the raw list is not known)."""
        if self.pairs is not None:
            return self.pairs
        return [item for pair in (self.fields or {}).items() for item in pair]
