"""Handlers for the worker processes that ``bench/worker_bench.py`` starts through the CLI.

``bench/`` is put on PYTHONPATH of those processes, so they are named e.g.
``bench_handlers:Recorder``. Everything here is deliberately cheap: the benchmark measures
the worker, not the handler.

``Recorder``  appends ``"<wall time> <member> <partition> <stream seq>\\n"`` per message to the
              file named by ``BENCH_APPLY_LOG`` (O_APPEND, one ``os.write`` per line, so lines
              of several processes never interleave); the member is ``BENCH_MEMBER`` or the pid
``Progress``  a no-op that counts messages and, every ``BENCH_PROGRESS_EVERY`` (default 5000),
              overwrites the file named by ``BENCH_PROGRESS`` with the count (for the memory run)
``noop``      does nothing
"""

from __future__ import annotations

import os
import time
from typing import Any


def noop(msg: Any) -> None:
    """Do nothing with one message."""


class Recorder:
    """Record when each message was applied, by whom (see the module docstring)."""

    def __init__(self) -> None:
        path = os.environ["BENCH_APPLY_LOG"]
        self.member = os.environ.get("BENCH_MEMBER") or str(os.getpid())
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, msg: Any) -> None:
        line = f"{time.time():.6f} {self.member} {msg.partition} {msg.stream_seq}\n"
        os.write(self.fd, line.encode())

    def close(self) -> None:
        os.close(self.fd)


class Progress:
    """Count messages; publish the count to a file now and then (see the module docstring)."""

    def __init__(self) -> None:
        self.path = os.environ["BENCH_PROGRESS"]
        self.every = int(os.environ.get("BENCH_PROGRESS_EVERY", "5000"))
        self.count = 0
        self._next = self.every

    def _write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{self.count} {time.time():.6f}\n")
        os.replace(tmp, self.path)  # readers never see a half-written count

    def __call__(self, msg: Any) -> None:
        self.count += 1
        if self.count >= self._next:
            self._next += self.every
            self._write()

    def close(self) -> None:
        self._write()
