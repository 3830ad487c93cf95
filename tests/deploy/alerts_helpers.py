"""Shared by the tests of deploy/prometheus and deploy/grafana: the Debian tools (promtool,
prometheus), the rules and dashboard expressions, the metric names a PromQL expression
reads, and a real `nats-ordered pool` with its metrics port."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from locations import ROOT, TESTS

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "nats-ordered-alerts.yml"
RULES_TEST = PROMETHEUS_DIR / "nats-ordered-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "nats-ordered-pool.json"
APT_LINE = "apt-get install -y --no-install-recommends prometheus"


def tool(name: str) -> str:
    """The path of a Debian `prometheus` package tool; skipped with the reason when missing on a
    developer's machine, FAILED under CI=true (CI installs it)."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed (Debian package `prometheus`: {APT_LINE})"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


# -- expressions --------------------------------------------------------------------------


def rules() -> list[dict[str, Any]]:
    """Every rule of the rules file."""
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])  # inside a collapsed row


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard's panels (targets' ``expr``)."""
    return [t["expr"] for p in dashboard_panels(dash) for t in p.get("targets", []) if "expr" in t]


def template_metrics(dash: dict[str, Any]) -> list[str]:
    """The metric of each query variable (``label_values(METRIC{...}, label)``)."""
    out = []
    for var in dash["templating"]["list"]:
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(
            r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{.*\})?\s*,\s*\w+\s*\)", query
        )
        assert m, f"variable {var['name']}: unexpected query {query!r}"
        out.append(m.group(1))
    return out


def grafana_to_promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced by what Prometheus parses."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not a function or
    aggregation (followed by ``(``), a keyword, a label (inside ``{}`` or a ``by (...)``
    list), a duration (inside ``[]``) or part of a number or string."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if m.group() in _KEYWORDS or s[m.end() :].lstrip().startswith("("):
            continue
        names.add(m.group())
    return names


# -- a real pool --------------------------------------------------------------------------


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "airflow_nats_ordered.cli", *args]


def start_pool(
    url: str, stream: str, group: str, port: int, size: int, log: Path
) -> subprocess.Popen[bytes]:
    """`nats-ordered pool` of ``size`` members (handler ``chaos_handlers:ignore``), its
    merged metrics on ``port`` (members on the next ``size`` ports); stderr to ``log``."""
    with log.open("wb") as err:
        return subprocess.Popen(
            cli("pool", "--size", str(size), "--member-prefix", "m", "--stream", stream)
            + ["--group", group, "--handler", "chaos_handlers:ignore", "--lease-ttl", "3"]
            + ["--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--server", url],
            env=dict(os.environ, PYTHONPATH=str(TESTS)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def stop(proc: subprocess.Popen[Any], timeout: float = 60) -> int:
    """SIGTERM and wait (SIGKILL after ``timeout``)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
