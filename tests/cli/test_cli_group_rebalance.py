"""`nats-ordered group rebalance` against a real server and a running pool: cordoning a
member moves its partitions to the other and waits until they are held there; the next
rebalance without it gives it a share back; a group nobody runs is named, not waited on."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


def _cfg(stream):
    return WorkerConfig(stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.1)


def _json(capsys, args):
    capsys.readouterr()
    code = cli(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


async def _owners(nc, stream):
    snap = await (await GroupStore.attach(nc, stream, "g")).snapshot()
    return {p: m for p, (m, _) in snap.leases.items()}


def test_group_rebalance_cordons_a_member_and_gives_it_back_a_share(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    conn = ["--stream", unique_name, "--group", "g", "--server", url]
    assert cli(["provision", "--stream", unique_name, "--partitions", "4", "--server", url]) == 0

    async def scenario():
        nc = await nats.connect(url)
        async with WorkerPool(url, _cfg(unique_name), lambda m: None, size=2) as pool:
            await pool.wait_assigned(60)
            assert sorted(pool.members) == ["m-1", "m-2"]
            cordoned = await asyncio.to_thread(
                _json,
                capsys,
                ["group", "rebalance", *conn, "--cordon", "m-1", "--timeout", "60s", "--json"],
            )
            after_cordon = await _owners(nc, unique_name)
            back = await asyncio.to_thread(
                _json, capsys, ["group", "rebalance", *conn, "--timeout", "60s", "--json"]
            )
            after_back = await _owners(nc, unique_name)
        await nc.close()
        return cordoned, after_cordon, back, after_back

    cordoned, after_cordon, back, after_back = asyncio.run(scenario())
    assert set(cordoned["owners"].values()) == {"m-2"}
    assert after_cordon == {p: "m-2" for p in range(4)}  # settled: held by the new owner
    assert all(move["from"] == "m-1" for move in cordoned["moves"].values())
    assert sorted(after_back.values()) == ["m-1", "m-1", "m-2", "m-2"]
    assert len(back["moves"]) == 2  # only the cordoned member's share moves back


def test_group_rebalance_of_an_unknown_group_is_named(shared_nats_server, unique_name, capsys):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "1", "--server", url]) == 0
    capsys.readouterr()
    code = cli(["group", "rebalance", "--stream", unique_name, "--group", "g", "--server", url])
    assert code == 2
    assert f"group g of stream {unique_name} does not exist" in capsys.readouterr().err


def test_group_rebalance_refuses_a_cordon_of_a_member_the_group_does_not_know(
    shared_nats_server, unique_name, capsys
):
    """Issue 30: `--cordon worker-2` on a group of m-1, m-2 printed "0 partition(s) moved"
    and exited 0; the id is refused, naming the members to choose from."""
    url = shared_nats_server.url
    conn = ["--stream", unique_name, "--group", "g", "--server", url]
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0

    async def scenario():
        async with WorkerPool(url, _cfg(unique_name), lambda m: None, size=2) as pool:
            await pool.wait_assigned(60)
            capsys.readouterr()
            code = await asyncio.to_thread(
                cli, ["group", "rebalance", *conn, "--cordon", "worker-2", "--timeout", "60s"]
            )
        return code, capsys.readouterr()

    code, out = asyncio.run(scenario())
    assert code == 2, out
    assert "cordon names member(s) the group does not know: worker-2" in out.err, out.err
    assert "live members are m-1, m-2" in out.err, out.err
