"""The package is an installable Airflow provider with a working console script."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import distribution, entry_points
from pathlib import Path

import airflow_nats_ordered


def test_provider_entry_point_resolves_to_provider_info():
    eps = [
        ep
        for ep in entry_points(group="apache_airflow_provider")
        if ep.value.startswith("airflow_nats_ordered")
    ]
    assert len(eps) == 1
    info = eps[0].load()()
    assert info["package-name"] == distribution("airflow-nats-ordered").metadata["Name"]
    assert info["versions"][0] == airflow_nats_ordered.__version__


def test_provider_info_matches_airflows_schema():
    import importlib.util

    import jsonschema

    # locate Airflow's schema without importing Airflow (seconds of start-up)
    airflow_dir = Path(importlib.util.find_spec("airflow").submodule_search_locations[0])
    schema = json.loads((airflow_dir / "provider_info.schema.json").read_text())
    jsonschema.validate(airflow_nats_ordered.get_provider_info(), schema)


def test_core_imports_neither_airflow_nor_spark():
    code = (
        "import sys, airflow_nats_ordered.core.publish.publisher,"
        " airflow_nats_ordered.core.stream.partitioned;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('airflow','pyspark')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_console_script_is_installed():
    scripts = [ep for ep in entry_points(group="console_scripts") if ep.name == "nats-ordered"]
    assert scripts and scripts[0].value == "airflow_nats_ordered.cli:main"
