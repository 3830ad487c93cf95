"""`worker --handler mod:func` finds a module in the current directory, as `pool` (whose
members run under `python -m`) does (issue 15 item 9): the installed `nats-ordered` script,
unlike `python -m`, does not put the current directory on sys.path by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from airflow_nats_ordered.cli import main as cli

SCRIPT = Path(sys.executable).with_name("nats-ordered")


def test_worker_run_as_the_installed_script_finds_a_handler_module_in_the_current_directory(
    shared_nats_server, unique_name, tmp_path, capsys
):
    assert SCRIPT.exists(), f"the console script is installed beside {sys.executable}"
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    capsys.readouterr()
    here = tmp_path / "project"
    here.mkdir()
    module = f"cwd_handler_{unique_name.lower()}"
    (here / f"{module}.py").write_text("def apply(msg):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if os.environ.get("PYTHONPATH"):  # keep a checkout given on PYTHONPATH (old-code runs)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.Popen(
        [str(SCRIPT), "worker", "--stream", unique_name, "--group", "g"]
        + ["--handler", f"{module}:apply", "--lease-ttl", "2", "--server", url],
        cwd=here,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 60
        while not any("joined group g" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < end, "".join(lines)
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        reader.join(10)
    assert code == 0, "".join(lines)


def test_both_helps_say_where_the_handler_module_is_looked_up(capsys):
    for command in ("worker", "pool"):
        assert cli([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "looked up in the current directory first" in text, command
