"""A stream accepts only its partition subjects; strays are counted, reported, and fail a drain.

A foreign client (raw nats-py JetStream publish, not this project's publisher) that publishes
to ``<prefix>.p.<P>``, ``.p.99``, ``.p.00`` or ``.p.x`` gets no ack: the stream's subjects are
the explicit list ``<prefix>.p.0`` ... ``<prefix>.p.<P-1>``. A stream created the old way (the
wildcard ``<prefix>.p.*``) keeps working; whatever it stored on other subjects is reported by
``info`` and ``status`` and fails a drain wait, until ``provision`` narrows it and purges them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats
import pytest
from nats.js.errors import NoStreamResponseError

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.admin.drain_errors import StrayMessagesError
from airflow_nats_ordered.core.errors import ConfigError, StreamConflictError
from airflow_nats_ordered.core.group.config import GroupConfig
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.stream.partitioned import (
    MAX_PARTITIONS,
    StreamSpec,
    describe,
    provision,
    stream_contents,
)
from airflow_nats_ordered.core.stream.partitioning import (
    is_partition_subject,
    partition_of_subject,
    partition_subjects,
    partition_wildcard,
)

STRAYS = (".p.4", ".p.99", ".p.00", ".p.x")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_nc(url: str, fn: Any) -> Any:
    nc = await nats.connect(url)
    try:
        return await fn(nc)
    finally:
        await nc.close()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


async def _foreign_publish(nc: Any, subject: str) -> str:
    """A raw JetStream publish, as a foreign client does it: 'ack' or the refusal."""
    try:
        await nc.jetstream(timeout=10).publish(subject, b"{}", headers={"Nats-Ordered-Key": "k"})
    except NoStreamResponseError:
        return "refused"
    return "ack"


# ------------------------------------------------------------------------- pure subject rules


def test_only_the_canonical_spelling_below_p_is_a_partition_subject() -> None:
    assert partition_subjects("orders", 3) == ["orders.p.0", "orders.p.1", "orders.p.2"]
    assert partition_of_subject("orders", "orders.p.10", 11) == 10
    for subject in ("orders.p.00", "orders.p.01", "orders.p.+1", "orders.p.\u0663", "orders.p.x"):
        assert not is_partition_subject("orders", subject, 100), subject
        with pytest.raises(ValueError, match="not a partition subject"):
            partition_of_subject("orders", subject)
    assert not is_partition_subject("orders", "orders.p.4", 4)
    with pytest.raises(ValueError, match="partitions 0 to 3"):
        partition_of_subject("orders", "orders.p.4", 4)
    assert StreamSpec("ORD", partitions=2).subjects == ["ord.p.0", "ord.p.1"]


# ------------------------------------------------------------------------- the server refuses


def test_foreign_publish_outside_the_partitions_is_refused_by_the_server(
    shared_nats_server: Any, unique_name: str
) -> None:
    prefix = unique_name.lower()

    async def go(nc: Any) -> tuple[dict[str, str], Any, Any]:
        await provision(nc, StreamSpec(unique_name, partitions=4))
        outcome = {s: await _foreign_publish(nc, prefix + s) for s in (*STRAYS, ".p.3", ".p.0")}
        return outcome, await describe(nc, unique_name), await stream_contents(nc, unique_name)

    outcome, stream, contents = run(_with_nc(shared_nats_server.url, go))
    assert outcome == {".p.4": "refused", ".p.99": "refused", ".p.00": "refused"} | {
        ".p.x": "refused",
        ".p.3": "ack",
        ".p.0": "ack",
    }
    assert stream.explicit_subjects and stream.config.subjects == partition_subjects(prefix, 4)
    assert contents.messages == 2 and not contents.strays


def test_provision_at_the_partition_limit_takes_every_subject_and_refuses_the_next(
    nats_server: Any, unique_name: str
) -> None:
    """MAX_PARTITIONS explicit subjects fit in one request and the server routes the last
    one; one past it is refused. Its own server: the server checks every new stream's
    subjects against the account's, so 4096 of them would slow the shared server."""
    prefix = unique_name.lower()

    async def go(nc: Any) -> tuple[Any, str, str, Any]:
        res = await provision(nc, StreamSpec(unique_name, partitions=MAX_PARTITIONS))
        last = await _foreign_publish(nc, f"{prefix}.p.{MAX_PARTITIONS - 1}")
        past = await _foreign_publish(nc, f"{prefix}.p.{MAX_PARTITIONS}")
        return res, last, past, await provision(nc, StreamSpec(unique_name, MAX_PARTITIONS))

    res, last, past, again = run(_with_nc(nats_server.url, go))
    assert (last, past) == ("ack", "refused")
    assert res.action == "created" and res.stream.explicit_subjects
    assert len(res.stream.config.subjects) == MAX_PARTITIONS
    assert again.action == "unchanged" and not again.strays


def test_a_configuration_larger_than_max_payload_is_refused_before_sending(
    shared_nats_server: Any, unique_name: str
) -> None:
    spec = StreamSpec(unique_name, partitions=MAX_PARTITIONS, subject_prefix="x" * 300)

    async def go(nc: Any) -> None:
        await provision(nc, spec)

    with pytest.raises(ConfigError, match=r"max_payload.*--subject-prefix"):
        run(_with_nc(shared_nats_server.url, go))


# ------------------------------------------------------------------------- an old wildcard stream


async def _old_wildcard_stream(nc: Any, name: str, partitions: int = 4) -> str:
    """Create ``name`` as provision did before the explicit list: subjects ``<prefix>.p.*``,
    the same metadata. Returns the prefix."""
    spec = StreamSpec(name, partitions=partitions)
    cfg = spec.stream_config()
    cfg.subjects = [partition_wildcard(spec.prefix)]
    await nc.jetstream().add_stream(cfg)
    await GroupStore.open(nc, GroupConfig(name, "g"))  # as the first member does
    return spec.prefix


def test_strays_of_an_old_stream_are_reported_fail_a_drain_until_provision_narrows_and_purges(
    shared_nats_server: Any, unique_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url, name = shared_nats_server.url, unique_name
    conn = ("--server", url)

    async def setup(nc: Any) -> dict[str, str]:
        prefix = await _old_wildcard_stream(nc, name)
        for i in range(18):
            assert await _foreign_publish(nc, f"{prefix}.p.{i % 4}") == "ack"
        # the old stream takes everything under <prefix>.p.*, and acks it
        return {s: await _foreign_publish(nc, prefix + s) for s in STRAYS}

    assert run(_with_nc(url, setup)) == dict.fromkeys(STRAYS, "ack")
    prefix = name.lower()
    stray_subjects = {f"{prefix}.p.00": 1, f"{prefix}.p.4": 1, f"{prefix}.p.99": 1}
    stray_subjects[f"{prefix}.p.x"] = 1

    # info counts every message: 18 in the partitions and the 4 strays, each named
    rc, out, err = _cli(capsys, "info", "--stream", name, "--json", *conn)
    assert rc == 0, err
    info = json.loads(out)
    assert info["messages"] == 22 and info["explicit_subjects"] is False
    assert sum(p["messages"] for p in info["partition_stats"]) == 18
    assert info["strays"]["messages"] == 4 and info["strays"]["subjects"] == stray_subjects
    assert (
        f"nats-ordered provision --stream {name} --partitions 4 --purge-strays"
        in (info["strays"]["purge"])
    )
    rc, out, _ = _cli(capsys, "info", "--stream", name, *conn)
    assert rc == 0 and f"stray  {prefix}.p.x" in out and "problem: stream" in out
    assert "narrows it to" in out

    # status: reported, a problem, not drained; a drain wait fails naming them
    rc, out, err = _cli(capsys, "status", "--stream", name, "--group", "g", "--json", *conn)
    assert rc == 0, err
    st = json.loads(out)
    assert st["strays"]["messages"] == 4 and st["strays"]["subjects"] == stray_subjects
    assert st["drained"] is False
    assert any("4 stray message(s)" in p and "--purge-strays" in p for p in st["problems"])
    rc, out, err = _cli(
        capsys, "status", "--stream", name, "--group", "g", "--wait-drained", "--timeout",
        "60", *conn,
    )  # fmt: skip
    assert rc == 3, err
    assert f"error: stream {name} holds 4 stray message(s)" in err
    assert f"{prefix}.p.x (1)" in err and "--purge-strays" in err

    async def drain(nc: Any) -> None:
        await wait_drained(nc, name, "g", marks={0: 1}, timeout=60)

    with pytest.raises(StrayMessagesError, match=rf"{prefix}\.p\.99 \(1\)") as caught:
        run(_with_nc(url, drain))
    assert caught.value.strays.accepting  # the message says provision narrows it
    assert "narrows it" in str(caught.value)

    # provision narrows it in place and says so; the strays stay, reported
    rc, out, err = _cli(capsys, "provision", "--stream", name, "--partitions", "4", *conn)
    assert rc == 0, err
    assert out.startswith(
        f"updated stream {name}: subjects: {prefix}.p.* -> {prefix}.p.0 to {prefix}.p.3 "
        "(narrowed: the server now refuses publishes to any other subject)"
    )
    assert "problem: stream" in out and "stored before the stream's subjects were narrowed" in out

    async def after(nc: Any) -> dict[str, str]:
        return {s: await _foreign_publish(nc, prefix + s) for s in (*STRAYS, ".p.2")}

    assert run(_with_nc(url, after)) == dict.fromkeys(STRAYS, "refused") | {".p.2": "ack"}
    rc, out, _ = _cli(capsys, "info", "--stream", name, "--json", *conn)
    info = json.loads(out)
    assert info["messages"] == 23 and info["explicit_subjects"] is True
    assert info["strays"]["subjects"] == stray_subjects

    rc, out, err = _cli(
        capsys, "provision", "--stream", name, "--partitions", "4", "--json", *conn
    )  # fmt: skip
    res = json.loads(out)
    assert res["action"] == "unchanged" and res["narrowed"] is False
    assert res["strays"] == {"messages": 4, "subjects": stray_subjects, "purged": 0}

    # purging removes exactly the strays; the partitions keep every message
    rc, out, err = _cli(
        capsys, "provision", "--stream", name, "--partitions", "4", "--purge-strays", *conn
    )  # fmt: skip
    assert rc == 0, err
    assert f"purged 4 stray message(s) from 4 subject(s): {prefix}.p.00" in out
    rc, out, _ = _cli(capsys, "status", "--stream", name, "--group", "g", "--json", *conn)
    st = json.loads(out)
    assert st["strays"] == {"messages": 0, "subjects": {}, "purge": []}
    assert not any("stray" in p for p in st["problems"])
    rc, out, _ = _cli(capsys, "info", "--stream", name, "--json", *conn)
    assert json.loads(out)["messages"] == 19


def test_a_stray_arriving_during_a_wait_on_an_old_stream_fails_it(
    shared_nats_server: Any, unique_name: str
) -> None:
    """An unmigrated stream keeps working (the wait starts and waits), and a stray that
    lands while it waits fails it instead of a 'drained' that leaves the stray unread."""
    url = shared_nats_server.url

    async def go(nc: Any) -> None:
        prefix = await _old_wildcard_stream(nc, unique_name)
        assert await _foreign_publish(nc, f"{prefix}.p.1") == "ack"
        waiting = asyncio.create_task(wait_drained(nc, unique_name, "g", timeout=60))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # waits for partition 1: nothing consumes it
        assert await _foreign_publish(nc, f"{prefix}.p.7") == "ack"
        await waiting

    with pytest.raises(StrayMessagesError, match=rf"{unique_name.lower()}\.p\.7 \(1\)"):
        run(_with_nc(url, go))


def test_provision_refuses_to_drop_subjects_that_are_not_partitions(
    shared_nats_server: Any, unique_name: str
) -> None:
    async def go(nc: Any) -> None:
        spec = StreamSpec(unique_name, partitions=2)
        cfg = spec.stream_config()
        cfg.subjects = [partition_wildcard(spec.prefix), f"{spec.prefix}.audit"]
        await nc.jetstream().add_stream(cfg)
        assert (await describe(nc, unique_name)).explicit_subjects is False
        await provision(nc, spec)

    with pytest.raises(StreamConflictError, match=rf"{unique_name.lower()}\.audit.*run it again"):
        run(_with_nc(shared_nats_server.url, go))


def test_the_drain_trigger_fails_on_strays_naming_them(
    shared_nats_server: Any, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deferred sensor's wait (the trigger, in the triggerer) ends with an error event
    that names the strays, which the sensor turns into a task failure."""
    from airflow_dags import nats_connection

    from airflow_nats_ordered.triggers.drain import NatsGroupDrainTrigger

    url = shared_nats_server.url
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(url))

    async def setup(nc: Any) -> None:
        prefix = await _old_wildcard_stream(nc, unique_name)
        assert await _foreign_publish(nc, f"{prefix}.p.0") == "ack"
        assert await _foreign_publish(nc, f"{prefix}.p.4") == "ack"

    async def events() -> list[Any]:
        trigger = NatsGroupDrainTrigger(stream=unique_name, group="g", marks={"0": 1}, timeout=60)
        return [e async for e in trigger.run()]

    run(_with_nc(url, setup))
    (event,) = run(events())
    assert event.payload["status"] == "error", event.payload
    assert f"{unique_name.lower()}.p.4 (1)" in event.payload["message"]
    assert "--purge-strays" in event.payload["message"]


def test_a_poking_drain_sensor_fails_on_strays_instead_of_succeeding(
    shared_nats_server: Any, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``deferrable=False`` the sensor decides in its own poke: a stream holding strays
    is never drained, even when every partition already reached its mark."""
    from airflow.exceptions import AirflowFailException
    from airflow_dags import nats_connection

    from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

    url = shared_nats_server.url
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection(url))

    async def setup(nc: Any) -> None:
        prefix = await _old_wildcard_stream(nc, unique_name)
        assert await _foreign_publish(nc, f"{prefix}.p.4") == "ack"

    run(_with_nc(url, setup))
    sensor = NatsGroupDrainSensor(
        task_id="drained", stream=unique_name, group="g", high_water_marks={}, deferrable=False
    )
    with pytest.raises(AirflowFailException, match=rf"{unique_name.lower()}\.p\.4"):
        sensor.poke({})


def test_a_members_metrics_count_strays_and_do_not_say_drained(
    shared_nats_server: Any, unique_name: str
) -> None:
    """The member's ``/metrics`` (what dashboards and alerts read) agree with ``status``: a
    stray message is counted and the group is not drained while it is there."""
    import urllib.request

    from airflow_nats_ordered.core.worker.config import WorkerConfig
    from airflow_nats_ordered.core.worker.worker import Worker
    from airflow_nats_ordered.embedded.process import free_port
    from airflow_nats_ordered.members.metrics import serve_member

    port = free_port()

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("nats_ordered_group_"):
                name, _, value = line.rpartition(" ")
                out[name.split("{")[0]] = float(value)
        return out

    async def go(nc: Any) -> dict[str, float]:
        prefix = await _old_wildcard_stream(nc, unique_name)
        for p in range(4):
            assert await _foreign_publish(nc, f"{prefix}.p.{p}") == "ack"
        assert await _foreign_publish(nc, f"{prefix}.p.99") == "ack"
        w = Worker(nc, WorkerConfig(unique_name, "g", lease_ttl=5.0), lambda m: None)
        await w.start()
        server, metrics = serve_member(w, nc, port, "127.0.0.1")
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                s = await asyncio.to_thread(scrape)
                if s.get("nats_ordered_group_lag") == 0:
                    return s
                assert asyncio.get_running_loop().time() < deadline, s
                await asyncio.sleep(0.2)
        finally:
            server.close()
            await w.stop()

    s = run(_with_nc(shared_nats_server.url, go))
    assert s["nats_ordered_group_drained"] == 0, s
    assert s["nats_ordered_group_strays"] == 1, s
