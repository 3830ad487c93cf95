"""Why a drain wait or check ends without the group drained, as errors a caller can tell
apart (an Airflow task fails at once on the ones waiting cannot fix), and the messages that
name the partitions still behind and the command that helps.
"""

from __future__ import annotations

from collections.abc import Mapping

from airflow_nats_ordered.core.admin.marks import DrainProgress
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.stream.strays import Strays


class DrainTimeoutError(NatsOrderedError):
    """The group did not reach its marks in time. ``behind`` maps each partition still
    behind to ``(committed, mark)``."""

    def __init__(self, message: str, behind: dict[int, tuple[int, int]]) -> None:
        super().__init__(message)
        self.behind = behind


class NoMembersError(NatsOrderedError):
    """No member of the group has been alive for the allowed time: nothing is consuming
    the group, so waiting longer cannot help until workers are started."""


class NoGroupStateError(NatsOrderedError):
    """The group has no state yet: no worker has ever joined it (its KV buckets do not
    exist). A wrong group name looks the same, so the message names both causes."""

    def __init__(self, stream: str, group: str) -> None:
        super().__init__(
            f"group {group} of stream {stream} has no state yet: no worker has joined it. "
            f"Start a worker (`nats-ordered worker --stream {stream} --group {group} "
            "--handler ...`), or check the group name"
        )
        self.stream = stream
        self.group = group


class StrayMessagesError(NatsOrderedError):
    """The stream holds messages on subjects that are not partition subjects: no worker
    reads them, so waiting cannot drain them. ``strays`` says where they are."""

    def __init__(self, strays: Strays) -> None:
        super().__init__(strays.problem())
        self.strays = strays


class RepartitionUnfinishedError(NatsOrderedError):
    """The stream's repartition has not recorded its switch point for the allowed time: no
    group moves past the closed layout and whether all its records are stored is not known,
    so waiting longer cannot help until the repartition is completed (the message names the
    command). ``epoch`` is the closed layout's."""

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


class PartitionBlockedError(NatsOrderedError):
    """A partition is blocked on a poison message before reaching its mark: it will not
    drain until the handler is fixed (or the message is dealt with)."""

    def __init__(self, message: str, partition: int, reason: str) -> None:
        super().__init__(message)
        self.partition = partition
        self.reason = reason


def no_members_error(
    stream: str,
    group: str,
    after: float,
    behind: Mapping[int, tuple[int, int]],
    group_missing: bool = False,
    waiting_epoch: int | None = None,
) -> NoMembersError:
    """The error of a wait nobody serves: ``behind`` holds only the partitions still short
    of their mark (``partition -> (committed, mark)``, as :attr:`.marks.DrainProgress.behind`),
    so the count it gives is the one the wait logged."""
    why = (
        f"the group has no state yet: no worker joined it within {after:g}s"
        if group_missing
        else f"no member has been alive for {after:g}s"
    )
    left = f"{len(behind)} partition(s) are behind their mark"
    if waiting_epoch is not None:
        left += (
            f" and the group has not yet finished the partitions of its earlier layout "
            f"(the stream is at layout epoch {waiting_epoch})"
        )
    return NoMembersError(
        f"no worker pool is consuming group {group} of stream {stream}: {why} while "
        f"{left}. Start the workers (`nats-ordered "
        f"worker --stream {stream} --group {group} --handler ...`, or `nats-ordered "
        "global-read ...` for a global-order group), then retry"
        + ("; or check the group name" if group_missing else "")
    )


def timeout_error(
    stream: str,
    group: str,
    timeout: float,
    marks: Mapping[int, int],
    committed: Mapping[int, int],
    group_missing: bool = False,
    waiting_epoch: int | None = None,
    unfinished: str | None = None,
) -> DrainTimeoutError:
    """The error of a wait that reached ``timeout`` before the marks: it names the
    partitions still behind (the first five) and why the group may not have moved."""
    behind = DrainProgress(marks, committed, timeout).behind
    shown = ", ".join(f"{p} at {c} of {m}" for p, (c, m) in list(behind.items())[:5])
    more = f" and {len(behind) - 5} more" if len(behind) > 5 else ""
    missing = " (the group has no state yet: no worker has joined it)" if group_missing else ""
    if unfinished is not None:
        missing += f" ({unfinished})"
    elif waiting_epoch is not None:
        missing += (
            f" (the stream was repartitioned: the group has not yet finished the partitions "
            f"of its earlier layout, so it has not reached layout epoch {waiting_epoch})"
        )
    return DrainTimeoutError(
        f"group {group} of stream {stream} did not drain within {timeout:g}s{missing}: "
        f"{len(behind)} partition(s) behind their mark (partition {shown}{more}). Check that "
        f"its workers are running and making progress (`nats-ordered status --stream {stream} "
        f"--group {group}`), or pass a longer timeout",
        behind,
    )
