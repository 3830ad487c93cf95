"""The Node.js client of tests/js (the official nats.js client, written from docs/protocol.md
alone): the ``node`` fixture installs its pinned packages once, :func:`run_node` runs one of
its scripts."""

from __future__ import annotations

import fcntl
import shutil
import subprocess

import pytest
from locations import TESTS

JS = TESTS / "js"


@pytest.fixture(scope="session")
def node() -> str:
    """The node executable, with tests/js's pinned packages installed."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail(
            "Node.js >= 20 and npm are required by tests/e2e/test_foreign_client.py (the foreign "
            "client of docs/protocol.md is JavaScript): install them (Debian: `apt-get install "
            "nodejs npm`) and run the tests again"
        )
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    if int(version.strip().lstrip("v").split(".")[0]) < 20:
        pytest.fail(f"Node.js >= 20 is required by tests/js, found {version.strip()}")
    # one install for all pytest-xdist workers: each has its own session, and two `npm ci`
    # at once in one folder remove each other's files (ENOTEMPTY/ENOENT, seen in a CI run)
    with open(JS / ".npm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (JS / "node_modules" / ".package-lock.json").exists():
            done = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=JS,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                pytest.fail(
                    f"`npm ci` in {JS} failed (exit {done.returncode}); the npm registry must "
                    "be reachable once to install tests/js/package-lock.json:\n"
                    f"{done.stderr[-2000:]}"
                )
    return node


def run_node(node: str, script: str, *args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [node, script, *args], cwd=JS, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"node {script} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout
