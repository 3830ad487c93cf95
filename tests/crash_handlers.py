"""Handlers of the crash-tail test's worker process (imported via PYTHONPATH=tests).

``KillAfter`` is a synchronous handler that records every message it applies (one
``"<partition> <stream seq>"`` line per message, appended to the file named by
``CRASH_APPLY_LOG`` with one ``os.write``) and, at the first message by which it has
applied ``CRASH_AFTER`` messages in all and ``CRASH_EACH`` of each of ``CRASH_PARTITIONS``
partitions (so every partition is busy), holds the event loop for ``CRASH_HOLD`` seconds (as
a slow synchronous sink write does: nothing the member has not yet put on the wire is sent
meanwhile) and then SIGKILLs its own process.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any


class KillAfter:
    """Record each apply; die by SIGKILL once busy enough (see the module docstring)."""

    def __init__(self) -> None:
        self.fd = os.open(os.environ["CRASH_APPLY_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self.after = int(os.environ["CRASH_AFTER"])
        self.each = int(os.environ.get("CRASH_EACH", "0"))
        self.partitions = int(os.environ.get("CRASH_PARTITIONS", "1"))
        self.hold = float(os.environ.get("CRASH_HOLD", "1.0"))
        self.count = 0
        self.per_partition: dict[int, int] = {}

    def __call__(self, msg: Any) -> None:
        os.write(self.fd, f"{msg.partition} {msg.stream_seq}\n".encode())
        self.count += 1
        self.per_partition[msg.partition] = self.per_partition.get(msg.partition, 0) + 1
        busy = sum(1 for n in self.per_partition.values() if n >= self.each)
        if self.count >= self.after and busy >= self.partitions:
            time.sleep(self.hold)
            os.kill(os.getpid(), signal.SIGKILL)
