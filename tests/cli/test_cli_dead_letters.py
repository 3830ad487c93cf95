"""`nats-ordered dead-letters list|show|replay|purge` against a real server and a real
worker: records a handler rejected and a misrouted record are listed, shown, replayed
(into their partition, handled by the worker once it is fixed, stored once however often
the replay runs) and purged."""

from __future__ import annotations

import asyncio
import json

import nats
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.core.stream.partitioning import partition_for
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

N = 20
MISROUTED_KEY = "k-misrouted"


def _cfg(stream):
    return WorkerConfig(
        stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.2, max_retries=0
    )


class _Handler:
    """Rejects every fifth record while ``broken``; records what it handled."""

    def __init__(self):
        self.broken = True
        self.seen: list[tuple[int, dict]] = []

    def __call__(self, msg):
        i = json.loads(msg.data)["i"]
        if self.broken and i % 5 == 0:
            raise RuntimeError(f"cannot handle record {i}")
        self.seen.append((i, dict(msg.headers)))


async def _dlq_count(nc, stream):
    info = await nc.jetstream().stream_info(f"{stream}_DLQ", subjects_filter=">")
    return sum((info.state.subjects or {}).values())


async def _messages(nc, stream):
    return (await nc.jetstream().stream_info(stream)).state.messages


def _json(capsys, args):
    capsys.readouterr()
    code = cli(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_dead_letters_list_show_replay_purge(shared_nats_server, unique_name, tmp_path, capsys):
    url = shared_nats_server.url
    s = unique_name
    conn = ["--stream", s, "--group", "g", "--server", url]
    rows = write_jsonl(tmp_path / "rows.jsonl", ({"k": f"k{i % 7}", "i": i} for i in range(N)))
    assert cli(["provision", "--stream", s, "--partitions", "2", "--server", url]) == 0
    assert cli(["publish", "--stream", s, str(rows), "--key-field", "k", "--server", url]) == 0
    handler = _Handler()

    async def scenario():
        nc = await nats.connect(url)
        described = await describe(nc, s)
        home = partition_for(MISROUTED_KEY, 2)
        # a foreign client routed this record to the other partition
        await nc.jetstream().publish(
            described.subject(1 - home),
            json.dumps({"i": 1001}).encode(),
            headers={"Nats-Ordered-Key": MISROUTED_KEY, "Nats-Msg-Id": "foreign-1"},
        )
        async with WorkerPool(url, _cfg(s), handler, size=1):
            await wait_drained(nc, s, "g", timeout=60)
            assert await _dlq_count(nc, s) == N // 5 + 1

            listed = await asyncio.to_thread(
                _json, capsys, ["dead-letters", "list", *conn, "--json"]
            )
            letters = listed["dead_letters"]
            # listed in the dead-letter stream's order; partitions are handled concurrently, so
            # only each partition's letters follow their stream order
            assert [x["seq"] for x in letters] == sorted(x["seq"] for x in letters)
            for p in {x["partition"] for x in letters}:
                origins = [x["origin_seq"] for x in letters if x["partition"] == p]
                assert origins == sorted(origins), (p, origins)
            reasons = {x["key"]: x["reason"] for x in letters}
            assert reasons[MISROUTED_KEY].startswith("misrouted: key 'k-misrouted' hashes to")
            assert sum("cannot handle record" in r for r in reasons.values()) == N // 5
            mis = next(x for x in letters if x["key"] == MISROUTED_KEY)
            assert mis["partition"] == 1 - home

            capsys.readouterr()
            assert await asyncio.to_thread(cli, ["dead-letters", "list", *conn]) == 0
            table = capsys.readouterr().out
            assert table.splitlines()[0].split() == [
                "seq",
                "partition",
                "origin",
                "seq",
                "key",
                "reason",
                "time",
            ]
            assert f"{N // 5 + 1} dead letter(s) of group g in {s}_DLQ" in table

            assert (
                await asyncio.to_thread(cli, ["dead-letters", "show", str(mis["seq"]), *conn]) == 0
            )
            shown = capsys.readouterr().out
            assert "Nats-Ordered-Error: misrouted" in shown and '{"i": 1001}' in shown
            assert "Nats-Ordered-Origin: " in shown and "Nats-Msg-Id: g:foreign-1" in shown

            assert await asyncio.to_thread(cli, ["dead-letters", "show", "999999", *conn]) == 2
            assert "no dead letter of group g at sequence 999999" in capsys.readouterr().err

            # a dry run publishes nothing
            before = await _messages(nc, s)
            plan = await asyncio.to_thread(
                _json, capsys, ["dead-letters", "replay", *conn, "--dry-run", "--json"]
            )
            assert {r["outcome"] for r in plan["replays"]} == {"planned"}
            assert await _messages(nc, s) == before
            to_home = next(r for r in plan["replays"] if r["key"] == MISROUTED_KEY)
            assert to_home["subject"] == described.subject(home)  # its key's partition

            # the handler is fixed: the replayed records are handled, in their partition
            handler.broken = False
            seen_before = len(handler.seen)
            done = await asyncio.to_thread(
                _json, capsys, ["dead-letters", "replay", *conn, "--json"]
            )
            assert [r["outcome"] for r in done["replays"]] == ["stored"] * (N // 5 + 1)
            assert await _messages(nc, s) == before + N // 5 + 1
            await wait_drained(nc, s, "g", timeout=60)
            replayed = handler.seen[seen_before:]
            assert sorted(i for i, _ in replayed) == [*range(0, N, 5), 1001]
            for _, headers in replayed:
                assert headers["Nats-Msg-Id"].startswith("replay-")
                assert "Nats-Ordered-Error" not in headers and "Nats-Ordered-Seq" not in headers
                assert json.loads(headers["Nats-Ordered-Replay-Of"])["group"] == "g"
            assert await _dlq_count(nc, s) == N // 5 + 1  # kept: --purge not given

            # a second replay inside the duplicate window stores nothing again
            again = await asyncio.to_thread(
                _json, capsys, ["dead-letters", "replay", *conn, "--json"]
            )
            assert {r["outcome"] for r in again["replays"]} == {"duplicate"}
            assert await _messages(nc, s) == before + N // 5 + 1

            # purge: a selection is required; a dry run removes nothing; then one, then all
            capsys.readouterr()
            assert await asyncio.to_thread(cli, ["dead-letters", "purge", *conn]) == 2
            assert "one of the arguments --seq --partitions --all is required" in (
                capsys.readouterr().err
            )
            one = str(letters[0]["seq"])
            dry = await asyncio.to_thread(
                _json, capsys, ["dead-letters", "purge", *conn, "--seq", one, "--dry-run", "--json"]
            )
            assert dry["would_purge"] == [int(one)] and await _dlq_count(nc, s) == N // 5 + 1
            gone = await asyncio.to_thread(
                _json, capsys, ["dead-letters", "purge", *conn, "--seq", one, "--json"]
            )
            assert gone["purged"] == [int(one)] and await _dlq_count(nc, s) == N // 5
            rest = await asyncio.to_thread(
                _json, capsys, ["dead-letters", "purge", *conn, "--all", "--json"]
            )
            assert len(rest["purged"]) == N // 5 and await _dlq_count(nc, s) == 0

            capsys.readouterr()
            assert await asyncio.to_thread(cli, ["dead-letters", "replay", *conn]) == 0
            assert "nothing to replay: group g has no dead letters" in capsys.readouterr().out
        await nc.close()

    asyncio.run(scenario())


def test_dead_letters_of_an_unknown_group_name_the_groups_there_are(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "1", "--server", url]) == 0

    async def with_group():
        async with WorkerPool(url, _cfg(unique_name), lambda m: None, size=1) as pool:
            await pool.wait_assigned(60)

    asyncio.run(with_group())
    capsys.readouterr()
    code = cli(
        ["dead-letters", "list", "--stream", unique_name, "--group", "nope", "--server", url]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"group nope of stream {unique_name} does not exist" in err
    assert f"groups of {unique_name}: g" in err


def test_a_dead_letter_that_cannot_be_routed_is_refused_unless_given_a_subject(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    s, hold = unique_name, f"{unique_name}_HOLD"
    conn = ["--stream", s, "--group", "g", "--server", url]
    assert cli(["provision", "--stream", s, "--partitions", "2", "--server", url]) == 0

    async def scenario():
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name=hold, subjects=[f"{hold}.>"])
        described = await describe(nc, s)
        await js.publish(described.subject(0), b'{"i": 7}', headers={"Nats-Ordered-Key-B64": "%%%"})
        async with WorkerPool(url, _cfg(s), lambda m: None, size=1):
            await wait_drained(nc, s, "g", timeout=60)
            assert await _dlq_count(nc, s) == 1
            before = await _messages(nc, s)
            capsys.readouterr()
            code = await asyncio.to_thread(cli, ["dead-letters", "replay", *conn])
            err = capsys.readouterr().err
            assert code == 2 and "cannot be routed: malformed key" in err and "--subject" in err
            code = await asyncio.to_thread(
                cli, ["dead-letters", "replay", *conn, "--subject", described.subject(1)]
            )
            err = capsys.readouterr().err
            assert code == 2 and "cannot be routed" in err  # a partition subject is no way out
            assert await _messages(nc, s) == before  # nothing was published
            done = await asyncio.to_thread(
                _json,
                capsys,
                ["dead-letters", "replay", *conn, "--subject", f"{hold}.x", "--purge", "--json"],
            )
            assert [r["outcome"] for r in done["replays"]] == ["stored"]
            held = await js.get_msg(hold, seq=1)
            assert held.data == b'{"i": 7}' and held.headers["Nats-Ordered-Key-B64"] == "%%%"
            assert await _dlq_count(nc, s) == 0  # --purge: removed once stored
        await nc.close()

    asyncio.run(scenario())
