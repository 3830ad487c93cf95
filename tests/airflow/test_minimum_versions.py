"""The provider's minimum versions are decided per feature and written down (issue 30 defect
5): docs/airflow.md's "Minimum Airflow versions" table and the ``airflow`` extra's pins in
pyproject.toml say the same, the installed packages meet them, and the features that set
the Airflow floor (3.3) are where the table says."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

from locations import ROOT
from packaging.requirements import Requirement
from packaging.version import Version

DOCS = ROOT / "docs" / "airflow.md"
#: the table's "minimum" cell -> the distribution it is about
PACKAGES = {
    "Airflow": "apache-airflow",
    "common-messaging": "apache-airflow-providers-common-messaging",
    "OpenLineage provider": "apache-airflow-providers-openlineage",
    "Spark provider": "apache-airflow-providers-apache-spark",
}


def _floors() -> dict[str, Version]:
    """The lowest version each pinned distribution allows (the ``airflow`` and ``dev``
    extras), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in (
        project["optional-dependencies"]["airflow"] + project["optional-dependencies"]["dev"]
    ):
        req = Requirement(line)
        lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
        if req.name in PACKAGES.values() and lows:
            floors[req.name] = max(lows)
    return floors


def _table() -> list[tuple[str, str, Version]]:
    """``(feature, package, minimum)`` of each row of the docs' table."""
    section = DOCS.read_text().split("## Minimum Airflow versions", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("feature", "---"):
            continue
        match = re.match(r"(.+?) (\d+\.\d+)\b", cells[2])
        assert match and match.group(1) in PACKAGES, f"unreadable minimum: {line}"
        rows.append((cells[0], PACKAGES[match.group(1)], Version(match.group(2))))
    return rows


def test_the_pins_are_the_highest_minimum_of_the_table() -> None:
    rows, floors = _table(), _floors()
    assert len(rows) >= 9
    needed: dict[str, Version] = {}
    for _, package, minimum in rows:
        needed[package] = max(needed.get(package, minimum), minimum)
    assert needed == floors, (needed, floors)
    assert floors["apache-airflow"] == Version("3.3")


def test_the_installed_packages_meet_the_pins() -> None:
    for package, floor in _floors().items():
        assert Version(version(package)) >= floor, package


def test_the_features_that_set_the_airflow_floor_are_in_the_installed_airflow() -> None:
    # the watcher's shared-stream ack mode and the reschedule-mode sensor's task state store
    from airflow.sdk.execution_time.context import NEVER_EXPIRE
    from airflow.triggers.shared_stream import AdvanceItem, SharedStreamProducer

    import airflow_nats_ordered.triggers.messages as messages

    assert messages.SharedStreamProducer is SharedStreamProducer
    assert AdvanceItem and NEVER_EXPIRE
