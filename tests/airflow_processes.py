"""Real Airflow processes (``airflow db migrate``, ``dags reserialize``, ``triggerer``) on the
test session's throw-away ``AIRFLOW_HOME`` (set by conftest.py; SQLite metadata DB).

The database is migrated once per home (a marker file records it), so several tests and
test modules share the ~10-20 s it takes. A test that runs triggerers takes a
:func:`private_home` instead: a triggerer runs every asset trigger in its database, so
triggers other tests left registered would take its capacity (and it would take theirs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def airflow_home() -> Path:
    return Path(os.environ["AIRFLOW_HOME"])


def metadata_db() -> Path:
    """The SQLite metadata database, migrated (once per AIRFLOW_HOME)."""
    home = airflow_home()
    marker = home / ".nats-ordered-db-migrated"
    if not marker.exists():
        airflow("db", "migrate", timeout=240)
        marker.touch()
    return home / "airflow.db"


def private_home(path: Path) -> tuple[dict[str, str], Path]:
    """``(env, db)`` for Airflow processes on their own home and metadata DB under ``path``.

    The DB is a copy of an empty migrated one made once per session (one extra
    migration, then a file copy per test): nothing another test registered is in it."""
    pristine = airflow_home() / "pristine"
    marker = pristine / ".nats-ordered-db-migrated"
    if not marker.exists():
        pristine.mkdir(exist_ok=True)
        airflow("db", "migrate", env=_home_env(pristine), timeout=240)
        marker.touch()
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pristine / "airflow.db", path / "airflow.db")
    return _home_env(path), path / "airflow.db"


def _home_env(home: Path) -> dict[str, str]:
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
    }


def airflow_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "PYTHONUNBUFFERED": "1",
            # a killed triggerer's triggers go to the next one after 6 s, not 30. At 3 s a
            # live triggerer's heartbeat (SQLite, three triggerers) was now and then taken
            # for stale on a quiet machine, and the watcher's trigger bounced between live
            # triggerers ("Trigger cancelled by user action" over and over): the kill test
            # failed 3 of 6 runs that way, and passed 3 of 3 at 6 s
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "6",
        }
    )
    env.update(extra or {})
    return env


def airflow(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run an ``airflow`` command; AssertionError with its output if it fails."""
    r = subprocess.run(
        [AIRFLOW, *args], env=airflow_env(env), capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, (
        f"airflow {' '.join(args)} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    )
    return r


def query(db: Path, sql: str, *params: Any) -> list[tuple]:
    """Read the metadata DB while Airflow processes write it."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


class Triggerer:
    """One ``airflow triggerer`` in its own process group (supervisor, trigger runner).

    ``kill()`` is a crash: SIGKILL to the whole group, nothing gets to clean up.
    """

    def __init__(self, log_path: Path, env: Mapping[str, str]) -> None:
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Triggerer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [AIRFLOW, "triggerer", "--skip-serve-logs"],
                env=airflow_env(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def signal_main(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the ``airflow triggerer`` process only, as ``kill <its pid>``
        does: after a SIGKILL its trigger runner child lives on, orphaned, until it
        notices; on SIGTERM the triggerer stops the runner itself."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait_gone(self, timeout: float = 60) -> bool:
        """Wait until no process of the triggerer's group is left; False at the deadline."""
        if self.proc is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.group_pids():
                return True
            time.sleep(0.1)
        return False

    def group_pids(self) -> list[int]:
        """Live (not zombie) processes of the triggerer's process group."""
        if self.proc is None:
            return []
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:
                continue  # exited meanwhile
            if fields[0] != "Z" and int(fields[2]) == self.proc.pid:
                out.append(int(stat.parent.name))
        return out

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM (graceful shutdown), SIGKILL after ``timeout``; also kills leftovers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the runner child, if still there
        self.proc.wait(10)
