"""deploy/grafana: the dashboard's shape (uid, templating by stream and group, the panels the
on-call person needs) and every query parses as PromQL (promtool, on the queries as rules).
Which metric names the queries read is checked against a real pool in test_alerts_metrics.py."""

from __future__ import annotations

import subprocess

import yaml
from alerts_helpers import (
    dashboard,
    dashboard_exprs,
    dashboard_panels,
    grafana_to_promql,
    metric_names,
    template_metrics,
    tool,
)


def test_dashboard_has_a_uid_variables_and_the_panels_on_call_needs():
    dash = dashboard()
    assert dash["uid"] == "nats-ordered-pool"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(variables) == {"datasource", "stream", "group"}
    assert variables["datasource"]["query"] == "prometheus"
    assert template_metrics(dash)  # stream and group come from the pool's own metrics
    titles = {p["title"] for p in dashboard_panels(dash) if p["type"] != "row"}
    for needed in (
        "Lag per partition",
        "Processed per second",
        "Rebalances",
        "Dead letters and handler errors",
        "Live members",
    ):
        assert needed in titles, needed
    ids = [p["id"] for p in dashboard_panels(dash)]
    assert len(ids) == len(set(ids))
    for panel in dashboard_panels(dash):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            # every group-view or member query is narrowed by the dashboard's variables
            assert 'stream=~"$stream"' in target["expr"], (panel["title"], target["expr"])
            if "publisher" not in target["expr"]:
                assert 'group=~"$group"' in target["expr"], (panel["title"], target["expr"])
            assert metric_names(target["expr"]), target["expr"]


def test_every_dashboard_query_parses_as_promql(tmp_path):
    exprs = dashboard_exprs(dashboard())
    as_rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(e)}
                    for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(as_rules))
    out = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout + out.stderr


def test_metric_names_are_read_from_promql_not_its_functions_labels_or_keywords():
    expr = (
        'sum by (stream, group) (increase(nats_ordered_member_dead_lettered_total{stream=~"$s",'
        'group="a b"}[$__rate_interval])) > 0 and on (stream) max_over_time(x_y:z[6h] offset 5m)'
        " unless foo == bool 1e3"
    )
    assert metric_names(expr) == {"nats_ordered_member_dead_lettered_total", "x_y:z", "foo"}
