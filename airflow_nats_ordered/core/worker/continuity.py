"""A partition's positions against the stream's history, and a partition held for an
operator (:class:`Continuity`, which a member's delivery has).

Before anything of a newly granted partition is handled (:meth:`Continuity.check`), the
group's committed position and the sink's applied position (the handler's
``applied_position`` hook, read through the member's layout epoch) are checked against the
stream's history with :func:`~..stream.continuity.divergence`; so is the reader's position
each time its consumer is re-created (:meth:`Continuity.verify_position`). A partition whose
positions are not part of that history any more (the servers' stored state went back), or
whose sink can neither apply nor skip a message (:class:`~..errors.OrderConflict`), is held
(:meth:`Continuity.hold`): nothing more of it is handled or committed, it keeps its lease
so no other member resumes it, and it says why (its blocked marker, the member's problems,
``stats["stopped"]``) until it is revoked, e.g. by an operator's reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging

from nats.errors import Error as NatsError

from airflow_nats_ordered.core.errors import NatsOrderedError, OrderConflict
from airflow_nats_ordered.core.group.stream_identity import StateWentBack
from airflow_nats_ordered.core.stream.continuity import Position, divergence, stopped_reason
from airflow_nats_ordered.core.stream.message import AppliedPosition, Message
from airflow_nats_ordered.core.worker.context import MemberContext
from airflow_nats_ordered.core.worker.owned import OwnedPartition

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")


class Continuity:
    """The continuity checks and holds of a member's partitions (see the module)."""

    def __init__(self, ctx: MemberContext, applied_position: AppliedPosition | None) -> None:
        #: read here: the settings, store, stream and member id; written: statistics
        #: (``stopped``) and problems (``continuity.<partition>``)
        self.ctx = ctx
        #: the sink's applied position of a partition, in the member's layout epoch
        self._applied_position = applied_position

    async def _sink_position(self, p: int) -> tuple[int, str | None] | None:
        """The sink's applied position of ``p`` from the handler's ``applied_position``
        hook (None without a hook, or if the sink applied nothing)."""
        if self._applied_position is None:
            return None
        try:
            r = self._applied_position(p)
            r = await r if inspect.isawaitable(r) else r
            if r is None:
                return None
            seq, msg_id = r
            return int(seq), (str(msg_id) if msg_id else None)
        except Exception as exc:
            raise NatsOrderedError(
                f"applied_position({p}) failed: {type(exc).__name__}: {exc}"
            ) from exc

    async def check(self, o: OwnedPartition) -> str | None:
        """Check, before anything of a newly granted partition is handled, that the group's
        committed position and the sink's applied position are still part of the stream's
        history. The blocked reason (with the operator action) if not, else None."""
        p, grant = o.partition, o.grant
        subject = self.ctx.stream.subject(p)
        positions = [
            Position(
                grant.committed, grant.committed_id or None, f"the group's commit record c.{p}"
            )
        ]
        sink = await self._sink_position(p)
        if sink is not None:
            positions.append(Position(sink[0], sink[1], "the sink's applied position"))
        problems: list[str] = []
        anchor: int | None = None
        last_seq = 0
        for pos in positions:
            # (a position before the first message is in every history: a new group's
            # partitions start without a stream info round trip each)
            why = None
            if pos.seq > 0:
                found = await self.ctx.store.stored_at(pos.seq)
                last_seq = found.last_seq
                why = divergence(pos, subject, found)
            if why is not None:
                problems.append(why)
            elif pos is positions[0]:
                anchor = pos.seq
        if not problems:
            self.ctx.report(f"continuity.{p}", None)
            return None
        return self.went_back(p, "; ".join(problems), anchor, last_seq)

    def went_back(self, p: int, problem: str, anchor: int | None, last_seq: int) -> str:
        """Why ``p`` stops (``problem``: its positions are not in the stream's history),
        with the operator action."""
        return stopped_reason(
            self.ctx.stream.name, self.ctx.cfg.group, p, problem, anchor, last_seq
        )

    async def verify_position(self, p: int, seq: int, msg_id: str | None) -> None:
        """Before the reader of ``p`` re-creates its consumer: the stream is the one the
        group's positions refer to, and still holds the last message handed out."""
        await self.ctx.store.check_stream()
        found = await self.ctx.store.stored_at(seq)
        why = divergence(
            Position(seq, msg_id, "the reader's position"), self.ctx.stream.subject(p), found
        )
        if why is not None:
            raise StateWentBack(why, found.last_seq)

    def refused(self, m: Message, exc: OrderConflict) -> str:
        """Why a partition stops at ``m``: the handler's sink can neither apply nor skip it."""
        return (
            f"stopped at seq {m.stream_seq}: the handler's sink can neither apply nor skip it "
            f"({type(exc).__name__}: {exc}), so it is not retried or dead-lettered. If the "
            "stream's stored state went back, the operator action is to rewind the sink and "
            "reset the group to the last sequence both still agree on"
        )

    async def hold(self, o: OwnedPartition, reason: str) -> None:
        """Stop handling ``o`` and say why (blocked marker, problems) until it is revoked
        (e.g. by an operator's reset, which takes the lease): the lease is kept, so no other
        member resumes it meanwhile, and nothing is committed."""
        p = o.partition
        o.blocked = reason
        self.ctx.stats["stopped"] += 1
        log.error("member %s: partition %d %s", self.ctx.member, p, reason)
        self.ctx.report(f"continuity.{p}", f"partition {p}: {reason}")
        if o.committer is not None:
            # nothing more is committed, and the marker goes after any write already sent
            o.committer.cancel()
            await o.committer.settle(0.0)
        written = False
        while not o.revoke.is_set():
            if not written:
                with contextlib.suppress(NatsError, TimeoutError):
                    await self.ctx.store.set_blocked(p, reason)
                    written = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await o.revoke.wait()
