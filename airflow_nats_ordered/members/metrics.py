"""Prometheus metrics and a health endpoint for group members (``--metrics-port``).

:class:`MetricsServer` serves, from a thread (so it answers even while the event loop is
busy), ``GET /metrics`` in the Prometheus text format (``prometheus-client``) and
``GET /healthz`` (alias ``/health``): 200 with ``{"healthy": true, ...}``, or 503 with the
reasons.

A member (:class:`MemberMetrics`) exports, labelled ``stream``, ``group`` (and ``member``):

* the group view, read from NATS at scrape time: per partition ``owner`` (1 for the live
  lease holder's id, ``owner=""`` 0 when unowned), ``committed``, ``last``, ``lag``,
  ``blocked``; the group's total lag, live members, layout epoch and whether a layout
  switch it waits on is unfinished. The lags are :mod:`..core.group.lag`'s, exactly what
  ``status`` and ``group list`` show;
* its own counters (every key of ``Worker.stats``: processed, retries, dead-lettered,
  fenced, leases lost, ...), owned partitions and the NATS round-trip time.

Health guarantee: ``/healthz`` turns 503 when the member cannot renew its leases, judged
by what renewing needs: the NATS connection is closed, or no round trip to the server
(PING/PONG) has completed for ``lease_ttl`` seconds (a paused, unreachable or
reconnecting server, or an event loop too blocked to run the probe), or a partition the
member processes holds a lease whose deadline has passed, or the member has stopped.

A pool (:class:`PoolMetrics`) serves one endpoint for all its members: it reads each
member's own endpoint on localhost and merges them (the group view, identical from every
member, once), adds its supervisor's figures (members up, restarts), and is healthy only
when every member runs and is healthy.

A publisher (:class:`PublisherMetrics`, ``nats-ordered publish --metrics-port``) exports,
labelled ``stream``, the records it had acknowledged, those it refused before sending (by
``reason``: no key, too large, ...) and those sent but not confirmed stored (``failed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nats.aio.client import Client as NATS
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from airflow_nats_ordered.core.group.lag import GroupLag, read_group_lag
from airflow_nats_ordered.core.group.status import GroupState
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.core.worker.worker import Worker

PREFIX = "nats_ordered"

#: help texts of known ``Worker.stats`` keys (others are exported with a generic text)
STAT_HELP: Mapping[str, str] = {
    "processed": "messages handled and counted as processed",
    "handler_errors": "handler calls that raised (each retry and the last one counted)",
    "retries": "handler calls that failed and were retried",
    "rebalances": "assignments that changed this member's partitions",
    "dead_lettered": "messages sent to the dead-letter subject after the retries",
    "fenced": "partitions stopped because the sink saw a newer fencing token",
    "leases_lost": "partition leases lost (expired or taken) while owned",
}


@dataclass(frozen=True)
class Health:
    """The answer of ``/healthz``."""

    healthy: bool
    problems: tuple[str, ...] = ()
    details: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "problems": list(self.problems), **(self.details or {})}


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path in ("", "/metrics"):
                body, status, ctype = self.server.render_metrics(), 200, CONTENT_TYPE_LATEST
            elif path in ("/healthz", "/health"):
                health = self.server.health()
                body = (json.dumps(health.to_json()) + "\n").encode()
                status, ctype = (200 if health.healthy else 503), "application/json"
            else:
                body, status, ctype = b"try /metrics or /healthz\n", 404, "text/plain"
        except Exception as exc:  # a failed scrape must be visible, not a dropped socket
            body, status, ctype = f"error: {exc}\n".encode(), 500, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # scrapes every few seconds would drown the member's own log


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    render_metrics: Callable[[], bytes]
    health: Callable[[], Health]


class MetricsServer:
    """``/metrics`` from ``registry`` and ``/healthz`` from ``health`` on ``addr:port``,
    served by a daemon thread until :meth:`close`. Port 0 picks a free port (:attr:`port`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Callable[[], Health],
        port: int,
        addr: str = "127.0.0.1",
    ) -> None:
        self._server = _Server((addr, port), _Handler)
        self._server.render_metrics = lambda: generate_latest(registry)
        self._server.health = health
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"metrics:{self.port}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ------------------------------------------------------------------------------- a member


class MemberMetrics(Collector):
    """The metrics and health of one running :class:`Worker` (see the module docstring).

    :meth:`run` (a task on the worker's event loop) probes the connection every
    ``probe_interval`` seconds; scrapes run in the server's thread and read the group view
    through the loop, with a timeout."""

    def __init__(
        self,
        worker: Worker,
        nc: NATS,
        loop: asyncio.AbstractEventLoop,
        *,
        probe_interval: float = 1.0,
        scrape_timeout: float = 5.0,
    ) -> None:
        self.worker = worker
        self.nc = nc
        self.loop = loop
        self.probe_interval = probe_interval
        self.scrape_timeout = scrape_timeout
        self.stale_after = worker.cfg.lease_ttl
        self.last_roundtrip_ok = time.monotonic()
        self.roundtrip_seconds: float | None = None
        self.labels = {
            "stream": worker.cfg.stream,
            "group": worker.cfg.group,
            "member": worker.member,
        }

    async def run(self) -> None:
        """Probe the server with a PING round trip until cancelled."""
        while True:
            t0 = time.monotonic()
            if not self.nc.is_closed and self.nc.is_connected:
                with contextlib.suppress(Exception):
                    # nats-py annotates flush's timeout as int; it is seconds, a float works
                    timeout = max(self.stale_after, self.probe_interval)
                    await self.nc.flush(timeout=timeout)  # type: ignore[arg-type]
                    done = time.monotonic()
                    self.roundtrip_seconds = done - t0
                    self.last_roundtrip_ok = done
            await asyncio.sleep(max(0.0, self.probe_interval - (time.monotonic() - t0)))

    def health(self) -> Health:
        """Whether this member can renew its leases (thread-safe: reads plain values)."""
        now = time.monotonic()
        problems = []
        w = self.worker
        if w.stopped.is_set():
            problems.append(f"member {w.member} has stopped")
        if self.nc.is_closed:
            problems.append("the NATS connection is closed")
        age = now - self.last_roundtrip_ok
        if age > self.stale_after:
            state = "reconnecting" if self.nc.is_reconnecting else "connected"
            problems.append(
                f"no round trip to the NATS server for {age:.1f}s (> lease TTL "
                f"{self.stale_after:g}s; connection {state}): leases cannot be renewed"
            )
        for p, o in list(w.owned.items()):
            if o.task is not None and not o.releasing and o.lease.valid_until < now:
                problems.append(f"the lease of partition {p} expired without a renewal")
        return Health(
            not problems,
            tuple(problems),
            {
                "member": w.member,
                "partitions": self._claimed(),
                "last_roundtrip_age_seconds": round(age, 3),
            },
        )

    async def _group_view(self) -> tuple[GroupLag, GroupState]:
        cfg = self.worker.cfg
        described = await describe(self.nc, cfg.stream)
        store = await GroupStore.attach(self.nc, cfg.stream, cfg.group)
        snap = await store.snapshot()
        # as status counts it: the layout the group processes, and the later layouts' records
        return await read_group_lag(self.nc, described, store, snap), snap

    def collect(self) -> Iterable[Metric]:
        # the group view first, then the member's counters: a scrape is not one instant, and
        # read the other way round commits landing in between showed a drained group beside
        # a processed count that had not reached it; this way the counters are the newer
        future = asyncio.run_coroutine_threadsafe(self._group_view(), self.loop)
        try:
            view = future.result(self.scrape_timeout)
        except Exception:  # NATS unreachable, no group state yet, a stuck loop, ...
            future.cancel()
            view = None  # the member's own figures are still worth serving
        yield from self._member_metrics()
        ok = 0 if view is None else 1
        if view is not None:
            lag, snap = view
            yield from group_metrics(lag, snap, self.labels["stream"], self.labels["group"])
        g = GaugeMetricFamily(
            f"{PREFIX}_group_view_ok",
            "1 if the scrape read the group's state from NATS, 0 if it could not",
            labels=list(self.labels),
        )
        g.add_metric(list(self.labels.values()), ok)
        yield g

    def _claimed(self) -> list[int]:
        # list() copies the dict in one step: safe from this thread while the loop changes it
        return sorted(p for p, o in list(self.worker.owned.items()) if o.task is not None)

    def _member_metrics(self) -> Iterator[Metric]:
        w, names, values = self.worker, list(self.labels), list(self.labels.values())
        for key, count in list(w.stats.items()):
            c = CounterMetricFamily(
                f"{PREFIX}_member_{key}",
                STAT_HELP.get(key, f"Worker.stats[{key!r}] of the member"),
                labels=names,
            )
            c.add_metric(values, count)
            yield c
        gauges: list[tuple[str, str, float | None]] = [
            ("owned_partitions", "partitions the member processes now", len(self._claimed())),
            ("assigned_partitions", "partitions the latest assignment gives it", len(w.assigned)),
            ("generation", "the assignment generation the member last read", w.generation),
            (
                "healthy",
                "1 if /healthz is 200 (the member can renew its leases)",
                1 if self.health().healthy else 0,
            ),
            (
                "lease_renew_seconds",
                "how long the last round of renewals took (heartbeat and every lease)",
                w.renew_seconds,
            ),
            (
                "roundtrip_seconds",
                "the latest PING round trip to the NATS server",
                self.roundtrip_seconds,
            ),
            (
                "last_roundtrip_age_seconds",
                "seconds since a round trip to the NATS server last completed",
                time.monotonic() - self.last_roundtrip_ok,
            ),
        ]
        for name, text, value in gauges:
            if value is None:
                continue
            g = GaugeMetricFamily(f"{PREFIX}_member_{name}", text, labels=names)
            g.add_metric(values, value)
            yield g


def group_metrics(lag: GroupLag, snap: GroupState, stream: str, group: str) -> Iterator[Metric]:
    """The group view (per partition owner, committed, last, lag, blocked; totals) from a
    :class:`~..core.group.lag.GroupLag` and a :class:`~..core.group.status.GroupState`."""
    names, base = ["stream", "group", "partition"], [stream, group]
    fams = {
        "committed": GaugeMetricFamily(
            f"{PREFIX}_partition_committed", "the group's committed stream sequence", labels=names
        ),
        "last": GaugeMetricFamily(
            f"{PREFIX}_partition_last", "the partition's last stream sequence", labels=names
        ),
        "lag": GaugeMetricFamily(
            f"{PREFIX}_partition_lag",
            "records stored on the partition after the committed position",
            labels=names,
        ),
        "blocked": GaugeMetricFamily(
            f"{PREFIX}_partition_blocked", "1 if blocked on a poison message", labels=names
        ),
    }
    owner = GaugeMetricFamily(
        f"{PREFIX}_partition_owner",
        'the member holding the partition\'s lease (owner="" 0: nobody)',
        labels=[*names, "owner"],
    )
    for p in lag.partitions:
        labels = [*base, str(p.partition)]
        fams["committed"].add_metric(labels, p.committed)
        fams["last"].add_metric(labels, p.last)
        fams["lag"].add_metric(labels, p.lag)
        fams["blocked"].add_metric(labels, 1 if p.blocked else 0)
        holder = snap.leases.get(p.partition, (None, 0))[0]
        owner.add_metric([*labels, holder or ""], 1 if holder else 0)
    yield from fams.values()
    yield owner
    totals = [
        (
            "lag",
            "records the group has still to process: every partition's lag and the records "
            "of layouts after the group's",
            lag.total_lag,
        ),
        ("members", "members with a live heartbeat", len(snap.members)),
        (
            "drained",
            "1 if every partition's committed position reached its last and the stream "
            "holds no stray messages",
            lag.drained,
        ),
        (
            "strays",
            "messages on subjects of the stream that are not partitions (never consumed)",
            lag.strays.messages if lag.strays else 0,
        ),
        ("epoch", "the layout epoch (repartition) the group processes", lag.epoch),
        (
            "switch_unfinished",
            "1 while a layout switch the group has not passed has no recorded switch point "
            "(a repartition running or interrupted: the group waits on it)",
            lag.switch_unfinished,
        ),
    ]
    for name, text, value in totals:
        g = GaugeMetricFamily(f"{PREFIX}_group_{name}", text, labels=["stream", "group"])
        g.add_metric(base, int(value))
        yield g


def serve_member(
    worker: Worker, nc: NATS, port: int, addr: str = "127.0.0.1"
) -> tuple[MetricsServer, MemberMetrics]:
    """Start serving ``worker``'s metrics and health (call from its event loop, then run
    ``asyncio.ensure_future(metrics.run())``)."""
    metrics = MemberMetrics(worker, nc, asyncio.get_running_loop())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return MetricsServer(registry, metrics.health, port, addr), metrics


# ------------------------------------------------------------------------------- a pool


@dataclass
class MemberEndpoint:
    """What a pool knows of one member process."""

    member: str
    url: str  # http://127.0.0.1:PORT of the member's own endpoint
    running: bool = False
    restarts: int = 0


def _fetch(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - our own URL
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class PoolMetrics(Collector):
    """One endpoint for a pool's members (see the module docstring)."""

    def __init__(
        self, members: Callable[[], Sequence[MemberEndpoint]], *, timeout: float = 3.0
    ) -> None:
        self.members = members
        self.timeout = timeout

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        members = list(self.members())
        for m in members:
            if not m.running:
                continue
            try:
                status, body = _fetch(m.url + "/metrics", self.timeout)
            except OSError:
                continue  # starting or stopping: its `up` says so
            if status != 200:
                continue
            for fam in text_string_to_metric_families(body.decode()):
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    if key not in seen:  # the group view comes from every member: once
                        seen.add(key)
                        out.samples.append(s)
        yield from merged.values()
        up = GaugeMetricFamily(
            f"{PREFIX}_pool_member_up", "1 while the member process runs", labels=["member"]
        )
        restarts = CounterMetricFamily(
            f"{PREFIX}_pool_member_restarts",
            "times the pool restarted the member after it exited",
            labels=["member"],
        )
        for m in members:
            up.add_metric([m.member], 1 if m.running else 0)
            restarts.add_metric([m.member], m.restarts)
        yield up
        yield restarts

    def health(self) -> Health:
        """Healthy when every member runs and its own ``/healthz`` is 200."""
        problems: list[str] = []
        states: dict[str, Any] = {}
        for m in self.members():
            if not m.running:
                problems.append(f"member {m.member} is not running (restarts: {m.restarts})")
                states[m.member] = {"healthy": False, "problems": ["not running"]}
                continue
            try:
                status, body = _fetch(m.url + "/healthz", self.timeout)
                state = json.loads(body)
            except (OSError, ValueError) as exc:
                status, state = 0, {"healthy": False, "problems": [f"no answer: {exc}"]}
            states[m.member] = state
            if status != 200:
                problems += [f"member {m.member}: {p}" for p in state.get("problems", [])] or [
                    f"member {m.member}: /healthz answered {status}"
                ]
        return Health(not problems, tuple(problems), {"members": states})


def serve_pool(
    members: Callable[[], Sequence[MemberEndpoint]], port: int, addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serve a pool's merged metrics and health on ``addr:port``."""
    metrics = PoolMetrics(members)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return MetricsServer(registry, metrics.health, port, addr)


# ------------------------------------------------------------------------------- a publisher


#: the reasons a publisher refuses a record for (``core.publish.runs``' words)
REFUSAL_REASONS = ("no key", "bad key", "too large", "bad msg-id", "no msg-id", "refused")


class PublisherMetrics(Collector):
    """A running publisher's counters, read at scrape time from ``counts``: a callable
    returning ``(acked, failed, refused by reason)`` (plain reads, safe from the server's
    thread)."""

    def __init__(
        self, stream: str, counts: Callable[[], tuple[int, int, Mapping[str, int]]]
    ) -> None:
        self.stream = stream
        self.counts = counts

    def collect(self) -> Iterable[Metric]:
        acked, failed, refused = self.counts()
        a = CounterMetricFamily(
            f"{PREFIX}_publisher_acked",
            "records the server acknowledged as stored",
            labels=["stream"],
        )
        a.add_metric([self.stream], acked)
        f = CounterMetricFamily(
            f"{PREFIX}_publisher_failed",
            "records sent but not confirmed stored (the server refused them or never answered)",
            labels=["stream"],
        )
        f.add_metric([self.stream], failed)
        r = CounterMetricFamily(
            f"{PREFIX}_publisher_refused",
            "records refused before sending, by reason (no key, too large, ...)",
            labels=["stream", "reason"],
        )
        # every known reason from the start, at 0: a series born at 1 would hide the first
        # refusal from increase() (and from the alert on it)
        for reason in sorted({*REFUSAL_REASONS, *refused}):
            r.add_metric([self.stream, reason], refused.get(reason, 0))
        yield from (a, f, r)


def serve_publisher(
    stream: str,
    counts: Callable[[], tuple[int, int, Mapping[str, int]]],
    port: int,
    addr: str = "127.0.0.1",
) -> MetricsServer:
    """Serve a publisher's counters on ``addr:port`` (``/healthz``: 200 while it runs)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PublisherMetrics(stream, counts))
    return MetricsServer(registry, lambda: Health(True, (), {"stream": stream}), port, addr)
