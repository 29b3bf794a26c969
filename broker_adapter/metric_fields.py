"""Metrics declared on the counters that feed them: the fields of the stats dataclasses.

A stage counts in a plain dataclass (``IngestStats``, ``ReceiverStats``,
``DispatcherStats``, ``WorkerStats``, and its group readers' ``ReaderStats``). A field
that is exported is declared with ``Family.field``: the metric family it adds to (its
name, without ``_total``, and its help) and the labels of the field's sample. A
``dict[str, int]`` field counting by a label whose values are not known in advance (a
reader's dead letters by reason) is declared with ``Family.field_by``: one sample per
key, the key as that label's value. A family is written once, as a ``Family`` constant,
however many fields (of however many stats classes) add to it.

Both metric paths read these declarations (``declared``): the adapter's collector, which
reads the stats of its own stages at scrape time, and a worker process's counters, which
go through prometheus-client's multiprocess files (``app.metrics``). A family with
``per_stage`` gets a ``stage`` label from the exporter (the same stats class serves
several stages: the dispatcher's and a worker's publications).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The field metadata key of a declaration.
METADATA_KEY = "metric"


@dataclass(frozen=True)
class Family:
    """One counter family.

    Attributes:
        name: the family's name, without the ``_total`` its sample gets.
        help: its help text.
        per_stage: the exporter adds a ``stage`` label.
    """

    name: str
    help: str
    per_stage: bool = False

    def field(self, **labels: str) -> int:
        """A stats field (an ``int`` counter from 0) exported in this family with
        ``labels``."""
        value: int = dataclasses.field(
            default=0, metadata={METADATA_KEY: Declared(self, dict(labels))}
        )
        return value

    def field_by(self, label: str) -> dict[str, int]:
        """A stats field (a ``dict`` of counters, empty at first) exported in this family
        with one sample per key, the key as the value of ``label``. Only the adapter's
        collector reads these (a worker process's counters have fixed labels)."""
        value: dict[str, int] = dataclasses.field(
            default_factory=dict, metadata={METADATA_KEY: Declared(self, {}, by=label)}
        )
        return value


@dataclass(frozen=True)
class Declared:
    """What a stats field is exported as: its family and the labels of its sample.

    Attributes:
        by: the label that the keys of a ``dict`` field fill (``None``: an ``int`` field).
    """

    family: Family
    labels: Mapping[str, str]
    by: str | None = None

    def samples(self, value: int | Mapping[str, int]) -> list[tuple[dict[str, str], int]]:
        """The labels and value of each sample of a field holding ``value``."""
        if isinstance(value, Mapping):
            return [({**self.labels, str(self.by): k}, n) for k, n in value.items()]
        return [(dict(self.labels), value)]


def declared(stats: Any) -> list[tuple[str, Declared]]:
    """The exported fields of a stats dataclass (or of an instance), in field order: each
    field's name and declaration."""
    out = []
    for f in dataclasses.fields(stats):
        found = f.metadata.get(METADATA_KEY)
        if isinstance(found, Declared):
            out.append((f.name, found))
    return out


def fields_by_label(stats: Any, family: Family, label: str) -> dict[str, str]:
    """The fields of ``stats`` exported in ``family``, by their value of ``label`` (e.g.
    ingest outcome -> the field that counts it)."""
    return {d.labels[label]: name for name, d in declared(stats) if d.family == family}


# -- families several stats classes add to --------------------------------------------------

STREAM_ENTRIES_TRIMMED = Family("ba_stream_entries_trimmed", "Stream entries trimmed.", True)
DEAD_LETTERS_TRIMMED = Family("ba_dead_letters_trimmed", "Dead letters trimmed by age.", True)
TRIM_FAILURES = Family("ba_trim_failures", "Trims that failed (retried).", True)
STREAM_FUTURE_IDS = Family(
    "ba_stream_future_ids",
    "Trims that found a stream read past an id ahead of the server clock (poisoned: repair it).",
    True,
)
REDIS_DATA_LOSS_ALARMS = Family(
    "ba_redis_data_loss_alarms",
    "Redis data loss seen: a consumer group gone"
    " (group_lost), the epoch key gone (wipe), a restart (restart).",
    True,
)
