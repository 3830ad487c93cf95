"""Reading a member's ``--metrics-port`` endpoints: ``/metrics`` samples and ``/healthz``."""

from __future__ import annotations

import random
import socket
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def get(url: str) -> tuple[int, str]:
    # generous: with NATS paused a scrape waits up to the member's scrape_timeout (5 s) for the
    # group view before serving the rest, so a 5 s client timeout raced it on a loaded machine
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    status, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def sample(samples, name: str, **labels: str) -> float | None:
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= set(lab)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def free_ports_in_a_row(n: int) -> int:
    """The first of ``n`` consecutive ports on 127.0.0.1 that were free a moment ago, below
    the kernel's ephemeral range. The pool gives its members the ports after its own
    (``--metrics-port P``: members P+1..); a port the kernel handed out (``free_port``) lies
    in that range, and the ports next to it can be any client socket's a moment later (a
    fresh-clone run failed: "cannot listen on 127.0.0.1:<P+1> (Address already in use)")."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for _ in range(200):
        base = random.randrange(20000, low - n)
        try:
            with ExitStack() as held:
                for port in range(base, base + n):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free ports in a row between 20000 and {low}")
