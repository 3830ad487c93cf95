"""A real Prometheus (Debian's `prometheus`) scrapes a real `nats-ordered pool` on a real
nats-server with deploy/prometheus's rules, and NatsOrderedGroupNoLiveMember goes from
inactive to firing when the pool's members are stopped.

The rules' ``for:`` durations (minutes) would make the test slow, so Prometheus loads a
copy whose ``for:`` are shortened; the test checks the copy differs from the real rules in
nothing else."""

from __future__ import annotations

import copy
import json
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any

import pytest
import yaml
from alerts_helpers import RULES, cli, start_pool, stop, tool
from metrics_scrape import free_ports_in_a_row, wait_for

from airflow_nats_ordered.embedded.process import free_port

ALERT = "NatsOrderedGroupNoLiveMember"
GROUP = "g"
TEST_FOR = "2s"


def shortened_rules() -> dict[str, Any]:
    doc = yaml.safe_load(RULES.read_text())
    short = copy.deepcopy(doc)
    for g in short["groups"]:
        for r in g["rules"]:
            if "for" in r:
                r["for"] = TEST_FOR
    # the copy differs only in `for:`: put the real durations back and compare
    back = copy.deepcopy(short)
    for g_back, g_real in zip(back["groups"], doc["groups"], strict=True):
        for r_back, r_real in zip(g_back["rules"], g_real["rules"], strict=True):
            if "for" in r_real:
                assert r_back["for"] == TEST_FOR
                r_back["for"] = r_real["for"]
            else:
                assert "for" not in r_back
    assert back == doc
    return short


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - our own loopback URL
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def alert_state(port: int, stream: str) -> str | None:
    """The state of ALERT for the stream's group in /api/v1/alerts (pending, firing), or
    "inactive" when the rule is evaluated and has no alert for it."""
    for a in api(port, "alerts")["alerts"]:
        if a["labels"].get("alertname") == ALERT and a["labels"].get("stream") == stream:
            assert a["labels"]["group"] == GROUP
            return str(a["state"])
    rules = [r for g in api(port, "rules", type="alert")["groups"] for r in g["rules"]]
    rule = next(r for r in rules if r["name"] == ALERT)
    return "inactive" if rule["health"] == "ok" and rule["state"] == "inactive" else None


@pytest.mark.timeout(300)
def test_no_live_member_goes_from_inactive_to_firing_when_the_pool_stops(
    shared_nats_server, unique_name, tmp_path
):
    prometheus = tool("prometheus")
    url = shared_nats_server.url
    assert (
        subprocess.run(
            cli("provision", "--stream", unique_name, "--partitions", "2", "--server", url),
            capture_output=True,
            timeout=120,
        ).returncode
        == 0
    )
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(shortened_rules()))
    pool_port = free_ports_in_a_row(3)
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {
                    "scrape_interval": "2s",
                    "scrape_timeout": "2s",
                    "evaluation_interval": "1s",
                },
                "rule_files": [str(tmp_path / "rules.yml")],
                "scrape_configs": [
                    {
                        "job_name": "nats-ordered-pool",
                        "static_configs": [{"targets": [f"127.0.0.1:{pool_port}"]}],
                    }
                ],
            }
        )
    )
    pool = start_pool(url, unique_name, GROUP, pool_port, 2, tmp_path / "pool.log")
    prom_port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as err:
        prom = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}"]
            + [f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
            + [f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    logs = {"pool": tmp_path / "pool.log", "prometheus": tmp_path / "prometheus.log"}

    def live_members() -> float | None:
        try:
            res = api(
                prom_port, "query", query=f'nats_ordered_group_members{{stream="{unique_name}"}}'
            )
        except OSError:
            return None
        return float(res["result"][0]["value"][1]) if res["result"] else None

    def state() -> str | None:
        try:
            return alert_state(prom_port, unique_name)
        except OSError:
            return None

    try:
        # the pool runs: Prometheus has scraped its two live members, the alert is inactive
        wait_for(lambda: live_members() == 2, 120, "Prometheus to scrape two live members")
        wait_for(lambda: state() == "inactive", 60, f"{ALERT} to be evaluated inactive")
        t0 = time.monotonic()
        assert stop(pool) == 0
        seen: list[str | None] = []

        def firing() -> bool:
            seen.append(state())
            return seen[-1] == "firing"

        wait_for(firing, 90, f"{ALERT} to fire")
        went = ["inactive", *(s for s in seen if s)]
        states = [s for i, s in enumerate(went) if i == 0 or went[i - 1] != s]
        took = time.monotonic() - t0
        print(f"{ALERT}: {' -> '.join(states)} {took:.1f}s after SIGTERM")
        assert live_members() is None  # nobody exports the group view any more
    except AssertionError as exc:
        text = "; ".join(f"{k}: {p.read_text()[-2000:]}" for k, p in logs.items())
        raise AssertionError(f"{exc}; {text}") from None
    finally:
        stop(pool)
        stop(prom)
