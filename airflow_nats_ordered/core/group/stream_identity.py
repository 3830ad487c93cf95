"""Which stream a group's positions refer to: its recorded identity, and what is refused when
the stream is not that one any more.

Guarantees: the group records the stream's identity (its creation time) once; a stream
deleted and created again under the same name is detected (:class:`StreamRecreated`, with
the operator's fix) instead of being read from the old stream's sequence numbers.
:class:`StateWentBack` is what the worker raises when a recorded position is no longer part
of the stream's history. :class:`GroupStreamIdentity` holds these checks;
:class:`~.store.GroupStore` has one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import (
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.stream.kv import compact_json, latest_entry
from airflow_nats_ordered.core.stream.partitioned import PartitionedStream, describe


class StreamRecreated(NatsOrderedError):
    """The stream was deleted and created again since the group recorded its positions:
    they (and the sink's last sequences) refer to the old stream's sequence numbers."""


class StateWentBack(NatsOrderedError):
    """A recorded position (the group's commit, the sink's applied position, the reader's
    position) is not part of the stream's history any more: the servers' stored state went
    back and the stream hands out its sequences again (see :mod:`..stream.continuity`).
    ``last_seq`` is the stream's last sequence when it was found."""

    def __init__(self, message: str, last_seq: int = 0) -> None:
        super().__init__(message)
        self.last_seq = last_seq


class GroupStreamIdentity:
    """The stream-identity checks of a group: its identity record in the state bucket
    ``state``, and the ``stream`` the group's store was opened on (``None`` if it no longer
    existed then).

    ``epoch`` gives the layout epoch the group's keys and partitions refer to now (see
    :mod:`..stream.layout`): the store's, which moves when the group moves to another
    layout."""

    def __init__(
        self,
        nc: NATS,
        cfg: GroupConfig,
        state: KeyValue,
        stream: PartitionedStream | None,
        epoch: Callable[[], int],
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.state = state
        self.stream = stream
        self.epoch = epoch

    async def record_stream(self, stream: PartitionedStream) -> None:
        """Record the stream's identity in the state bucket, or check it against the one
        recorded; raises StreamRecreated if they differ. Rides out the moments after a
        bucket is created in a cluster, before its leader and subject interest are known."""
        value = compact_json({"name": stream.name, "created": stream.created})
        deadline = time.monotonic() + 10.0
        while True:
            try:
                found = await latest_entry(self.nc, self.cfg.state_bucket, "stream")
                if found is not None and found[0] is not None:
                    recorded = json.loads(found[0]).get("created", "")
                    if recorded and stream.created and recorded != stream.created:
                        raise StreamRecreated(self.recreated_message(recorded, stream.created))
                    return
                if found is None:
                    await self.state.create("stream", value)
                else:  # a delete marker
                    await self.state.update("stream", value, last=found[1])
                return
            except KeyWrongLastSequenceError:
                continue  # another member recorded it meanwhile: check theirs
            except (NoStreamResponseError, ServiceUnavailableError, NatsTimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    def recreated_message(self, recorded: str, now: str) -> str:
        """Why a group whose recorded stream identity is ``recorded`` refuses the stream
        created at ``now``, and the operator's fix."""
        c = self.cfg
        return (
            f"stream {c.stream} was deleted and created again (group {c.group} recorded a "
            f"stream created at {recorded}; the stream now was created at {now}): the group's "
            "committed positions and fencing tokens, and the sink's last applied sequences, "
            "refer to the old stream's sequence numbers, so resuming would skip new messages "
            f"silently. Reset the group (`nats-ordered group delete --stream {c.stream} "
            f"--group {c.group}`) and reset the sink's state for this stream and group, then "
            "start the workers again."
        )

    async def check_stream(self) -> PartitionedStream:
        """Describe the stream now; raises StreamRecreated if it is not the stream this
        store was opened on (deleted and created again under the same name)."""
        live = await describe(self.nc, self.cfg.stream)
        opened = self.stream.created if self.stream is not None else ""
        if opened and live.created and opened != live.created:
            raise StreamRecreated(self.recreated_message(opened, live.created))
        # as a reader of the group's layout epoch sees it (partition count, subjects)
        epoch = self.epoch()
        return live if live.epoch == epoch else live.at_epoch(epoch)
