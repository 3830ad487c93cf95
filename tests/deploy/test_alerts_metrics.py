"""The metrics the alerts and the dashboard read, from real processes against a real
nats-server:

* every metric name in deploy/prometheus's rules and deploy/grafana's dashboard (each
  expression parsed for the names it selects) is one that a real `nats-ordered pool` (two
  members) or a real `nats-ordered publish --metrics-port` exports: scraped, not listed;
* `nats_ordered_group_switch_unfinished` (NatsOrderedLayoutSwitchUnfinished) is 1 on a real
  worker while a repartition killed after switching the subjects is unfinished, and 0 with
  `nats_ordered_group_epoch` 1 once the next run completed it;
* `nats_ordered_publisher_refused_total` / `_failed_total` / `_acked_total`
  (NatsOrderedPublisherRefused / Failed) count a real publisher's records while it runs.

The pool and the publisher are shared by the module's tests (one xdist group)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from alerts_helpers import (
    cli,
    dashboard,
    dashboard_exprs,
    metric_names,
    rules,
    start_pool,
    stop,
    template_metrics,
)
from locations import TESTS
from metrics_scrape import free_ports_in_a_row, sample, scrape, wait_for

from airflow_nats_ordered.embedded.process import free_port

pytestmark = pytest.mark.xdist_group("deploy-alert-metrics")

GROUP = "g"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def pool(shared_nats_server, tmp_path_factory) -> Iterator[tuple[str, int]]:
    """A stream of 4 partitions, 40 records, and a pool of two members processing it."""
    url = shared_nats_server.url
    tmp = tmp_path_factory.mktemp("pool")
    stream = f"T_ALERTS_{os.getpid()}"
    out = run_cli("provision", "--stream", stream, "--partitions", "4", "--server", url)
    assert out.returncode == 0, out.stderr
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"k": f"k{i % 7}", "i": i}) + "\n" for i in range(40)))
    out = run_cli("publish", "--stream", stream, str(rows), "--key-field", "k", "--server", url)
    assert out.returncode == 0, out.stderr
    port = free_ports_in_a_row(3)
    proc = start_pool(url, stream, GROUP, port, 2, tmp / "pool.log")
    try:

        def ready():
            try:
                s = scrape(port)
            except OSError:
                return None
            members = sample(s, "nats_ordered_group_members", group=GROUP)
            lag = sample(s, "nats_ordered_group_lag", group=GROUP)
            rtts = [k for k in s if k[0] == "nats_ordered_member_roundtrip_seconds"]
            return s if members == 2 and lag == 0 and len(rtts) == 2 else None

        try:
            wait_for(ready, 120, "two members processing the stream, served by the pool")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; pool: {(tmp / 'pool.log').read_text()[-3000:]}") from None
        yield stream, port
    finally:
        assert stop(proc) == 0, (tmp / "pool.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def publisher(shared_nats_server, pool) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`nats-ordered publish - --metrics-port P` reading stdin, one keyed and one keyless record
    written so far."""
    stream, _ = pool
    port = free_port()
    proc = subprocess.Popen(
        cli("publish", "--stream", stream, "-", "--key-field", "k", "--producer-id", "alerts")
        + ["--metrics-port", str(port), "--server", shared_nats_server.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"k": "k1", "i": 100}) + "\n")
        proc.stdin.write(json.dumps({"i": 101}) + "\n")  # no key: refused
        proc.stdin.flush()

        def serving() -> bool:
            if proc.poll() is not None:  # it should run until its stdin closes
                raise AssertionError(f"publish exited {proc.returncode}: {proc.communicate()[1]}")
            try:
                return bool(scrape(port))
            except OSError:
                return False

        wait_for(serving, 60, "the publisher's metrics endpoint")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_a_running_publisher_exports_what_it_acked_refused_and_failed(publisher):
    proc, port = publisher

    def counted():
        s = scrape(port)
        done = sample(s, "nats_ordered_publisher_acked_total") == 1
        return (
            s
            if done and sample(s, "nats_ordered_publisher_refused_total", reason="no key")
            else None
        )

    s = wait_for(counted, 60, "the publisher's counters")
    assert sample(s, "nats_ordered_publisher_refused_total", reason="no key") == 1
    # the other reasons are there from the start, at 0 (increase() sees their first refusal)
    assert sample(s, "nats_ordered_publisher_refused_total", reason="too large") == 0
    assert sample(s, "nats_ordered_publisher_failed_total") == 0
    assert {k[1] for k in s if k[0] == "nats_ordered_publisher_acked_total"} == {
        (("stream", proc.args[proc.args.index("--stream") + 1]),)
    }


def test_every_metric_of_the_rules_and_the_dashboard_is_exported_by_a_real_pool_or_publisher(
    pool, publisher
):
    _, pool_port = pool
    _, pub_port = publisher
    exported = {name for name, _ in scrape(pool_port)} | {name for name, _ in scrape(pub_port)}
    assert "nats_ordered_pool_member_up" in exported  # the pool's own, beside the members'
    wanted: dict[str, set[str]] = {}
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        for n in names:
            wanted.setdefault(n, set()).add(f"alert {rule['alert']}")
    dash = dashboard()
    for expr in dashboard_exprs(dash):
        names = metric_names(expr)
        assert names, expr
        for n in names:
            wanted.setdefault(n, set()).add(f"dashboard query {expr}")
    for n in template_metrics(dash):
        wanted.setdefault(n, set()).add("dashboard variable")
    missing = {n: sorted(where) for n, where in wanted.items() if n not in exported}
    assert not missing, f"read but not exported: {missing}; exported: {sorted(exported)}"


def test_a_real_worker_exports_an_unfinished_layout_switch_until_the_repartition_completes(
    shared_nats_server, unique_name, tmp_path
):
    url = shared_nats_server.url
    out = run_cli("provision", "--stream", unique_name, "--partitions", "2", "--server", url)
    assert out.returncode == 0, out.stderr
    port = free_port()
    with (tmp_path / "worker.log").open("wb") as err:
        worker = subprocess.Popen(
            cli("worker", "--stream", unique_name, "--group", GROUP, "--member-id", "w1")
            + ["--handler", "chaos_handlers:ignore", "--lease-ttl", "3"]
            + ["--metrics-port", str(port), "--server", url],
            env=dict(os.environ, PYTHONPATH=str(TESTS)),
            stdin=subprocess.DEVNULL,
            stderr=err,
        )
    log = Path(tmp_path / "worker.log")
    try:

        def view(**want: float):
            def check():
                try:
                    s = scrape(port)
                except OSError:
                    return None
                ok = all(sample(s, n, group=GROUP) == v for n, v in want.items())
                return s if ok else None

            return check

        wait_for(view(nats_ordered_group_switch_unfinished=0, nats_ordered_group_epoch=0), 60,
                 "the worker's group view")  # fmt: skip
        crashed = run_cli(
            "repartition", "--stream", unique_name, "--partitions", "3", "--server", url,
            env=dict(os.environ, NATS_ORDERED_REPARTITION_CRASH_AT="subjects-switched"),
        )  # fmt: skip
        assert crashed.returncode == -9, crashed.stderr  # killed after its first update
        s = wait_for(view(nats_ordered_group_switch_unfinished=1), 60, "the unfinished switch")
        assert sample(s, "nats_ordered_group_epoch", group=GROUP) == 0  # it waits on epoch 0
        done = run_cli("repartition", "--stream", unique_name, "--partitions", "3", "--server", url)
        assert done.returncode == 0, done.stderr
        wait_for(view(nats_ordered_group_switch_unfinished=0, nats_ordered_group_epoch=1), 60,
                 "the group to move to the new layout")  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}; worker: {log.read_text()[-3000:]}") from None
    finally:
        assert stop(worker) == 0, log.read_text()[-3000:]


def test_publish_metrics_port_in_use_is_a_usage_error_naming_the_flag(
    shared_nats_server, unique_name, tmp_path, capsys
):
    from airflow_nats_ordered.cli import main

    url = shared_nats_server.url
    assert main(["provision", "--stream", unique_name, "--partitions", "1", "--server", url]) == 0
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"k": "a"}\n')
    capsys.readouterr()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(
            ["publish", "--stream", unique_name, str(rows), "--key-field", "k"]
            + ["--metrics-port", str(port), "--server", url]
        )
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in err
    out = run_cli("info", "--stream", unique_name, "--json", "--server", url)
    assert json.loads(out.stdout)["messages"] == 0, out.stdout  # nothing was published
