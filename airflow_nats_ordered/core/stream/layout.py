"""A stream's partition layouts (epochs): subjects and group-state key names per epoch.

A partitioned stream starts at epoch 0 with the subjects ``<prefix>.p.0`` ...
``<prefix>.p.<P-1>``. Each repartition (:mod:`.repartition`) starts a new epoch ``k`` whose
subjects are ``<prefix>.p.e<k>-0`` ... ``<prefix>.p.e<k>-<N-1>``: still one token after
``<prefix>.p.``, so the filter ``<prefix>.p.*`` (stream-info counts, the ``nats`` CLI) covers
every epoch, and never a subject of another epoch, so the server refuses a publisher that still
routes by an old layout (no stream takes its subjects any more).

The stream metadata holds the current epoch (``nats-ordered.epoch``, absent: 0) and every
earlier layout (``nats-ordered.layouts``: JSON, oldest first, each with its epoch, partition
count and *switch point*: the sequence of the layout's last record, so every record of that
layout has a sequence at or below it and every record of a later layout one above it). A
layout closed by a repartition that has not yet recorded its switch point carries
``"pending": true`` (an entry written by an earlier version with ``switch_seq`` 0 and no
``pending`` counts as pending too): groups do not move past it until the repartition is
completed (:mod:`.repartition`).

A consumer group processes one epoch at a time (its key ``epoch`` in the group's state
bucket; absent: the stream's oldest layout). Its leases, commit records, blocked markers and
assignment of epoch 0 keep their names (``p.<n>``, ``c.<n>``, ``blocked.<n>``,
``assignment``); those of epoch ``k`` > 0 are ``e<k>.p.<n>``, ``e<k>.c.<n>``... so partition
numbers of two epochs never share a record (:func:`state_key`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

META_EPOCH = "nats-ordered.epoch"
META_LAYOUTS = "nats-ordered.layouts"
#: the group state key holding the epoch the group processes
GROUP_EPOCH_KEY = "epoch"


@dataclass(frozen=True)
class Layout:
    """One epoch's layout: ``partitions`` subjects under ``prefix``; ``switch_seq`` is the
    sequence of its last record once it was closed (0 while it is the current one);
    ``pending`` while the repartition that closed it has not recorded ``switch_seq`` yet."""

    epoch: int
    partitions: int
    prefix: str
    switch_seq: int = 0
    pending: bool = False

    def subject(self, partition: int) -> str:
        return layout_subject(self.prefix, self.epoch, partition)

    @property
    def subjects(self) -> list[str]:
        return [self.subject(p) for p in range(self.partitions)]

    def to_json(self) -> dict[str, int | bool]:
        out: dict[str, int | bool] = {
            "epoch": self.epoch,
            "partitions": self.partitions,
            "switch_seq": self.switch_seq,
        }
        if self.pending or not self.switch_seq:  # a recorded 0 is said so: not pending
            out["pending"] = self.pending
        return out


def layout_subject(prefix: str, epoch: int, partition: int) -> str:
    """Partition ``partition``'s subject in ``epoch``: ``<prefix>.p.<n>`` (epoch 0) or
    ``<prefix>.p.e<k>-<n>``."""
    if epoch == 0:
        return f"{prefix}.p.{partition}"
    return f"{prefix}.p.e{epoch}-{partition}"


def partition_of(prefix: str, epoch: int, partitions: int, subject: str) -> int | None:
    """The partition whose subject in ``epoch`` is exactly ``subject``, or None."""
    head = f"{prefix}.p." if epoch == 0 else f"{prefix}.p.e{epoch}-"
    tail = subject[len(head) :] if subject.startswith(head) else ""
    if not (tail.isascii() and tail.isdigit() and (tail == "0" or tail[0] != "0")):
        return None
    n = int(tail)
    return n if n < partitions else None


def read_layouts(meta: Mapping[str, str], prefix: str) -> tuple[int, tuple[Layout, ...]]:
    """The current epoch and the earlier layouts recorded in a stream's metadata (ValueError
    if they are malformed)."""
    epoch = int(meta.get(META_EPOCH, "0") or 0)
    raw = json.loads(meta.get(META_LAYOUTS) or "[]")
    layouts = tuple(_layout_of(d, prefix) for d in raw)
    if epoch < 0 or any(lay.epoch >= epoch or lay.partitions < 1 for lay in layouts):
        raise ValueError(f"epoch {epoch}, layouts {raw}")
    return epoch, layouts


def _layout_of(d: Mapping[str, object], prefix: str) -> Layout:
    switch = int(d.get("switch_seq", 0) or 0)  # type: ignore[call-overload]
    # without "pending": an earlier version's entry, whose 0 meant "not recorded"
    pending = bool(d["pending"]) if "pending" in d else switch == 0
    return Layout(int(d["epoch"]), int(d["partitions"]), prefix, switch, pending)  # type: ignore[call-overload]


def subjects_layout(prefix: str, subjects: list[str]) -> tuple[int, int] | None:
    """``(epoch, partitions)`` when ``subjects`` are exactly one layout's partition subjects
    (in any order), else None."""
    for epoch in _epochs_named(prefix, subjects):
        if sorted(subjects) == sorted(Layout(epoch, len(subjects), prefix).subjects):
            return epoch, len(subjects)
    return None


def _epochs_named(prefix: str, subjects: list[str]) -> list[int]:
    head = f"{prefix}.p."
    found = set()
    for s in subjects:
        tail = s[len(head) :] if s.startswith(head) else ""
        if tail.startswith("e") and "-" in tail and tail[1:].split("-", 1)[0].isdigit():
            found.add(int(tail[1:].split("-", 1)[0]))
        elif tail.isdigit():
            found.add(0)
    return sorted(found)


def is_partition_subject(prefix: str, subject: str) -> bool:
    """True when ``subject`` has the shape of a partition subject of some layout
    (``<prefix>.p.<n>`` or ``<prefix>.p.e<k>-<n>``)."""
    head = f"{prefix}.p."
    if not subject.startswith(head):
        return False
    tail = subject[len(head) :]
    if tail.startswith("e") and "-" in tail:
        k, n = tail[1:].split("-", 1)
        return k.isdigit() and n.isdigit()
    return tail.isdigit()


def layouts_json(layouts: tuple[Layout, ...] | list[Layout]) -> str:
    return json.dumps([lay.to_json() for lay in layouts], separators=(",", ":"))


def state_key(epoch: int, kind: str, partition: int | None = None) -> str:
    """A group-state (or lease) key of ``epoch``: ``c.3`` in epoch 0, ``e2.c.3`` in epoch 2;
    ``kind`` alone (``assignment``) when ``partition`` is None."""
    base = kind if partition is None else f"{kind}.{partition}"
    return base if epoch == 0 else f"e{epoch}.{base}"


def key_partition(key: str, epoch: int, kind: str) -> int | None:
    """The partition of ``key`` if it is a ``kind`` key of ``epoch`` (see :func:`state_key`),
    else None: keys of other epochs are not this epoch's."""
    head = f"{kind}." if epoch == 0 else f"e{epoch}.{kind}."
    tail = key[len(head) :] if key.startswith(head) else ""
    return int(tail) if tail.isdigit() else None


def group_epoch_of(value: bytes | None, oldest: int) -> int:
    """The epoch in a group's ``epoch`` key (``oldest``, the stream's oldest recorded layout,
    when the group has none: it has not passed any switch yet)."""
    if not value:
        return oldest
    return int(json.loads(value).get("epoch", oldest))


def repartitioned_message(stream: str, partitions: int, epoch: int) -> str:
    """What a publisher that still routes by an earlier layout is told."""
    return (
        f"stream {stream} was repartitioned to {partitions} partitions (epoch {epoch}); the "
        "server no longer takes the subjects this publish was routed to. Restart the publish: "
        "a new publisher reads the new layout (records the stream already acknowledged are "
        "kept, and a rerun with the same run id / msg-ids stores nothing twice)"
    )


def pending_switch_problem(stream: str, partitions: int, epoch: int, pending_epoch: int) -> str:
    """What every reader says while layout ``pending_epoch`` of ``stream`` (now at ``epoch``
    with ``partitions`` partitions) has no recorded switch point: no group moves past it,
    and whether its records are all stored is not known, so no group is drained."""
    return (
        f"the repartition of stream {stream} to {partitions} partitions (epoch {epoch}) has "
        f"not recorded the switch point of epoch {pending_epoch} yet: groups stay on epoch "
        f"{pending_epoch} (or earlier) and none is drained until it has. If no repartition "
        "is running (it was interrupted), complete it: `nats-ordered repartition --stream "
        f"{stream} --partitions {partitions}`"
    )
