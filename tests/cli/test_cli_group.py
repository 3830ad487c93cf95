"""`nats-ordered group delete` as an operator runs it, against a real server and workers."""

from __future__ import annotations

import asyncio
import json

import nats
from nats.js.errors import NotFoundError
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

N = 100


def _rejects_every_tenth(msg):
    if json.loads(msg.data)["i"] % 10 == 0:
        raise RuntimeError("rejected")


def _cfg(stream):
    return WorkerConfig(
        stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2, max_retries=0
    )


async def _streams(url):
    nc = await nats.connect(url)
    names = []
    for info in await nc.jetstream().streams_info():
        names.append(info.config.name)
    await nc.close()
    return names


def test_group_delete_refuses_live_members_then_removes_state_and_dead_letters_on_request(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    rows = write_jsonl(tmp_path / "rows.jsonl", ({"k": f"k{i % 7}", "i": i} for i in range(N)))
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    assert (
        cli(["publish", "--stream", unique_name, str(rows), "--key-field", "k", "--server", url])
        == 0
    )
    delete = ["group", "delete", "--stream", unique_name, "--group", "g", "--server", url]

    async def with_a_live_member():
        async with WorkerPool(url, _cfg(unique_name), _rejects_every_tenth, size=1):
            nc = await nats.connect(url)
            await wait_drained(nc, unique_name, "g", timeout=30)
            await nc.close()
            return await asyncio.to_thread(cli, delete)

    capsys.readouterr()
    assert asyncio.run(with_a_live_member()) == 1
    err = capsys.readouterr().err
    assert "has 1 live member(s): m-1" in err and "--force" in err
    assert "force=True" not in err  # the CLI's own flag, not the Python parameter

    assert cli(["status", "--stream", unique_name, "--group", "g", "--server", url]) == 0
    dlq = f"{unique_name}_DLQ"
    assert f"dead letters: {N // 10} in stream {dlq}" in capsys.readouterr().out

    assert cli([*delete, "--json"]) == 0  # the member left: no --force needed
    done = json.loads(capsys.readouterr().out)
    assert done["buckets_deleted"] == [f"nor_{unique_name}_g_leases", f"nor_{unique_name}_g_state"]
    assert done["dead_letters_purged"] == 0 and not done["dead_letter_stream_deleted"]
    assert dlq in asyncio.run(_streams(url))  # kept: not asked for

    assert cli(delete) == 2  # nothing left to delete
    assert "does not exist" in capsys.readouterr().err

    # the dead letters outlive the group until asked for; then the empty stream goes too
    assert cli([*delete, "--dead-letters"]) == 0
    out = capsys.readouterr().out
    assert f"dead letters: {N // 10} purged, dead-letter stream deleted (it was empty)" in out
    assert dlq not in asyncio.run(_streams(url))


def test_group_delete_force_removes_a_group_under_a_live_member(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    delete = ["group", "delete", "--stream", unique_name, "--group", "g", "--server", url]

    async def forced():
        async with WorkerPool(url, _cfg(unique_name), lambda m: None, size=1):
            code = await asyncio.to_thread(cli, [*delete, "--force"])
            nc = await nats.connect(url)
            try:
                await nc.jetstream().key_value(f"nor_{unique_name}_g_state")
                exists = True
            except NotFoundError:
                exists = False
            await nc.close()
            return code, exists

    capsys.readouterr()
    code, exists = asyncio.run(forced())
    out, err = capsys.readouterr()
    assert code == 0 and not exists
    assert "deleted group g of" in out and "warning: deleted under 1 live member(s) (m-1)" in err
    assert "dead letters kept (pass --dead-letters to purge them)" in out


def test_group_delete_refuses_a_malformed_group_name_before_connecting(capsys):
    code = cli(["group", "delete", "--stream", "S", "--group", "a.b", "--server", "nats://x:1"])
    assert code == 2 and "argument --group: 'a.b' is not a group name" in capsys.readouterr().err
