"""`nats-ordered group reset` (Kafka's --reset-offsets) and `group describe` against a real
server and a real worker: a dry run by default that changes nothing, --execute under a
running member re-processes, and seq:/time: targets put each partition where they say."""

from __future__ import annotations

import asyncio
import json

import nats
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.admin.drain import read_lag, wait_drained
from airflow_nats_ordered.core.stream.partitioned import describe
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

N = 30


def _cfg(stream):
    return WorkerConfig(stream, "g", member_id="m", lease_ttl=2.0, commit_interval=0.1)


def _run(capsys, args):
    capsys.readouterr()
    code = cli(args)
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, args):
    code, out, err = _run(capsys, args)
    assert code == 0, err
    return json.loads(out)


async def _partition_messages(nc, stream):
    """Per partition, [(seq, time)] of every message, read from the stream."""
    described = await describe(nc, stream)
    js = nc.jetstream()
    out = {}
    for p in range(described.partitions):
        found, seq = [], 1
        while True:
            try:
                m = await js.get_msg(stream, seq=seq, subject=described.subject(p), next=True)
            except nats.js.errors.NotFoundError:
                break
            found.append((m.seq, m.time))
            seq = m.seq + 1
        out[p] = found
    return out


def test_group_reset_dry_run_then_execute_under_a_live_member(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    s = unique_name
    conn = ["--stream", s, "--group", "g", "--server", url]
    rows = write_jsonl(tmp_path / "rows.jsonl", ({"k": f"k{i % 7}", "i": i} for i in range(N)))
    assert cli(["provision", "--stream", s, "--partitions", "2", "--server", url]) == 0
    assert cli(["publish", "--stream", s, str(rows), "--key-field", "k", "--server", url]) == 0
    seen: list[int] = []

    async def scenario():
        nc = await nats.connect(url)
        msgs = await _partition_messages(nc, s)
        async with WorkerPool(url, _cfg(s), lambda m: seen.append(json.loads(m.data)["i"]), size=1):
            await wait_drained(nc, s, "g", timeout=60)
            assert sorted(seen) == list(range(N))

            # dry run (the default): a table of the plan, nothing changed
            code, out, _ = await asyncio.to_thread(
                _run, capsys, ["group", "reset", *conn, "--to", "earliest"]
            )
            assert code == 0
            lines = out.splitlines()
            assert lines[0].split() == [
                "partition",
                "owner",
                "committed",
                "new",
                "lag",
                "before",
                "lag",
                "after",
            ]
            assert "dry run: nothing changed; pass --execute to apply" in out
            assert "1 live member(s) (m-1): --execute fences them" in out
            assert (await read_lag(nc, s, "g")).drained

            plan = await asyncio.to_thread(
                _json, capsys, ["group", "reset", *conn, "--to", "earliest", "--json"]
            )
            assert not plan["executed"] and plan["live_members"] == ["m-1"]
            for row in plan["partitions"]:
                p = row["partition"]
                assert row["committed"] == msgs[p][-1][0] and row["lag_before"] == 0
                assert row["new"] == msgs[p][0][0] - 1 and row["lag_after"] == len(msgs[p])

            # one stream sequence for every partition: each resumes after it
            middle = msgs[0][len(msgs[0]) // 2][0]
            at_seq = await asyncio.to_thread(
                _json, capsys, ["group", "reset", *conn, "--to", f"seq:{middle}", "--json"]
            )
            assert {r["partition"]: r["new"] for r in at_seq["partitions"]} == {
                p: min(middle, m[-1][0]) for p, m in msgs.items()
            }

            # a time: each partition resumes with its first message stored at or after it
            when = msgs[1][len(msgs[1]) // 2][1]
            at_time = await asyncio.to_thread(
                _json,
                capsys,
                ["group", "reset", *conn, "--to", f"time:{when.isoformat()}", "--json"],
            )
            expected = {}
            for p, m in msgs.items():
                later = [seq for seq, t in m if t >= when]
                expected[p] = later[0] - 1 if later else m[-1][0]
            assert {r["partition"]: r["new"] for r in at_time["partitions"]} == expected

            only = await asyncio.to_thread(
                _json,
                capsys,
                ["group", "reset", *conn, "--to", "latest", "--partitions", "1", "--json"],
            )
            assert [r["partition"] for r in only["partitions"]] == [1]

            # bad targets: exit 2, nothing changed
            code, _, err = await asyncio.to_thread(
                _run, capsys, ["group", "reset", *conn, "--to", "earliest", "--partitions", "5"]
            )
            assert code == 2 and "partitions 0 to 1; [5] do not exist" in err
            code, _, err = await asyncio.to_thread(
                _run, capsys, ["group", "reset", *conn, "--to", "seq:99999"]
            )
            assert code == 2 and "sequence 99999 is not a position of stream" in err
            code, _, err = await asyncio.to_thread(
                _run, capsys, ["group", "reset", *conn, "--to", "yesterday"]
            )
            assert code == 2 and "invalid --to 'yesterday'" in err
            assert len(seen) == N  # nothing was re-processed

            # --execute under the running member: fenced, the partition claimed again from
            # the new position, everything re-processed once more, in per-key order
            done = await asyncio.to_thread(
                _json, capsys, ["group", "reset", *conn, "--to", "earliest", "--execute", "--json"]
            )
            assert done["executed"]
            await wait_drained(nc, s, "g", timeout=60)
            again = seen[N:]
            assert sorted(set(again)) == list(range(N))
            for k in range(7):
                of_key = [i for i in again if i % 7 == k]
                assert list(dict.fromkeys(of_key)) == sorted(set(of_key))

            # describe is status
            code, out, _ = await asyncio.to_thread(_run, capsys, ["group", "describe", *conn])
            assert code == 0 and out.splitlines()[0].split()[:3] == ["partition", "owner", "token"]
        await nc.close()

    asyncio.run(scenario())


def test_group_reset_of_an_unknown_group_names_the_groups_there_are(
    shared_nats_server, unique_name, capsys
):
    url = shared_nats_server.url
    assert cli(["provision", "--stream", unique_name, "--partitions", "1", "--server", url]) == 0
    code, _, err = _run(
        capsys,
        [
            "group",
            "reset",
            "--stream",
            unique_name,
            "--group",
            "nope",
            "--to",
            "latest",
            "--server",
            url,
        ],
    )
    assert code == 2
    assert f"group nope of stream {unique_name} does not exist" in err
    assert f"groups of {unique_name}: none" in err
