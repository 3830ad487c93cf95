"""The provider info lists every module that holds an operator, sensor or trigger, so
Airflow's providers manager and docs tooling see all of them (the Spark publish operator
was missing from ``operators``)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger

from airflow_nats_ordered import get_provider_info


def _listed(kind: str) -> set[str]:
    return {m for entry in get_provider_info()[kind] for m in entry["python-modules"]}


def _modules_defining(package: str, base: type) -> set[str]:
    pkg = importlib.import_module(f"airflow_nats_ordered.{package}")
    found = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            mine = issubclass(obj, base) and obj.__module__ == mod.__name__
            if mine and not obj.__name__.startswith("_") and not inspect.isabstract(obj):
                found.add(mod.__name__)
    return found


def test_every_operator_sensor_and_trigger_module_is_listed():
    operators = _modules_defining("operators", BaseOperator)
    assert "airflow_nats_ordered.operators.spark" in operators
    assert operators <= _listed("operators"), operators - _listed("operators")
    sensors = _modules_defining("sensors", BaseOperator)
    assert sensors and sensors <= _listed("sensors"), sensors - _listed("sensors")
    triggers = _modules_defining("triggers", BaseTrigger)
    assert triggers and triggers <= _listed("triggers"), triggers - _listed("triggers")


def test_the_provider_info_is_valid_and_every_dotted_path_in_it_imports():
    """Checked against Airflow's own provider-info schema; each ``asset-uris`` handler and
    ``to_openlineage_converter``, hook class and queue provider names something callable
    (Airflow skips a wrong path with only a log line)."""
    import json
    from pathlib import Path

    import airflow
    import jsonschema

    info = get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    paths = [e[k] for e in info["asset-uris"] for k in ("handler", "to_openlineage_converter")]
    paths += [c["hook-class-name"] for c in info["connection-types"]] + info["queues"]
    assert len(paths) == 4
    for path in paths:
        module, _, name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), path
