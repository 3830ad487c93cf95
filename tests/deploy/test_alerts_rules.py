"""deploy/prometheus: the alerting rules are valid (`promtool check rules`), each alert's case
fires on series that reproduce it and healthy series do not (`promtool test rules` on
nats-ordered-alerts.test.yml), and each alert has its runbook line in docs/operations.md.
Which metric names the rules read is checked against a real pool in test_alerts_metrics.py."""

from __future__ import annotations

import subprocess

import yaml
from alerts_helpers import PROMETHEUS_DIR, RULES, RULES_TEST, rules, tool
from locations import ROOT


def test_promtool_checks_the_rules():
    out = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout + out.stderr


def test_promtool_unit_tests_fire_each_alert_on_its_case_and_not_on_healthy_series():
    out = subprocess.run(
        [tool("promtool"), "test", "rules", RULES_TEST.name],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
    # every alert has a case that fires it and an evaluation where nothing fires
    cases = yaml.safe_load(RULES_TEST.read_text())["tests"]
    checks = [c for t in cases for c in t["alert_rule_test"]]
    for rule in rules():
        name = rule["alert"]
        mine = [c for c in checks if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no case fires it"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no case where it stays quiet"


def test_every_alert_has_a_runbook_line_in_operations_md():
    doc = (ROOT / "docs" / "operations.md").read_text()
    for rule in rules():
        name = rule["alert"]
        anchor = rule["annotations"]["runbook"]
        assert anchor == f"docs/operations.md#{name.lower()}", anchor
        assert f"#### {name}" in doc, f"docs/operations.md has no section for {name}"
        assert rule["labels"]["severity"] in ("warning", "critical")
