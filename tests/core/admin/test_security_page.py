"""docs/security.md says what the code does (issue 31): each role's table lists exactly the
subjects ``permissions_for`` gives the role, and the locked-down server config it shows,
filled in with the generated user entries and real certificate files, is a config
nats-server accepts (``nats-server -t``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from authfixtures import make_pki
from locations import ROOT

from airflow_nats_ordered.core import ROLES, permissions_for
from airflow_nats_ordered.embedded.process import find_nats_server

PAGE = ROOT / "docs" / "security.md"
GROUP_OF = {"publisher": None, "worker": "billing", "reader": "billing", "watcher": "billing"}


def _section(text: str, role: str) -> str:
    m = re.search(rf"^### {role}\n(.*?)(?=^##)", text, re.S | re.M)
    assert m, f"{PAGE} has no section '### {role}'"
    return m.group(1)


def _table_subjects(section: str) -> set[str]:
    found: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        found.update(re.findall(r"`([^`]+)`", first))
    return found


@pytest.mark.parametrize("role", ROLES)
def test_each_role_s_table_lists_exactly_its_subjects(role: str) -> None:
    perms = permissions_for(role, "ORDERS", GROUP_OF.get(role, "billing"))
    listed = _table_subjects(_section(PAGE.read_text(), role))
    assert listed == set(perms.publish_allow), (
        f"in the page, not given: {sorted(listed - set(perms.publish_allow))}; "
        f"given, not in the page: {sorted(set(perms.publish_allow) - listed)}"
    )
    assert perms.subscribe_allow == ("_INBOX.>",)


def test_the_sample_server_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    text = PAGE.read_text()
    m = re.search(r"```\n(server_name: nats-1\n.*?)```", text, re.S)
    assert m, "the locked-down config block is missing"
    config = m.group(1)
    pki = make_pki(tmp_path / "pki")
    for name, path in (
        ("/etc/nats/tls/server.pem", pki.server_cert),
        ("/etc/nats/tls/server-key.pem", pki.server_key),
        ("/etc/nats/tls/ca.pem", pki.ca_cert),
        ("/var/lib/nats/jetstream", tmp_path / "js"),
    ):
        assert name in config, name
        config = config.replace(name, str(path))
    config = config.replace("0.0.0.0:4222", "127.0.0.1:-1")
    entries = {
        account: "\n".join(
            permissions_for(role, "ORDERS", group).to_conf(f"{account[-1].lower()}-{role}")
            for role, group in (
                ("operator", "billing"),
                ("publisher", None),
                ("worker", "billing"),
                ("watcher", "billing"),
            )
        )
        for account in ("TEAM_A", "TEAM_B")
    }
    for account, entry in entries.items():
        config = re.sub(
            rf"(  {account} {{\n    jetstream: enabled\n    users = \[\n)",
            lambda mm, e=entry: mm.group(1) + e + "\n",
            config,
        )
    assert config.count("# role worker of stream ORDERS") == 2
    path = tmp_path / "nats-server.conf"
    path.write_text(config)
    env = {
        "OPS_PASSWORD": "x",
        **{
            f"{a}_{r.upper()}_PASSWORD": "x"
            for a in ("A", "B")
            for r in ("operator", "publisher", "worker", "watcher")
        },
    }
    done = subprocess.run(
        [str(find_nats_server()), "-t", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr + config
