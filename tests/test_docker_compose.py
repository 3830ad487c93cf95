"""docker-compose.yml cannot be started here (no Docker engine), so keep it honest:
every command, file and port it references must exist in this project, and the nats
service's command must boot the real nats-server binary."""

from __future__ import annotations

import contextlib
import subprocess
import tomllib
import urllib.request
from pathlib import Path

import yaml

from airflow_nats_ordered.cli import main as cli_main
from airflow_nats_ordered.embedded import find_nats_server, free_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def test_project_services_run_declared_console_scripts_and_real_subcommands(capsys):
    scripts = _scripts()
    for name, svc in SERVICES.items():
        if "build" not in svc:
            continue
        cmd = svc["command"]
        assert cmd[0] in scripts, f"service {name} runs {cmd[0]}, not a console script"
        # the subcommand and every flag must parse: run it with --help appended after them
        try:
            code = cli_main([cmd[1], "--help"])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 0, f"service {name}: `{cmd[0]} {cmd[1]} --help` exited {code}"
        helptext = capsys.readouterr().out
        for arg in cmd[2:]:
            if arg.startswith("--"):
                assert arg in helptext, f"service {name}: {cmd[1]} has no flag {arg}"


def test_referenced_files_exist():
    for name, svc in SERVICES.items():
        if "build" in svc:
            build = svc["build"]
            ctx = ROOT / (build if isinstance(build, str) else build["context"])
            dockerfile = ctx / "Dockerfile"
            assert dockerfile.is_file(), f"service {name}: {dockerfile} is missing"
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert (ctx / src).exists(), f"Dockerfile copies missing {src}"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"service {name}: volume source {src} is missing"
            else:
                assert src in COMPOSE.get("volumes", {}), f"named volume {src} is not declared"


def test_ports_and_urls_agree():
    nats = SERVICES["nats"]
    published = {p.split(":")[1] for p in nats["ports"]}
    assert "4222" in published  # the client port every default URL uses
    cmd = nats["command"]
    assert cmd[cmd.index("--http_port") + 1] in published
    for name, svc in SERVICES.items():
        url = (svc.get("environment") or {}).get("NATS_URL")
        if url:
            host, port = url.removeprefix("nats://").split(":")
            assert host in SERVICES and port in published, f"service {name}: {url}"
            assert "nats" in svc.get("depends_on", {}), f"service {name} must wait for nats"


def test_nats_service_command_boots_the_real_server(tmp_path):
    """The exact flags of the nats service, with the store and ports moved to this machine."""
    cmd = list(SERVICES["nats"]["command"])
    cmd[cmd.index("--store_dir") + 1] = str(tmp_path)
    http = free_port()
    cmd[cmd.index("--http_port") + 1] = str(http)
    proc = subprocess.Popen(
        [str(find_nats_server()), *cmd, "--port", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        import time

        deadline = time.monotonic() + 15
        body = b""
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{http}/healthz?js-enabled-only=true"
                body = urllib.request.urlopen(url, timeout=1).read()
                break
            time.sleep(0.1)
        assert b"ok" in body, proc.stderr.read1(4096) if proc.poll() is not None else body
    finally:
        proc.terminate()
        proc.wait(10)
