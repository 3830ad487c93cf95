"""``nats-ordered`` end to end against real nats-server processes (in-process ``main`` and the
installed console script)."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from streamcheck import check_stored, read_stream, write_jsonl

from airflow_nats_ordered import cli
from airflow_nats_ordered.cli import common
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.embedded.servers import NatsServer

CONSOLE_SCRIPT = Path(sys.executable).with_name("nats-ordered")


@pytest.fixture(autouse=True)
def _no_nats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's NATS_* variables must not leak into these tests."""
    for var in list(os.environ):
        if var.startswith("NATS_"):
            monkeypatch.delenv(var)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    rc, out, err = run_cli(capsys, *argv, "--json")
    return rc, json.loads(out), err


def compact(row: dict[str, Any]) -> bytes:
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode()


def stored_messages(url: str, stream: str) -> list[Any]:
    async def go() -> list[Any]:
        nc = await nats.connect(url)
        try:
            return await read_stream(nc, stream)
        finally:
            await nc.close()

    return asyncio.run(go())


def make_rows(n: int, keys: int, seed: int = 7) -> list[dict[str, Any]]:
    """Rows over ``keys`` keys with many equal timestamps (so the sort must be stable)."""
    rnd = random.Random(seed)
    return [
        {"id": f"evt-{i}", "customer": f"c{rnd.randrange(keys)}", "ts": rnd.randrange(50), "n": i}
        for i in range(n)
    ]


def expected(rows: list[dict[str, Any]], order_by: str | None = None) -> list[tuple[str, bytes]]:
    if order_by:
        rows = sorted(rows, key=lambda r: r[order_by])  # stable
    return [(str(r["customer"]), compact(r)) for r in rows]


def provision(capsys: pytest.CaptureFixture[str], url: str, stream: str, partitions: int) -> None:
    rc, out, err = run_cli(
        capsys, "provision", "--stream", stream, "--partitions", partitions, "--server", url
    )
    assert rc == 0, err


# ---------------------------------------------------------------------------- provision


def test_provision_created_unchanged_updated_and_partition_mismatch(
    shared_nats_server: NatsServer, unique_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = shared_nats_server.url
    base = ("provision", "--stream", unique_name, "--partitions", "4", "--server", url)

    rc, out, err = run_cli(capsys, *base)
    assert rc == 0, err
    assert out.strip() == (
        f"created stream {unique_name}: 4 partitions on {unique_name.lower()}.p.0 to "
        f"{unique_name.lower()}.p.3, "
        "file storage, 1 replica, duplicate window 1h"
    )

    rc, out, _ = run_cli(capsys, *base)
    assert rc == 0 and out.startswith(f"stream {unique_name} unchanged: 4 partitions")

    rc, out, _ = run_cli(capsys, *base, "--max-age", "2d", "--duplicate-window", "30m")
    assert rc == 0
    assert out.strip() == (
        f"updated stream {unique_name}: max_age: 0s -> 172800s; duplicate_window: 3600s -> 1800s"
    )
    assert len(out.strip().splitlines()) == 1

    # flags left out keep the stream's current values: nothing is reset
    rc, res, _ = run_json(capsys, *base)
    assert rc == 0 and res["action"] == "unchanged" and res["changes"] == []
    assert res["max_age"] == 172800 and res["duplicate_window"] == 1800

    rc, res, _ = run_json(capsys, *base, "--max-bytes", "512MiB", "--max-age", "unlimited")
    assert res["action"] == "updated" and res["max_bytes"] == 512 * 1024**2
    assert res["max_age"] is None
    assert {c.split(":")[0] for c in res["changes"]} == {"max_age", "max_bytes"}

    rc, out, err = run_cli(
        capsys, "provision", "--stream", unique_name, "--partitions", "8", "--server", url
    )
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and "Traceback" not in err
    assert "has 4 partitions" in err and "--partitions 4" in err


def test_provision_json_shape_and_options(
    shared_nats_server: NatsServer, unique_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, res, err = run_json(
        capsys,
        "provision",
        "--stream",
        unique_name,
        "--partitions",
        "3",
        "--subject-prefix",
        f"ev.{unique_name.lower()}",
        "--storage",
        "memory",
        "--max-msgs",
        "1000",
        "--duplicate-window",
        "90",
        "--server",
        shared_nats_server.url,
    )
    assert rc == 0, err
    assert res == {
        "action": "created",
        "stream": unique_name,
        "partitions": 3,
        "prefix": f"ev.{unique_name.lower()}",
        "subjects": [f"ev.{unique_name.lower()}.p.{p}" for p in range(3)],
        "hash": "murmur3_x86_32",
        "seed": 0,
        "storage": "memory",
        "replicas": 1,
        "duplicate_window": 90.0,
        "max_age": None,
        "max_bytes": None,
        "max_msgs": 1000,
        "max_msg_size": None,
        "changes": [],
        "narrowed": False,
        "strays": {"messages": 0, "subjects": {}, "purged": 0},
    }
    # asking for another storage is a conflict, not a silent change
    rc, out, err = run_cli(
        capsys,
        "provision",
        "--stream",
        unique_name,
        "--partitions",
        "3",
        "--storage",
        "file",
        "--server",
        shared_nats_server.url,
    )
    assert rc == 2 and "memory storage but file was requested" in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-age", "7x", "invalid duration '7x'"),
        ("--max-bytes", "10 parsecs", "invalid size"),
        ("--partitions", "0", "must be >= 1"),
    ],
)
def test_bad_flag_values_are_usage_errors(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    argv = ["provision", "--stream", "S", "--partitions", "2", flag, value]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and message in err and "Traceback" not in err


def test_duration_size_and_table_helpers() -> None:
    assert [
        common.parse_duration(t) for t in ("90s", "30m", "2h", "7d", "1h30m", "500ms", "12")
    ] == [
        90,
        1800,
        7200,
        604800,
        5400,
        0.5,
        12,
    ]
    assert common.parse_duration("unlimited") == 0
    assert (
        common.parse_size("10GB") == 10 * 1024**3 and common.parse_size("512MiB") == 512 * 1024**2
    )
    assert common.parse_size("4096") == 4096 and common.parse_size("unlimited") == -1
    assert common.format_duration(5400) == "1h30m" and common.format_duration(0.25) == "0.25s"
    table = common.format_table(
        ("partition", "subject", "messages"),
        [(0, "a.p.0", 5), (1, "a.p.1", 1234)],
        footer=[("total", "", 1239)],
    )
    assert table.splitlines() == [
        "partition  subject  messages",
        "        0  a.p.0           5",
        "        1  a.p.1        1234",
        "---------  -------  --------",
        "    total               1239",
    ]


# ---------------------------------------------------------------------------- publish


def test_publish_jsonl_with_order_by_and_msg_id_field_keeps_per_key_order(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 8)
    rows = make_rows(3000, keys=40)
    path = tmp_path / "events.jsonl"
    write_jsonl(path, rows)

    rc, res, err = run_json(
        capsys,
        "publish",
        "--stream",
        unique_name,
        path,
        "--key-field",
        "customer",
        "--order-by",
        "ts",
        "--msg-id-field",
        "id",
        "--server",
        url,
    )
    assert rc == 0, err
    assert res["read"] == res["accepted"] == res["acked"] == res["stored"] == 3000
    assert res["refused"] == res["failed"] == res["duplicates"] == 0
    assert err.startswith(f"published 3000 records to {unique_name} in ")
    assert "3000 acked, 0 refused, 0 failed, 0 duplicates" in err

    stored = stored_messages(url, unique_name)
    want = expected(rows, order_by="ts")
    counts = check_stored(want, stored, 8, unique_name.lower())  # per-partition input order
    assert sum(counts.values()) == 3000
    by_key: dict[str, list[int]] = {}
    for s in stored:
        by_key.setdefault(s.key, []).append(json.loads(s.data)["n"])
    for key, ns in by_key.items():
        assert ns == [r["n"] for r in sorted(rows, key=lambda r: r["ts"]) if r["customer"] == key]
        assert all(partition_for(key, 8) == int(m.subject.rsplit(".", 1)[1]) for m in stored
                   if m.key == key)  # fmt: skip
    assert {s.msg_id for s in stored} == {r["id"] for r in rows}

    # the high-water marks of the summary are the partitions' last sequences
    rc, info, _ = run_json(capsys, "info", "--stream", unique_name, "--server", url)
    assert {str(p["partition"]): p["last_seq"] for p in info["partition_stats"]} == res[
        "high_water_marks"
    ]
    assert [p["last_seq"] for p in res["partitions"]] == [
        p["last_seq"] for p in info["partition_stats"]
    ]


def test_republishing_the_same_file_stores_nothing_new(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 4)
    rows = make_rows(1000, keys=10, seed=3)
    path = tmp_path / "events.jsonl"
    write_jsonl(path, rows)
    argv = ("publish", "--stream", unique_name, path, "--key-field", "customer", "--server", url)

    rc, first, _ = run_json(capsys, *argv, "--producer-id", "run-1")
    assert rc == 0 and first["stored"] == 1000
    rc, before, _ = run_json(capsys, "info", "--stream", unique_name, "--server", url)

    rc, again, err = run_json(capsys, *argv, "--producer-id", "run-1")
    assert rc == 0, err
    assert again["acked"] == 1000 and again["stored"] == 0 and again["duplicates"] == 1000
    assert "1000 acked, 0 refused, 0 failed, 1000 duplicates" in err
    assert again["high_water_marks"] == first["high_water_marks"]
    rc, after, _ = run_json(capsys, "info", "--stream", unique_name, "--server", url)
    assert after["partition_stats"] == before["partition_stats"]

    # plain text summary goes to stdout without --json
    rc, out, err = run_cli(capsys, *argv, "--producer-id", "run-1")
    assert rc == 0 and out.startswith(f"published 1000 records to {unique_name} in ")
    assert out.strip().endswith(
        "1000 acked, 0 refused, 0 failed, 1000 duplicates; producer id run-1"
    )


def test_rerunning_a_file_without_producer_id_stores_nothing_twice(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """The default producer id is the file's content digest: the same content (even copied
    elsewhere) de-duplicates, different content publishes."""
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 4)
    rows = make_rows(300, keys=5, seed=4)
    path = write_jsonl(tmp_path / "events.jsonl", rows)
    argv = ("publish", "--stream", unique_name, "--key-field", "customer", "--server", url)

    rc, first, _ = run_json(capsys, *argv, path)
    assert rc == 0 and first["stored"] == 300
    assert first["producer_id"].startswith("file-") and len(first["producer_id"]) == 25
    copy = tmp_path / "elsewhere" / "renamed.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    rc, again, err = run_json(capsys, *argv, copy)
    assert rc == 0, err
    assert again["producer_id"] == first["producer_id"]
    assert again["stored"] == 0 and again["duplicates"] == 300
    assert f"producer id {first['producer_id']}" in err

    other = write_jsonl(tmp_path / "other.jsonl", [*rows, rows[0]])
    rc, third, _ = run_json(capsys, *argv, other)
    assert rc == 0 and third["producer_id"] != first["producer_id"]
    assert third["stored"] == 301  # new content, a new run: published in full


def test_publish_csv(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 4)
    rows = [{k: str(v) for k, v in r.items()} for r in make_rows(500, keys=12, seed=11)]
    path = tmp_path / "events.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    rc, res, err = run_json(
        capsys,
        "publish",
        "--stream",
        unique_name,
        path,
        "--key-field",
        "customer",
        "--order-by",
        "ts",  # numeric column: 9 sorts before 10
        "--server",
        url,
    )
    assert rc == 0, err
    assert res["format"] == "csv" and res["stored"] == 500
    stored = stored_messages(url, unique_name)
    want = [
        (r["customer"], compact(r)) for r in sorted(rows, key=lambda r: int(r["ts"]))
    ]  # fmt: skip
    assert sum(check_stored(want, stored, 4, unique_name.lower()).values()) == 500


def test_publish_parquet(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 4)
    base = dt.datetime(2013, 1, 1, tzinfo=dt.UTC)
    n = 400
    rnd = random.Random(5)
    hours = [rnd.randrange(24) for _ in range(n)]
    table = pa.table(
        {
            "flight": pa.array(list(range(n)), pa.int32()),
            "tailnum": pa.array([f"N{i % 9}" for i in range(n)]),
            "time_hour": pa.array(
                [base + dt.timedelta(hours=h) for h in hours], pa.timestamp("us", tz="UTC")
            ),
            "dep_delay": pa.array([float(i % 7) for i in range(n)]),
        }
    )
    path = tmp_path / "flights.parquet"
    pq.write_table(table, path)

    rc, res, err = run_json(
        capsys,
        "publish",
        "--stream",
        unique_name,
        path,
        "--key-field",
        "tailnum",
        "--order-by",
        "time_hour",
        "--msg-id-field",
        "flight",
        "--server",
        url,
    )
    assert rc == 0, err
    assert res["format"] == "parquet" and res["stored"] == n
    stored = stored_messages(url, unique_name)
    first = json.loads(stored[0].data)
    assert first.keys() == {"flight", "tailnum", "time_hour", "dep_delay"}
    assert first["time_hour"].startswith("2013-01-01T") and first["time_hour"].endswith("+00:00")
    order = sorted(range(n), key=lambda i: hours[i])
    want = [
        (
            f"N{i % 9}",
            compact(
                {
                    "flight": i,
                    "tailnum": f"N{i % 9}",
                    "time_hour": (base + dt.timedelta(hours=hours[i])).isoformat(),
                    "dep_delay": float(i % 7),
                }
            ),
        )
        for i in order
    ]
    assert sum(check_stored(want, stored, 4, unique_name.lower()).values()) == n
    assert {s.msg_id for s in stored} == {str(i) for i in range(n)}


def test_refused_records_are_counted_reported_and_the_rest_stored(
    tmp_path: Path, unique_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with NatsServer(tmp_path / "srv", extra_config="max_payload: 4096") as srv:
        provision(capsys, srv.url, unique_name, 4)
        rows: list[dict[str, Any]] = make_rows(600, keys=15, seed=2)
        rows[10] = {"id": "evt-10", "ts": 1, "n": 10}  # no key field
        rows[20]["customer"] = ""  # empty key
        rows[30]["customer"] = None  # null key
        rows[40]["pad"] = "x" * 5000  # over max_payload
        rows[50]["pad"] = "y" * 5000
        path = tmp_path / "events.jsonl"
        write_jsonl(path, rows)

        rc, res, err = run_json(
            capsys,
            "publish",
            "--stream",
            unique_name,
            path,
            "--key-field",
            "customer",
            "--server",
            srv.url,
        )
        assert rc == 1
        assert res["read"] == 600 and res["refused"] == 5 and res["failed"] == 0
        assert res["refused_by_reason"] == {"no key": 3, "too large": 2}
        assert res["acked"] == res["stored"] == 595
        assert [e["where"] for e in res["refused_examples"]] == [
            "line 11",
            "line 21",
            "line 31",
            "line 41",
            "line 51",
        ]
        assert "refused (no key: 3, too large: 2)" in err
        assert "refused line 11: no key" in err
        # the fix is named in the CLI's own terms, not the Python API's
        assert "or publish with --allow-keyless for round-robin" in err
        assert "allow_keyless=True" not in err
        assert f"refused line 41 (key {rows[40]['customer']!r}): too large" in err
        assert "max_payload" in err

        bad = {10, 20, 30, 40, 50}
        good = [r for i, r in enumerate(rows) if i not in bad]
        stored = stored_messages(srv.url, unique_name)
        assert sum(check_stored(expected(good), stored, 4, unique_name.lower()).values()) == 595

        # --allow-keyless publishes the keyless ones round-robin instead
        rc, res, _ = run_json(
            capsys,
            "publish",
            "--stream",
            unique_name,
            path,
            "--key-field",
            "customer",
            "--allow-keyless",
            "--producer-id",
            "keyless",
            "--server",
            srv.url,
        )
        assert rc == 1 and res["refused_by_reason"] == {"too large": 2} and res["stored"] == 598


def test_wrong_key_field_is_an_immediate_clear_error(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 2)
    path = tmp_path / "events.jsonl"
    write_jsonl(path, make_rows(50, keys=3))
    rc, out, err = run_cli(
        capsys, "publish", "--stream", unique_name, path, "--key-field", "custmer", "--server", url
    )
    assert rc == 2 and out == ""
    assert err.startswith("error: --key-field 'custmer' is not a field of")
    assert "'id', 'customer', 'ts', 'n'" in err and "Did you mean 'customer'?" in err
    assert err.count("\n") == 1  # one message, not 50 refusals or a traceback
    rc, info, _ = run_json(capsys, "info", "--stream", unique_name, "--server", url)
    assert sum(p["messages"] for p in info["partition_stats"]) == 0

    csv_path = tmp_path / "events.csv"
    csv_path.write_text("id,customer\n1,a\n")
    rc, _, err = run_cli(
        capsys, "publish", "--stream", unique_name, csv_path, "--key-field", "cust", "--server", url
    )
    assert rc == 2 and "is not a column of" in err and "Its header has: 'id', 'customer'" in err

    rc, _, err = run_cli(capsys, "publish", "--stream", unique_name, csv_path, "--server", url)
    assert rc == 2 and "publish needs --key-field" in err and "--allow-keyless" in err


def test_malformed_input_line_stops_with_exit_2_after_publishing_what_came_before(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 2)
    path = tmp_path / "events.jsonl"
    path.write_text('{"k": "a", "n": 1}\n{"k": "b", "n": 2}\n{"k": "a", oops}\n{"k": "a"}\n')
    rc, res, err = run_json(
        capsys, "publish", "--stream", unique_name, path, "--key-field", "k", "--server", url
    )
    assert rc == 2
    assert res["stored"] == 2 and "line 3 is not valid JSON" in res["error"]
    assert "error: " in err and "line 3 is not valid JSON" in err


def test_missing_stream_and_partition_expectation(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url = shared_nats_server.url
    path = tmp_path / "e.jsonl"
    path.write_text('{"k": "a"}\n')
    argv = ("publish", "--stream", unique_name, path, "--key-field", "k", "--server", url)
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and f"stream {unique_name} does not exist" in err
    assert f"nats-ordered provision --stream {unique_name}" in err
    provision(capsys, url, unique_name, 3)
    rc, _, err = run_cli(capsys, *argv, "--expect-partitions", "4")
    assert rc == 2 and "has 3 partitions" in err and "4 were expected" in err
    rc, _, err = run_cli(capsys, *argv, "--expect-partitions", "3")
    assert rc == 0, err


def test_unreachable_server_is_exit_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from airflow_nats_ordered.embedded.process import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    rc, out, err = run_cli(capsys, "info", "--stream", "S", "--server", url)
    assert rc == 2 and out == ""
    assert err.startswith(f"error: could not connect to {url}") and "--server" in err
    assert "Traceback" not in err
    path = tmp_path / "e.jsonl"
    path.write_text('{"k": "a"}\n')
    rc, _, err = run_cli(
        capsys, "publish", "--stream", "S", path, "--key-field", "k", "--server", url
    )
    assert rc == 2 and "could not connect" in err


def test_password_comes_from_the_environment_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "pw-Very-Secret-42"
    auth = f'authorization {{ user: alice, password: "{secret}" }}'
    with NatsServer(tmp_path / "srv", extra_config=auth) as srv:
        argv = ("info", "--stream", "NOPE", "--server", srv.url, "--user", "alice")
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2 and "NATS_PASSWORD" in err

        monkeypatch.setenv("NATS_PASSWORD", secret)
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2 and "stream NOPE does not exist" in err  # authenticated

        monkeypatch.setenv("NATS_PASSWORD", "wrong-" + secret)
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2 and "rejected the credentials" in err and secret not in err

        monkeypatch.setenv("NATS_URL", srv.url)
        monkeypatch.setenv("NATS_USER", "alice")
        monkeypatch.setenv("NATS_PASSWORD", secret)
        rc, _, err = run_cli(capsys, "info", "--stream", "NOPE")
        assert rc == 2 and "does not exist" in err


# ---------------------------------------------------------------------------- info


def test_info_table_and_json(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 3)
    rows = [{"k": k, "n": i} for i, k in enumerate("aabbbcccc")]
    path = tmp_path / "e.jsonl"
    write_jsonl(path, rows)
    rc, _, err = run_cli(
        capsys, "publish", "--stream", unique_name, path, "--key-field", "k", "--server", url
    )
    assert rc == 0, err

    rc, info, _ = run_json(capsys, "info", "--stream", unique_name, "--server", url)
    prefix = unique_name.lower()
    counts = {p: 0 for p in range(3)}
    for r in rows:
        counts[partition_for(r["k"], 3)] += 1
    assert {k: info[k] for k in ("stream", "partitions", "prefix", "hash", "duplicate_window")} == {
        "stream": unique_name,
        "partitions": 3,
        "prefix": prefix,
        "hash": "murmur3_x86_32",
        "duplicate_window": 3600.0,
    }
    stats = info["partition_stats"]
    assert [set(s) for s in stats] == [{"partition", "subject", "messages", "last_seq"}] * 3
    assert [(s["partition"], s["subject"], s["messages"]) for s in stats] == [
        (p, f"{prefix}.p.{p}", counts[p]) for p in range(3)
    ]
    assert max(s["last_seq"] for s in stats) == len(rows)

    rc, out, _ = run_cli(capsys, "info", "--stream", unique_name, "--server", url)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["partition", "subject", "messages", "last_seq"]
    for p in range(3):
        assert lines[1 + p].split() == [
            str(p),
            f"{prefix}.p.{p}",
            str(counts[p]),
            str(stats[p]["last_seq"]),
        ]
    assert set(lines[4].replace(" ", "")) == {"-"}
    assert lines[5].split() == ["total", str(len(rows)), str(len(rows))]
    assert lines[6] == (
        f"stream {unique_name}: 3 partitions, prefix {prefix}, hash murmur3_x86_32 seed 0, "
        "duplicate window 1h, file storage, 1 replica"
    )


# ---------------------------------------------------------------------------- console script


def _script_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env["NATS_URL"] = url
    return env


def test_console_script_publishes_stdin_and_reports_json(
    shared_nats_server: NatsServer, unique_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert CONSOLE_SCRIPT.exists(), f"console script missing at {CONSOLE_SCRIPT}"
    env = _script_env(shared_nats_server.url)
    prov = subprocess.run(
        [CONSOLE_SCRIPT, "provision", "--stream", unique_name, "--partitions", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert prov.returncode == 0, prov.stderr
    rows = make_rows(200, keys=5)
    pub = subprocess.run(
        [CONSOLE_SCRIPT, "publish", "--stream", unique_name, "-", "--key-field", "customer"],
        input="".join(json.dumps(r) + "\n" for r in rows),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pub.returncode == 0, pub.stderr
    assert "200 acked, 0 refused, 0 failed, 0 duplicates" in pub.stdout
    info = subprocess.run(
        [CONSOLE_SCRIPT, "info", "--stream", unique_name, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert info.returncode == 0, info.stderr
    assert sum(p["messages"] for p in json.loads(info.stdout)["partition_stats"]) == 200
    stored = stored_messages(shared_nats_server.url, unique_name)
    assert sum(check_stored(expected(rows), stored, 2, unique_name.lower()).values()) == 200


def _start_stdin_publish(url: str, stream: str, *extra: str) -> tuple[Any, list[str]]:
    """Run ``nats-ordered publish`` reading an open stdin pipe; collect stderr lines."""
    proc = subprocess.Popen(
        [CONSOLE_SCRIPT, "publish", "--stream", stream, "-", "--key-field", "k", *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_script_env(url),
        text=True,
    )
    err_lines: list[str] = []
    threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True).start()
    return proc, err_lines


def _send_rows(proc: Any, first: int, count: int) -> None:
    proc.stdin.write(
        "".join(json.dumps({"k": f"k{i % 5}", "n": i}) + "\n" for i in range(first, first + count))
    )
    proc.stdin.flush()  # stdin stays open: the reader blocks waiting for more


def _wait_for(err_lines: list[str], text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in err_lines):
        assert time.monotonic() < deadline, f"no {text!r} in stderr: {''.join(err_lines)}"
        time.sleep(0.05)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_flushes_accepted_records_and_exits_128_plus_signal(
    shared_nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    sig: signal.Signals,
    code: int,
) -> None:
    url = shared_nats_server.url
    provision(capsys, url, unique_name, 2)
    proc, err_lines = _start_stdin_publish(url, unique_name, "--progress")
    try:
        _send_rows(proc, 0, 150)
        _wait_for(err_lines, "acked 150")
        proc.send_signal(sig)
        out = proc.stdout.read()
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.2)  # let the stderr thread take the last lines
    assert rc == code, "".join(err_lines)
    assert "published 150 records" in out and "150 acked" in out and "interrupted" in out
    assert "Traceback" not in "".join(err_lines)
    assert len(stored_messages(url, unique_name)) == 150


def test_records_not_stored_in_time_are_reported_failed_with_exit_1(
    nats_server: NatsServer,
    unique_name: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    provision(capsys, nats_server.url, unique_name, 2)
    proc, err_lines = _start_stdin_publish(
        nats_server.url,
        unique_name,
        "--json",
        "--progress",
        "--ack-timeout",
        "0.3",
        "--delivery-timeout",
        "1.5",
    )
    try:
        _send_rows(proc, 0, 100)
        _wait_for(err_lines, "acked 100")
        nats_server.pause()
        try:
            _send_rows(proc, 100, 50)
            proc.stdin.close()
            _wait_for(err_lines, "gave up", timeout=60)
        finally:
            nats_server.resume()
        out = proc.stdout.read()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.2)
    err = "".join(err_lines)
    assert rc == 1, err
    res = json.loads(out)
    # partitions give up on their own: one may still get its records acknowledged after
    # the server resumes, but every record is either acknowledged or reported failed
    acked, failed = res["acked"], res["failed"]
    assert res["read"] == 150 and acked + failed == 150 and acked >= 100 and failed >= 1
    assert res["refused"] == 0 and "gave up" in res["first_failure"]
    assert f"{acked} acked, 0 refused, {failed} failed" in err
    assert f"error: {failed} of 150 records were not confirmed as stored" in err
    assert "Traceback" not in err
    # "failed" means "not acknowledged in time": a paused (not dead) server may still store
    # some of them once it resumes. Either way each partition holds a prefix of its input,
    # and publishing the same input again (under the producer id that run printed: stdin
    # gets a new one per run) completes it without storing anything twice.
    rows = [{"k": f"k{i % 5}", "n": i} for i in range(150)]
    want = [(r["k"], compact(r)) for r in rows]
    stored = stored_messages(nats_server.url, unique_name)
    assert 100 <= sum(check_stored(want, stored, 2, unique_name.lower()).values()) <= 150
    path = tmp_path / "again.jsonl"
    write_jsonl(path, rows)
    assert res["producer_id"] and f"pass --producer-id {res['producer_id']}" in err
    rc, again, err = run_json(
        capsys, "publish", "--stream", unique_name, path, "--key-field", "k",
        "--producer-id", res["producer_id"], "--server", nats_server.url,
    )  # fmt: skip
    assert rc == 0, err
    assert again["stored"] == 150 - len(stored) and again["duplicates"] == len(stored)
    stored = stored_messages(nats_server.url, unique_name)
    assert sum(check_stored(want, stored, 2, unique_name.lower()).values()) == 150


def test_server_without_jetstream_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with NatsServer(tmp_path / "nojs", jetstream=False) as srv:
        for argv in (
            ("info", "--stream", "S"),
            ("provision", "--stream", "S", "--partitions", "2"),
        ):
            rc, out, err = run_cli(capsys, *argv, "--server", srv.url)
            assert rc == 2 and out == ""
            assert err.startswith("error: JetStream is not available on the server")
            assert "Traceback" not in err
