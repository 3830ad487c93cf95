"""Embedded nats-server: real server processes for development, the demo, benchmarks and tests.

:class:`NatsServer` runs one JetStream-enabled server on free loopback ports with
its own store directory; :class:`NatsCluster` runs ``n`` of them routed into one
cluster. Both write their config into the store directory, send the server's
output to a log file there, and only return from ``start()`` once the server
answers ``/healthz`` on its HTTP monitoring port (and, for a cluster, once a
JetStream meta leader exists). A failed start raises :class:`NatsServerError`
with the tail of the server log.

Finding the binary, free ports and the net that keeps server processes from outliving the
interpreter live in :mod:`.process`. Processes never outlive the Python process that
started them: ``stop()`` runs from ``__exit__``, and an ``atexit`` hook kills whatever is
still running at exit (:mod:`.process`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from airflow_nats_ordered.embedded.process import (
    _LIVE,
    _LIVE_LOCK,
    _die_with_parent_fn,
    _http_get_json,
    _run_coro_sync,
    _wait_stopped,
    find_nats_server,
    free_port,
)

__all__ = [
    "ClusterSpec",
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
]


class NatsServerError(RuntimeError):
    """A test nats-server could not be started or did not become ready.

    ``port_clash`` is True when the server exited because a port was already taken.
    """

    def __init__(self, message: str, *, port_clash: bool = False) -> None:
        super().__init__(message)
        self.port_clash = port_clash


@dataclass(frozen=True)
class ClusterSpec:
    """The ``cluster {}`` block of one server: cluster name, its route port, and peers' ports."""

    name: str
    port: int
    route_ports: tuple[int, ...]

    def render(self) -> str:
        """Return the config text of the cluster block."""
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.route_ports)
        return (
            "cluster {\n"
            f"  name: {self.name}\n"
            f"  listen: 127.0.0.1:{self.port}\n"
            f"  routes: [{routes}]\n"
            "  connect_retries: 120\n"
            "}\n"
        )


class NatsServer:
    """One real JetStream ``nats-server`` process on loopback ports, for tests.

    Guarantees:

    * ``start()`` returns only when ``/healthz`` on the monitoring port reports ok
      and JetStream is enabled (unless ``jetstream=False``), else raises
      :class:`NatsServerError` with the tail of the log (and leaves no process).
    * ``restart()`` reuses the same client/monitor/cluster ports and store dir, so
      JetStream data written before a ``stop()`` or ``kill()`` is still there.
    * the process never outlives the interpreter (``__exit__`` and an atexit hook).

    Args:
        store_dir: JetStream store directory; config and log file live here too.
        port: fixed client port; default picks a free loopback port.
        extra_config: config text appended verbatim (auth, TLS, accounts blocks).
        sync_always: set JetStream ``sync_interval: always`` (fsync every write).
        name: server name (``server_name``), shown in stream cluster info.
        cluster: optional cluster block (see :class:`ClusterSpec`).
        jetstream: enable JetStream (default True).
        monitor_port: fixed HTTP monitoring port; default picks a free loopback port.
        ready_timeout: seconds ``start()`` waits for readiness.
    """

    def __init__(
        self,
        store_dir: Path,
        port: int | None = None,
        extra_config: str = "",
        *,
        sync_always: bool = False,
        name: str | None = None,
        cluster: ClusterSpec | None = None,
        jetstream: bool = True,
        monitor_port: int | None = None,
        ready_timeout: float = 20.0,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._fixed_ports = port is not None
        self._port = port if port is not None else free_port()
        self._monitor_port = monitor_port if monitor_port is not None else free_port()
        self.extra_config = extra_config
        self.sync_always = sync_always
        self._name = name or f"srv-{uuid.uuid4().hex[:8]}"
        self.cluster = cluster
        self.jetstream = jetstream
        self.ready_timeout = ready_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    # ------------------------------------------------------------------ properties
    @property
    def port(self) -> int:
        """The client port (stable across restarts)."""
        return self._port

    @property
    def monitor_port(self) -> int:
        """The HTTP monitoring port (stable across restarts)."""
        return self._monitor_port

    @property
    def url(self) -> str:
        """Client URL, ``nats://127.0.0.1:PORT``."""
        return f"nats://127.0.0.1:{self._port}"

    @property
    def monitor_url(self) -> str:
        """Base URL of the HTTP monitoring endpoint, ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self._monitor_port}"

    @property
    def name(self) -> str:
        """The configured ``server_name``."""
        return self._name

    @property
    def pid(self) -> int | None:
        """PID of the running process, or None when not running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        """True while the process exists (it may be paused)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def config_path(self) -> Path:
        """Path of the generated config file."""
        return self.store_dir / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        """Path of the log file receiving the server's stdout and stderr (appended on restart)."""
        return self.store_dir / "nats-server.log"

    @property
    def jetstream_dir(self) -> Path:
        """The JetStream ``store_dir`` inside the store directory."""
        return self.store_dir / "jetstream"

    # ------------------------------------------------------------------ config
    def render_config(self) -> str:
        """Return the full config file text for the current settings."""
        lines = [
            f"server_name: {self._name}",
            f"listen: 127.0.0.1:{self._port}",
            f"http: 127.0.0.1:{self._monitor_port}",
        ]
        text = "\n".join(lines) + "\n"
        if self.jetstream:
            text += "jetstream {\n"
            text += f"  store_dir: {json.dumps(str(self.jetstream_dir))}\n"
            if self.sync_always:
                text += "  sync_interval: always\n"
            text += "}\n"
        if self.cluster is not None:
            text += self.cluster.render()
        if self.extra_config:
            text += self.extra_config.rstrip() + "\n"
        return text

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, wait: bool = True) -> Self:
        """Start the process; with ``wait`` (default) block until ready.

        If the server dies with "address already in use" and the ports were picked
        automatically, new free ports are picked and the start is retried.
        """
        if self.running:
            raise NatsServerError(f"nats-server {self._name} is already running (pid {self.pid})")
        attempts = 1 if (self._fixed_ports or self.cluster is not None) else 4
        for attempt in range(attempts):
            self._spawn()
            if not wait:
                return self
            try:
                self.wait_ready()
                return self
            except NatsServerError as exc:
                if exc.port_clash and attempt + 1 < attempts:
                    self._port = free_port()
                    self._monitor_port = free_port()
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self) -> None:
        binary = find_nats_server()
        self.config_path.write_text(self.render_config())
        with self.log_path.open("ab") as log:
            log.write(
                f"\n==== starting {self._name} at {time.strftime('%H:%M:%S')} ====\n".encode()
            )
            log.flush()
            proc = subprocess.Popen(
                [str(binary), "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.store_dir,
                preexec_fn=_die_with_parent_fn(),
            )
        self._proc = proc
        self._paused = False
        with _LIVE_LOCK:
            _LIVE.add(proc)

    def log_tail(self, lines: int = 30) -> str:
        """Return the last ``lines`` lines of the server log (empty if none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _current_run_log(self) -> str:
        """Log text written since the latest start."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text.rsplit("==== starting", 1)[-1]

    def _fail(self, reason: str) -> NatsServerError:
        exited = self._proc is not None and self._proc.poll() is not None
        self._terminate(signal.SIGKILL)
        clash = exited and "address already in use" in self._current_run_log()
        return NatsServerError(
            f"nats-server {self._name} ({self.url}) {reason}"
            f"{' (process exited)' if exited else ''}; config {self.config_path}; "
            f"log tail:\n{self.log_tail()}",
            port_clash=clash,
        )

    def health(self) -> tuple[bool, str]:
        """Return (ready, detail): ``/healthz`` ok and, if enabled, JetStream enabled."""
        try:
            status, body = _http_get_json(f"{self.monitor_url}/healthz", timeout=1.0)
        except OSError as exc:
            return False, f"monitor not reachable: {exc}"
        if status != 200:
            return False, f"/healthz {status}: {body}"
        if self.jetstream:
            try:
                status, jsz = _http_get_json(f"{self.monitor_url}/jsz", timeout=1.0)
            except OSError as exc:
                return False, f"/jsz not reachable: {exc}"
            if status != 200 or not isinstance(jsz, dict) or jsz.get("disabled"):
                return False, f"JetStream not enabled: /jsz {status}: {jsz}"
        return True, "ok"

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until :meth:`health` is ok; raise :class:`NatsServerError` otherwise."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.ready_timeout)
        detail = "not started"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                clash = "address already in use" in self._current_run_log()
                raise self._fail(
                    f"{'address already in use' if clash else 'exited'} during startup"
                )
            ok, detail = self.health()
            if ok:
                return
            time.sleep(0.05)
        raise self._fail(f"not ready after {timeout or self.ready_timeout:.1f}s ({detail})")

    def _terminate(self, sig: signal.Signals, timeout: float = 15.0) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                if self._paused:
                    proc.send_signal(signal.SIGCONT)
                proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._paused = False
        with _LIVE_LOCK:
            _LIVE.discard(proc)

    def stop(self) -> None:
        """Graceful stop: SIGTERM and wait (SIGKILL after 15 s). No-op when not running."""
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """Hard crash: SIGKILL and wait. Unsynced JetStream writes may be lost."""
        self._terminate(signal.SIGKILL)

    def restart(self, *, wait: bool = True, hard: bool = False) -> Self:
        """Stop (``hard``: SIGKILL) if running and start again on the same ports and store."""
        if hard:
            self.kill()
        else:
            self.stop()
        return self.start(wait=wait)

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): clients see a hung server, not a closed socket."""
        if self._proc is None or self._proc.poll() is not None:
            raise NatsServerError(f"nats-server {self._name} is not running; cannot pause")
        self._proc.send_signal(signal.SIGSTOP)
        self._paused = True
        _wait_stopped(self._proc.pid)

    def resume(self) -> None:
        """Unfreeze a paused process (SIGCONT)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "paused" if self._paused else ("running" if self.running else "stopped")
        return f"NatsServer(name={self._name!r}, url={self.url!r}, {state})"


class NatsCluster:
    """``n`` routed JetStream servers (default 3) on loopback, each with its own store dir.

    Guarantees: ``start()`` returns only when every server is healthy and a JetStream
    meta leader is elected; ``restart(i)`` keeps server ``i``'s ports, name and store;
    ``stop()`` (also on ``__exit__``) stops every process.
    """

    def __init__(
        self,
        base_dir: Path,
        n: int = 3,
        *,
        sync_always: bool = False,
        extra_config: str = "",
        ready_timeout: float = 30.0,
    ) -> None:
        if n < 1:
            raise ValueError("a cluster needs at least one server")
        self.base_dir = Path(base_dir)
        self.n = n
        self.sync_always = sync_always
        self.extra_config = extra_config
        self.ready_timeout = ready_timeout
        self.cluster_name = f"C{uuid.uuid4().hex[:6]}"
        self.servers: list[NatsServer] = []
        self._build()

    def _build(self) -> None:
        route_ports = [free_port() for _ in range(self.n)]
        self.servers = [
            NatsServer(
                self.base_dir / f"n{i}",
                port=free_port(),
                monitor_port=free_port(),
                extra_config=self.extra_config,
                sync_always=self.sync_always,
                name=f"n{i}",
                cluster=ClusterSpec(
                    name=self.cluster_name,
                    port=route_ports[i],
                    route_ports=tuple(p for j, p in enumerate(route_ports) if j != i),
                ),
                ready_timeout=self.ready_timeout,
            )
            for i in range(self.n)
        ]

    @property
    def urls(self) -> list[str]:
        """Client URLs of all servers, in index order."""
        return [s.url for s in self.servers]

    def start(self) -> Self:
        """Start all servers and wait for health plus a meta leader (retries on port clash)."""
        for attempt in range(3):
            for server in self.servers:
                server.start(wait=False)
            try:
                self.wait_ready()
                return self
            except NatsServerError as exc:
                self.stop()
                if exc.port_clash and attempt < 2:
                    self._build()
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every running server is healthy and a meta leader is known."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.ready_timeout)
        for server in self.servers:
            if server.running:
                server.wait_ready(timeout=max(0.1, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            if self.meta_leader() is not None:
                return
            time.sleep(0.05)
        raise NatsServerError(
            f"cluster {self.cluster_name}: no JetStream meta leader after "
            f"{timeout or self.ready_timeout:.1f}s; logs in {self.base_dir}"
        )

    def meta_leader(self) -> str | None:
        """Name of the JetStream meta leader as seen by a running server, or None."""
        for server in self.servers:
            if not server.running or server._paused:
                continue
            try:
                status, jsz = _http_get_json(f"{server.monitor_url}/jsz", timeout=1.0)
            except OSError:
                continue
            if status == 200 and isinstance(jsz, dict):
                leader = (jsz.get("meta_cluster") or {}).get("leader")
                if leader:
                    return str(leader)
        return None

    def server_index_by_name(self, name: str) -> int:
        """Index of the server whose ``server_name`` is ``name``; KeyError if none."""
        for i, server in enumerate(self.servers):
            if server.name == name:
                return i
        raise KeyError(f"no server named {name!r} in cluster {self.cluster_name}")

    def kill(self, i: int) -> None:
        """SIGKILL server ``i``."""
        self.servers[i].kill()

    def stop_server(self, i: int) -> None:
        """Gracefully stop server ``i``."""
        self.servers[i].stop()

    def restart(self, i: int, *, wait: bool = True) -> None:
        """(Re)start server ``i`` on its old ports and store; waits until it is healthy."""
        server = self.servers[i]
        server.stop()
        server.start(wait=wait)

    def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL on timeout)."""
        for server in self.servers:
            server.stop()

    async def stream_info_async(self, stream: str, timeout: float = 5.0) -> dict[str, Any]:
        """Return ``$JS.API.STREAM.INFO.<stream>`` as a dict, asked via any live server.

        Retries until ``timeout`` while the stream has no leader yet (e.g. mid-election).
        """
        import nats  # local import keeps this module importable without nats-py

        urls = [s.url for s in self.servers if s.running and not s._paused]
        if not urls:
            raise NatsServerError(f"cluster {self.cluster_name}: no running server")
        nc = await nats.connect(
            urls,
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=2,
            reconnect_time_wait=0.1,
        )
        try:
            deadline = time.monotonic() + timeout
            last: Any = None
            while True:
                try:
                    msg = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=1.0)
                    last = json.loads(msg.data)
                    if "error" not in last and (last.get("cluster") or {}).get("leader"):
                        return dict(last)
                except Exception as exc:  # noqa: BLE001 - retried until deadline
                    last = repr(exc)
                if time.monotonic() >= deadline:
                    raise NatsServerError(f"stream {stream!r}: no leader within {timeout}s: {last}")
                await asyncio.sleep(0.1)
        finally:
            await nc.close()

    def stream_leader(self, stream: str, timeout: float = 5.0) -> int:
        """Index of the server that currently leads ``stream`` (reads ``cluster.leader``).

        Usable from sync code and from inside a running event loop (runs in a thread).
        """
        info = _run_coro_sync(lambda: self.stream_info_async(stream, timeout))
        return self.server_index_by_name(info["cluster"]["leader"])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"NatsCluster(name={self.cluster_name!r}, urls={self.urls!r})"


def _main(argv: Sequence[str]) -> None:  # pragma: no cover - manual smoke test
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if argv and argv[0] == "cluster":
            t0 = time.monotonic()
            with NatsCluster(Path(tmp)) as cluster:
                print(cluster, f"ready in {time.monotonic() - t0:.2f}s")
        else:
            t0 = time.monotonic()
            with NatsServer(Path(tmp)) as server:
                print(server, f"ready in {time.monotonic() - t0:.2f}s")


if __name__ == "__main__":  # pragma: no cover
    _main(sys.argv[1:])
