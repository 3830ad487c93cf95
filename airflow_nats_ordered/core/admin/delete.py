"""Deleting a consumer group: its state, and its dead letters when asked.

A group's state is two KV buckets, ``nor_<stream>_<group>_leases`` and
``nor_<stream>_<group>_state`` (see :mod:`..group.store`). Its dead letters live in the
dead-letter stream ``<STREAM>_DLQ`` (:mod:`.dlq`), shared by every group of the stream, so
deleting a group removes its dead letters only when asked, and the dead-letter stream
itself only once nothing is left in it and no other group of the stream has state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.admin import dlq
from airflow_nats_ordered.core.admin.membership import GroupNotFoundError, live_members
from airflow_nats_ordered.core.connection.api import jetstream, stream_infos
from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.config import GroupConfig


class GroupInUseError(NatsOrderedError):
    """The group still has live members; ``members`` names them."""

    def __init__(self, message: str, members: list[str]) -> None:
        super().__init__(message)
        self.members = members


@dataclass(frozen=True)
class GroupDeleted:
    """What :func:`delete_group` removed."""

    stream: str
    group: str
    buckets: list[str] = field(default_factory=list)
    #: live members at the time of a forced delete (they crash on their next KV access)
    live_members: list[str] = field(default_factory=list)
    dead_letters_purged: int = 0
    dead_letter_stream_deleted: bool = False
    #: why the dead-letter stream was kept when dead letters were purged, if it was
    dead_letter_stream_kept: str | None = None


async def _other_groups(nc: NATS, stream: str, group: str) -> list[str]:
    """State buckets of other groups that may belong to ``stream``. Conservative: a bucket
    of a stream whose name starts with ``<stream>_`` matches too (names are ambiguous)."""
    ours = GroupConfig(stream, group).state_bucket
    head, tail = f"KV_nor_{stream}_", "_state"
    found: list[str] = []
    async for info in stream_infos(nc):
        name = info.config.name or ""
        if name.startswith(head) and name.endswith(tail) and name[3:] != ours:
            found.append(name[3:])
    return sorted(found)


async def delete_group(
    nc: NATS,
    stream: str,
    group: str,
    *,
    force: bool = False,
    dead_letters: bool = False,
) -> GroupDeleted:
    """Delete ``group``'s two KV buckets: its leases, commits, fencing tokens and assignment.

    Refuses (:class:`GroupInUseError`) while members are alive unless ``force=True``: a
    forced delete under running members makes them fail, and a member that starts again
    begins the stream from its first message. With ``dead_letters=True`` the group's
    subjects in ``<stream>_DLQ`` are purged, and the dead-letter stream is deleted when it
    is then empty and no other group of the stream has state. Raises
    :class:`GroupNotFoundError` when there is nothing to delete.
    """
    cfg = GroupConfig(stream, group)
    members = await live_members(nc, stream, group)
    if members and not force:
        raise GroupInUseError(
            f"group {group} of stream {stream} has {len(members)} live member(s): "
            f"{', '.join(members)}. Stop its workers first (they leave the group on SIGTERM), "
            "or pass force=True to delete it under them",
            members,
        )
    js = jetstream(nc)
    deleted: list[str] = []
    for bucket in (cfg.lease_bucket, cfg.state_bucket):
        try:
            await js.delete_key_value(bucket)
        except NotFoundError:
            continue
        deleted.append(bucket)
    purged, dlq_deleted, kept = 0, False, None
    if dead_letters:
        purged, dlq_deleted, kept = await _remove_dead_letters(nc, stream, group)
    if not deleted and not purged and not dlq_deleted:
        left = 0 if dead_letters else (await dlq.dead_letters(nc, stream, group)).messages
        raise GroupNotFoundError(
            f"group {group} of stream {stream} does not exist: no bucket {cfg.lease_bucket} "
            f"or {cfg.state_bucket}"
            + (
                f"; its {left} dead letter(s) are kept: pass dead_letters=True to purge them"
                if left
                else ""
            ),
            stream,
            group,
            left,
        )
    return GroupDeleted(
        stream,
        group,
        buckets=deleted,
        live_members=members,
        dead_letters_purged=purged,
        dead_letter_stream_deleted=dlq_deleted,
        dead_letter_stream_kept=kept,
    )


async def _remove_dead_letters(nc: NATS, stream: str, group: str) -> tuple[int, bool, str | None]:
    """Purge the group's dead-letter subjects; delete the dead-letter stream if it is then
    empty and no other group may still publish to it. Returns (purged, deleted, why kept)."""
    found = await dlq.dead_letters(nc, stream, group)
    if not found.exists:
        return 0, False, None
    js = jetstream(nc)
    if found.messages:
        await js.purge_stream(found.stream, subject=found.subjects)
    left = (await js.stream_info(found.stream)).state.messages
    if left:
        return found.messages, False, f"it still holds {left} dead letter(s) of other groups"
    others = await _other_groups(nc, stream, group)
    if others:
        return (
            found.messages,
            False,
            f"other groups may still dead-letter into it (buckets {', '.join(others)})",
        )
    with contextlib.suppress(NotFoundError):  # deleted meanwhile: the outcome asked for
        await js.delete_stream(found.stream)
    return found.messages, True, None
