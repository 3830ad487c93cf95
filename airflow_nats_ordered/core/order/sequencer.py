"""One global-order publisher per stream at a time: the sequencer claim (key ``sequencer`` of
the watermark bucket ``nor_<stream>_global``).

Guarantees: claiming is a compare-and-set, so of two publishers starting at once exactly one
gets the claim and the other is refused (:class:`SequencerBusy`, naming the holder). A claim
is renewed every ``stale_after / 4`` seconds and given back (deleted by compare-and-set on
its own revision) when the publisher closes; a holder that died without giving it back is
taken over once its last renewal is ``stale_after`` seconds old **by the claimant's wall
clock** (publishers' clocks must agree to well within ``stale_after``). A holder that finds
its claim taken over (it was paused past ``stale_after``) stops writing watermarks
(:attr:`SequencerClaim.lost`); its records after that may break the order, which a
global-order reader detects and stops at.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from nats.nuid import NUID

from airflow_nats_ordered.core.errors import NatsOrderedError
from airflow_nats_ordered.core.stream.kv import compact_json, latest_entry

log = logging.getLogger(__name__)

SEQUENCER_KEY = "sequencer"
#: seconds without renewal after which a claim counts as abandoned
STALE_AFTER = 10.0


class SequencerBusy(NatsOrderedError):
    """Another global-order publisher holds the stream's sequencer claim. Not a
    ConfigError: it passes (the holder closes, or its claim lapses), so an Airflow task
    that meets it is retried rather than failed at once (a retry of a killed try meets
    the killed try's claim for up to ``STALE_AFTER`` seconds)."""


class SequencerClaim:
    """The claim of one publisher (``producer``) on the global sequence of ``stream``."""

    def __init__(
        self,
        nc: NATS,
        kv: KeyValue,
        bucket: str,
        stream: str,
        producer: str,
        stale_after: float = STALE_AFTER,
    ) -> None:
        self.nc = nc
        self.kv = kv
        self.bucket = bucket
        self.stream = stream
        self.producer = producer
        self.stale_after = stale_after
        self.nonce = NUID().next().decode()
        self.revision = 0
        self.lost = False
        self._renewed = 0.0

    def _value(self) -> bytes:
        now = round(time.time(), 3)
        return compact_json({"producer": self.producer, "claim": self.nonce, "ts": now})

    async def claim(self) -> None:
        """Take the claim, or raise :class:`SequencerBusy` while another publisher holds it."""
        while True:
            found = await latest_entry(self.nc, self.bucket, SEQUENCER_KEY)
            if found is not None and found[0] is not None:
                held = json.loads(found[0])
                age = time.time() - float(held.get("ts") or 0)
                if age < self.stale_after:
                    raise SequencerBusy(
                        f"another global-order publisher (producer {held.get('producer')!r}) "
                        f"is publishing to stream {self.stream} (renewed {max(age, 0):.1f}s "
                        "ago): one global-order publisher per stream at a time, or their "
                        "global sequences would interleave out of publish order. Wait for it "
                        f"to close; if it died, its claim lapses {self.stale_after:g}s after "
                        "its last renewal"
                    )
            try:
                if found is None:
                    self.revision = await self.kv.create(SEQUENCER_KEY, self._value())
                else:  # given back (a delete marker) or abandoned
                    self.revision = await self.kv.update(
                        SEQUENCER_KEY, self._value(), last=found[1]
                    )
            except KeyWrongLastSequenceError:
                continue  # another publisher claimed it meanwhile: look at theirs
            self._renewed = time.monotonic()
            return

    async def renew_if_due(self) -> None:
        if self.lost or time.monotonic() - self._renewed < self.stale_after / 4:
            return
        try:
            self.revision = await self.kv.update(SEQUENCER_KEY, self._value(), last=self.revision)
        except KeyWrongLastSequenceError:
            self.lost = True
            log.error(
                "stream %s: another global-order publisher took over the sequencer claim of "
                "producer %s (it was not renewed for %gs): no more watermarks from this one",
                self.stream,
                self.producer,
                self.stale_after,
            )
            return
        except (NatsError, TimeoutError) as exc:  # tried again at the next round
            log.info("sequencer claim of stream %s not renewed: %s", self.stream, exc)
            return
        self._renewed = time.monotonic()

    async def release(self) -> None:
        """Give the claim back (only if it is still this publisher's)."""
        if self.lost or not self.revision:
            return
        with contextlib.suppress(NatsError, TimeoutError, KeyWrongLastSequenceError):
            await self.kv.delete(SEQUENCER_KEY, last=self.revision)


__all__ = ["SEQUENCER_KEY", "STALE_AFTER", "SequencerBusy", "SequencerClaim"]
