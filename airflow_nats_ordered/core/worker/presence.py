"""Is the group a member joined still there? (:class:`GroupPresence`, :class:`GroupWatch`)

``nats-ordered group delete --force`` (:func:`~..admin.delete.delete_group` with
``force=True``) deletes a group's two KV buckets under its running members. Every lease
renewal, claim and commit of such a member then fails (the server has no stream for the
bucket's subjects: "no response from stream"), and nothing it does can succeed again: its
leases, fencing tokens and committed positions are gone. A member that started again would
create the group afresh and begin the stream from its first message, so that is for the
operator to decide, never something to retry.

Guarantees: a member (its :class:`GroupWatch`, a part of :class:`~.worker.Worker`) checks
on a failed operation of its loops, at most once per renew interval, and stops on the first
confirmed deletion with one logged error and :attr:`~GroupWatch.error` set to a
:class:`GroupDeletedError`. :meth:`GroupPresence.check` reports the group as deleted only
on the server's own answer that a bucket's stream does not exist (JetStream error 10059),
or that it exists with another creation time than when the member joined (deleted and
created again); a timeout, a server restarting or any other error is not taken as proof.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from airflow_nats_ordered.core.connection.api import jetstream
from airflow_nats_ordered.core.errors import NatsOrderedError, exc_text
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.worker.context import MemberContext

# the worker's logger: records keep the name they had before the worker was split up
log = logging.getLogger("airflow_nats_ordered.core.worker.worker")

#: JetStream's "stream not found" error code
STREAM_NOT_FOUND = 10059


class GroupDeletedError(NatsOrderedError):
    """The group's state was deleted (or deleted and created again) under a running member;
    the member stops instead of retrying. ``buckets``: the buckets found gone or new."""

    def __init__(self, message: str, buckets: list[str]) -> None:
        super().__init__(message)
        self.buckets = buckets


class GroupPresence:
    """The identity (creation time) of a group's two buckets when a member joined, and a
    check that they are still the same buckets."""

    def __init__(self, nc: NATS, cfg: GroupConfig) -> None:
        self.nc = nc
        self.cfg = cfg
        self._created: dict[str, Any] = {}

    @property
    def buckets(self) -> tuple[str, str]:
        return (self.cfg.lease_bucket, self.cfg.state_bucket)

    async def record(self) -> None:
        """Remember the buckets' creation times (call once they exist). Best effort: a
        bucket whose time could not be read is later checked only for existence."""
        js = jetstream(self.nc)
        for bucket in self.buckets:
            try:
                self._created[bucket] = (await js.stream_info(f"KV_{bucket}")).created
            except (NatsError, TimeoutError):
                continue

    async def check(self) -> GroupDeletedError | None:
        """The error to stop with if the group was deleted since :meth:`record`, else None
        (also when the server could not tell)."""
        js = jetstream(self.nc)
        gone: list[str] = []
        renewed: list[str] = []
        for bucket in self.buckets:
            try:
                info = await js.stream_info(f"KV_{bucket}")
            except NotFoundError as exc:
                if exc.err_code != STREAM_NOT_FOUND:
                    return None
                gone.append(bucket)
                continue
            except (NatsError, TimeoutError):
                return None  # cannot tell: a blip is not a deletion
            recorded = self._created.get(bucket)
            if recorded is not None and info.created is not None and info.created != recorded:
                renewed.append(bucket)
        group = f"group {self.cfg.group} of stream {self.cfg.stream}"
        if gone:
            return GroupDeletedError(
                f"{group} was deleted while this member ran (bucket(s) {', '.join(gone)} no "
                "longer exist, e.g. after `nats-ordered group delete --force`): its leases and "
                "committed positions are gone, so the member stopped. Starting a member again "
                "creates the group afresh and processes the stream from its first message",
                gone,
            )
        if renewed:
            return GroupDeletedError(
                f"{group} was deleted and created again while this member ran (bucket(s) "
                f"{', '.join(renewed)} are new): the leases and positions it held are gone, "
                "so the member stopped. Start it again to join the group as it is now",
                renewed,
            )
        return None


class GroupWatch:
    """A member's watch on its group (see the module): what its loops call when an
    operation on the group failed (:meth:`trouble`), and the error it stopped with."""

    def __init__(self, ctx: MemberContext, crash: Callable[[], None]) -> None:
        #: read here: the connection, settings, member id and whether it is stopping
        self.ctx = ctx
        #: stops the member as a crash would (once, however often it is called)
        self._crash = crash
        #: why the member stopped on its own (None: it did not, or on a loop's exception)
        self.error: NatsOrderedError | None = None
        self.presence: GroupPresence | None = None
        self._check: asyncio.Task[None] | None = None
        self._checked = 0.0

    async def record(self) -> None:
        """Remember the group's buckets as they are when the member joins (their creation
        times; :meth:`GroupPresence.record`)."""
        self.presence = GroupPresence(self.ctx.nc, self.ctx.cfg.group_config)
        await self.presence.record()

    def trouble(self, what: str, exc: BaseException, *args: Any) -> None:
        """A loop's operation on the group failed: warn (unless the member is already
        stopping on an error) and check, at most once per renew interval, whether the group
        was deleted; if it was, the member stops with :class:`GroupDeletedError`."""
        if self.error is not None:
            return
        log.warning("member %s: " + what + ": %s", self.ctx.member, *args, exc_text(exc))
        now = asyncio.get_running_loop().time()
        if (
            self.presence is None
            or self.ctx.stopping
            or (self._check is not None and not self._check.done())
            or now - self._checked < self.ctx.cfg.group_config.renew_interval
        ):
            return
        self._checked = now
        self._check = asyncio.ensure_future(self._check_presence(self.presence))

    async def _check_presence(self, presence: GroupPresence) -> None:
        error = await presence.check()
        if error is not None and self.error is None:
            self.error = error
            log.error("member %s: %s", self.ctx.member, error)
            self._crash()
