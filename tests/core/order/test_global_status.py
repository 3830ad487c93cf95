"""`status`, `group list` and drains of a global-order reader's group (issue 18 part 1): the
reader keeps its position in key ``global`` of the group's state bucket, not in per-partition
commit records, and its heartbeat in key ``global`` of the lease bucket. Real shared server."""

from __future__ import annotations

import asyncio
import json

import nats

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.admin.marks import DrainProgress
from airflow_nats_ordered.core.order.reader import GlobalMessage, GlobalOrderReader
from airflow_nats_ordered.core.order.watermarks import GlobalOrder
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision

WAIT = 60.0


async def _publish(nc, stream: str, n: int, start: int = 0) -> None:
    async with OrderedPublisher(nc, stream, global_order=GlobalOrder()) as pub:
        for i in range(start, start + n):
            await pub.publish(f"key-{i % 7}", b"%d" % i)


async def _until(cond, what: str) -> None:
    async with asyncio.timeout(WAIT):
        while not cond():
            await asyncio.sleep(0.02)


def _status(url: str, stream: str, group: str, capsys, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli(["status", "--stream", stream, "--group", group, "--json", *extra, "--server", url])
    return code, json.loads(capsys.readouterr().out)


def test_status_and_group_list_show_a_stopped_global_readers_lag(nats_url, unique_name, capsys):
    """30 records handed over and the reader stopped: no lag, drained, each partition at its
    last sequence; 10 more published: behind (lag at least 10), not drained."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3))
            await _publish(nc, unique_name, 30)
            got: list[GlobalMessage] = []
            reader = GlobalOrderReader(nc, unique_name, "ledger", got.append)
            await reader.start()
            await _until(lambda: len(got) == 30, "30 records")
            await reader.stop()
            return got[-1].global_seq
        finally:
            await nc.close()

    last_g = asyncio.run(go())
    code, out = _status(nats_url, unique_name, "ledger", capsys)
    assert code == 0
    assert out["total_lag"] == 0 and out["drained"] is True, out
    assert all(p["committed"] == p["last"] > 0 for p in out["partitions"]), out["partitions"]
    glob = out["global_order"]
    assert glob["position"] == last_g and glob["late"] == 0 and glob["reader"] is None
    assert glob["fencing_token"] > 0
    capsys.readouterr()
    assert cli(["group", "list", "--stream", unique_name, "--json", "--server", nats_url]) == 0
    (summary,) = json.loads(capsys.readouterr().out)["groups"]
    assert (summary["group"], summary["total_lag"], summary["drained"]) == ("ledger", 0, True)

    async def more():
        nc = await nats.connect(nats_url)
        try:
            await _publish(nc, unique_name, 10, start=30)
        finally:
            await nc.close()

    asyncio.run(more())
    code, out = _status(nats_url, unique_name, "ledger", capsys)
    # lag is an upper bound (stream sequences are shared by all partitions): at least the 10
    assert 10 <= out["total_lag"] <= 40 and out["drained"] is False, out
    # the table says the same, with the reader's position
    capsys.readouterr()
    assert cli(["status", "--stream", unique_name, "--group", "ledger", "--server", nats_url]) == 0
    text = capsys.readouterr().out
    assert f"global order: position {last_g}" in text and "no reader running" in text, text
    assert f"lag {out['total_lag']}" in text, text


def test_wait_drained_follows_a_running_global_reader(nats_url, unique_name, capsys):
    """A drain started while the reader is held back sees it behind, then done once the
    reader has handed everything over; the running reader is the group's live member (no
    per-key worker exists, so without its heartbeat a no-members bound would end the wait),
    shown as the owner of every partition; `status --wait-drained` exits 0, drained."""

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=3))
            await _publish(nc, unique_name, 24)
            gate = asyncio.Event()
            got: list[int] = []

            async def handle(msg: GlobalMessage) -> None:
                await gate.wait()
                got.append(int(msg.data))

            reader = GlobalOrderReader(
                nc, unique_name, "ledger", handle, commit_every=5, member_id="merger"
            )
            await reader.start()
            seen: list[DrainProgress] = []

            def progress(p: DrainProgress) -> None:
                seen.append(p)
                if not p.done:
                    gate.set()  # the wait saw the group behind: let the reader go

            done = await wait_drained(
                nc,
                unique_name,
                "ledger",
                timeout=WAIT,
                no_members_timeout=WAIT,
                on_progress=progress,
            )
            assert seen and not seen[0].done  # it did wait
            assert done.done and got == list(range(24))
            lag = await read_lag(nc, unique_name, "ledger")
            assert (lag.total_lag, lag.drained) == (0, True)

            # the CLI, in a thread, while the reader still runs: a no-members bound shorter
            # than the test's wait holds because the reader's heartbeat is a live member
            args = ["--wait-drained", "--no-members-timeout", "20s", "--timeout", "60s"]
            loop = asyncio.get_running_loop()
            code, out = await loop.run_in_executor(
                None, lambda: _status(nats_url, unique_name, "ledger", capsys, *args)
            )
            await reader.stop()
            return code, out
        finally:
            await nc.close()

    code, out = asyncio.run(go())
    assert code == 0 and out["drained"] is True, out
    assert [m["member"] for m in out["members"]] == ["merger"], out["members"]
    assert out["members"][0]["partitions"] == [0, 1, 2]
    assert {p["owner"] for p in out["partitions"]} == {"merger"}
    assert out["global_order"]["reader"] == "merger"


def test_a_running_global_reader_is_a_live_member_and_keeps_its_group_from_deletion(
    nats_url, unique_name
):
    """A drain's no-members check and `group delete` (without --force) look for live
    members: a running global-order reader is one (it was ignored: its group could be
    deleted under it without --force)."""
    from airflow_nats_ordered.core.admin.delete import GroupInUseError, delete_group
    from airflow_nats_ordered.core.admin.membership import live_members

    async def go():
        nc = await nats.connect(nats_url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=2))
            await _publish(nc, unique_name, 5)
            got: list[GlobalMessage] = []
            reader = GlobalOrderReader(nc, unique_name, "ledger", got.append, member_id="r1")
            await reader.start()
            try:
                await _until(lambda: len(got) == 5, "5 records")
                async with asyncio.timeout(WAIT):
                    while "r1" not in await live_members(nc, unique_name, "ledger"):
                        await asyncio.sleep(0.05)
                try:
                    await delete_group(nc, unique_name, "ledger")
                except GroupInUseError as exc:
                    refused = str(exc)
                else:
                    refused = None
            finally:
                await reader.stop()
            return refused, await live_members(nc, unique_name, "ledger")
        finally:
            await nc.close()

    refused, after = asyncio.run(go())
    assert refused is not None and "r1" in refused, refused
    assert after == [], "a stopped reader is no longer a live member"
