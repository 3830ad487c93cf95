"""What happened in one exploration: every operation and fault, with times and outcomes.

The history is the explorer's only record: the checker reads it (with the stream and the
sink at the end), and a failure prints it so that a reader sees what led to a violation.
Times are seconds since the start of the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Command:
    """One operation run as a process (or a fault's target): what, when, how it ended.

    ``deadline`` is the time (since the start) by which it must have ended (None: a
    service, a worker or pool, that runs until stopped). ``outcome`` is ``exit <code>``,
    ``signal <n>``, ``killed by nemesis``, ``hung`` or ``running``."""

    id: int
    op: str
    argv: list[str]
    start: float
    deadline: float | None = None
    end: float | None = None
    exit_code: int | None = None
    outcome: str = "running"
    #: what the explorer knows about it: producer id, input, drain high-water mark, ...
    info: dict[str, Any] = field(default_factory=dict)
    #: parsed JSON of its stdout, when it printed one
    result: Any = None
    #: faults this command received (SIGKILL, SIGSTOP, ...) by the nemesis
    faults: list[str] = field(default_factory=list)
    #: the largest share of one CPU it used over a sampling window
    max_cpu: float = 0.0
    log: str = ""


@dataclass
class Event:
    """One line of the history: an operation's start or end, a fault, a phase."""

    t: float
    kind: str  # "start", "end", "fault", "phase", "note"
    text: str
    command: int | None = None


class History:
    """The ordered record of one run (see the module)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.t0 = time.monotonic()
        self.events: list[Event] = []
        self.commands: dict[int, Command] = {}
        self._next = 1

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def begin(self, op: str, argv: list[str], *, budget: float | None, **info: Any) -> Command:
        t = self.now()
        cmd = Command(
            self._next, op, argv, t, None if budget is None else t + budget, info=dict(info)
        )
        self._next += 1
        self.commands[cmd.id] = cmd
        detail = " ".join(f"{k}={v}" for k, v in info.items() if k in _SHOWN)
        self.events.append(Event(t, "start", f"{op} {detail}".strip(), cmd.id))
        return cmd

    def finish(self, cmd: Command, outcome: str, exit_code: int | None = None) -> None:
        cmd.end = self.now()
        cmd.outcome = outcome
        cmd.exit_code = exit_code
        self.events.append(Event(cmd.end, "end", f"{cmd.op}: {outcome}", cmd.id))

    def fault(self, text: str, command: Command | None = None) -> None:
        if command is not None:
            command.faults.append(text)
        self.events.append(Event(self.now(), "fault", text, command.id if command else None))

    def note(self, text: str, kind: str = "note") -> None:
        self.events.append(Event(self.now(), kind, text))

    def render(self, limit: int | None = None) -> str:
        """The history as text, one event a line (the last ``limit`` events)."""
        events = self.events if limit is None else self.events[-limit:]
        lines = []
        if limit is not None and len(self.events) > limit:
            lines.append(f"... {len(self.events) - limit} earlier events (see history.json)")
        for e in events:
            tag = f"#{e.command}" if e.command is not None else ""
            lines.append(f"{e.t:9.3f}  {e.kind:<6} {tag:<5} {e.text}")
        return "\n".join(lines)

    def save(self, path: Path) -> None:
        path.write_text(
            json.dumps(
                {
                    "seed": self.seed,
                    "events": [asdict(e) for e in self.events],
                    "commands": [asdict(c) for c in self.commands.values()],
                },
                indent=1,
                default=str,
            )
        )


_SHOWN = ("producer", "records", "partitions", "to", "members", "purge", "high_water", "epoch")
