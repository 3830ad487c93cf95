"""SIGTERM while a member (``worker``, ``pool``, ``global-read``) is still starting: leave
with exit 0.

A member documents "SIGTERM: leave gracefully, exit 0". Its graceful-leave handlers are
installed by the event loop once it runs; before that (its imports, its connection, the
pool's checks: seconds on a loaded machine, or while a server restarts) SIGTERM took
Python's default action and the process died by SIGTERM (-15, 143 in a shell), which a
pool or a supervisor reports as a failure. Until then a member has joined nothing and holds
no lease, and a global-order reader has handed nothing over (it may have taken the group's
position with a new fencing token, which its next reader's supersedes; the position itself
is unchanged), so leaving gracefully is just exiting 0: :func:`guard` installs a handler
that does that, replaced by the member's own handlers when it starts running.

This module imports only the standard library, so the command's package can install the
guard before its heavy imports (``airflow_nats_ordered.cli`` does, first thing, when its
process is the ``nats-ordered worker|pool|global-read`` program).
"""

from __future__ import annotations

import contextlib
import os
import signal

#: the commands whose SIGTERM means "leave gracefully, exit 0"
MEMBER_COMMANDS = frozenset({"worker", "pool", "global-read"})


def _leave_before_joining(sig: int, _frame: object = None) -> None:
    with contextlib.suppress(OSError):  # fd 2 directly: no lock an interrupted print holds
        os.write(
            2, b"SIGTERM while starting: left before joining or reading (nothing handled), exit 0\n"
        )
    os._exit(0)


def guard() -> None:
    """From now until the member installs its own handlers: SIGTERM exits 0 at once."""
    with contextlib.suppress(ValueError, OSError):  # not the main thread: nothing to guard
        signal.signal(signal.SIGTERM, _leave_before_joining)


def is_member_program(argv: list[str]) -> bool:
    """Whether this process is ``nats-ordered worker|pool|global-read`` (the console script, or
    ``python -m airflow_nats_ordered.cli``, whose ``argv[0]`` is ``-m`` while the package
    is imported), not a program that merely imports the CLI."""
    if len(argv) < 2 or argv[1] not in MEMBER_COMMANDS:
        return False
    program = os.path.basename(argv[0])
    return argv[0] == "-m" or program in ("nats-ordered", "__main__.py")
