"""`--metrics-addr` listens on 127.0.0.1 unless asked (issue 15 item 11): metrics and
/healthz of a worker or pool are not offered to the whole network by default."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from locations import TESTS

from airflow_nats_ordered.cli import build_parser
from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.embedded.process import free_port


def _pythonpath() -> str:
    """The tests' helpers, after whatever PYTHONPATH the run was given (a checkout to test:
    members started elsewhere than the checkout must import it, not the installed one)."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(TESTS)) if p)


def _free_elsewhere(port: int) -> bool:
    """Whether another loopback address can bind ``port``: True when the listener holds
    127.0.0.1 only, False when it holds every interface (0.0.0.0)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.2", port))
        return True
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return False
        raise
    finally:
        s.close()


@pytest.mark.parametrize("command", ["worker", "pool"])
def test_the_default_metrics_address_is_localhost(command):
    extra = ["--size", "1"] if command == "pool" else []
    args = build_parser().parse_args(
        [command, *extra, "--stream", "S", "--group", "g", "--handler", "m:f"]
    )
    assert args.metrics_addr == "127.0.0.1"


def test_a_worker_serves_metrics_on_localhost_only_unless_asked(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    capsys.readouterr()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_nats_ordered.cli", "worker", "--stream", unique_name]
        + ["--group", "g", "--handler", "chaos_handlers:ignore", "--lease-ttl", "2"]
        + ["--metrics-port", str(port), "--server", url],
        env=dict(os.environ, PYTHONPATH=_pythonpath()),
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "".join(lines)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < end, "".join(lines)
                time.sleep(0.1)
        assert _free_elsewhere(port), "the metrics endpoint listens on every interface"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        reader.join(10)
    assert code == 0, "".join(lines)


def test_compose_asks_for_every_interface_explicitly():
    compose = (TESTS.parent / "docker-compose.yml").read_text()
    pool_line = next(line for line in compose.splitlines() if '"pool"' in line)
    assert '"--metrics-addr", "0.0.0.0"' in pool_line
