"""Trying to break the publisher's shared sender (core/publish/sender.py) from outside, with
a real nats-server: one partition's batch refused while the others go on in the same
writes, a publisher cancelled while the sender holds its lanes, several publishers and
tasks on one connection, and replies of forms the flow-ack fast path does not expect."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict, deque

import nats
from locations import TESTS
from nats.js import api
from streamcheck import check_stored, make_records, read_stream

from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.publish.summary import PublishError
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.stream.partitioning import partition_for


def _records_for(partitions: int, per_partition: dict[int, int]) -> list[tuple[str, bytes]]:
    """Records interleaved over the partitions, ``per_partition[p]`` of partition p (keys
    ``k<n>`` of that partition), each payload naming its key and per-key index."""
    keys: dict[int, list[str]] = defaultdict(list)
    n = 0
    while any(len(keys[p]) < 5 for p in per_partition):
        k = f"k{n}"
        n += 1
        keys[partition_for(k, partitions)].append(k)
    out, left, idx = [], dict(per_partition), defaultdict(int)
    while any(left.values()):
        for p in sorted(left):
            for _ in range(min(left[p], 7)):
                k = keys[p][(per_partition[p] - left[p]) % 5]
                out.append((k, json.dumps({"k": k, "i": idx[k]}).encode().ljust(60)))
                idx[k] += 1
                left[p] -= 1
    return out


async def _publish_all(pub: OrderedPublisher, records, headers_at=None):
    """Publish every record, then flush and close: the summary and the PublishError that
    reported failures (None when every record was stored). ``headers_at`` maps a record's
    index to its headers."""
    error = None
    await pub.start()
    try:
        for i, (k, body) in enumerate(records):
            await pub.publish(k, body, headers=(headers_at or {}).get(i))
        summary = await pub.flush()
    except PublishError as exc:
        error, summary = exc, exc.summary
    finally:
        await pub.close(raise_on_failure=False)
    return summary, error


def test_one_partition_over_its_subject_limit_fails_alone_and_exactly(
    shared_nats_server, unique_name
):
    """A stream whose subjects hold at most 300 messages each (discard new per subject):
    partition 0 gets 1,500 records, the others 250, interleaved, so the sender's writes
    carry partition 0's refused records with the others' good ones. Partition 0 stores its
    first 300 and reports exactly the other 1,200 failed; every other partition stores all
    of its records once and in order."""
    partitions = 4
    per = {0: 1_500, 1: 250, 2: 250, 3: 250}
    records = _records_for(partitions, per)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=partitions))
        js = nc.jetstream()
        cfg = (await js.stream_info(unique_name)).config
        cfg.max_msgs_per_subject = 300
        cfg.discard = api.DiscardPolicy.NEW
        cfg.discard_new_per_subject = True
        await js.update_stream(cfg)
        pub = OrderedPublisher(nc, unique_name, ack_timeout=30.0, delivery_timeout=3.0)
        summary, error = await _publish_all(pub, records)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return summary, error, stored

    summary, error, stored = asyncio.run(asyncio.wait_for(go(), 120.0))
    assert error is not None, "flush did not report the refused records"
    got = {p.partition: (p.acked, p.failed, p.stored) for p in summary.partitions}
    assert got == {0: (300, 1_200, 300), 1: (250, 0, 250), 2: (250, 0, 250), 3: (250, 0, 250)}
    assert "maximum messages per subject exceeded" in (summary.partitions[0].error or "")
    assert [p.error for p in summary.partitions[1:]] == [None, None, None]
    counts = check_stored(records, stored, partitions, unique_name.lower())
    assert counts == {0: 300, 1: 250, 2: 250, 3: 250}


def test_a_record_refused_mid_batch_fails_its_partition_from_there_exactly(
    shared_nats_server, unique_name
):
    """One record of partition 2 carries a header the server refuses (an expected stream
    that is not this one: a permanent refusal), mid-batch, while the other partitions share
    the sender's writes. Partition 2 keeps and acknowledges the 149 records before it and
    reports exactly the rest failed, with the server's reason; the others are untouched."""
    partitions = 4
    records = _records_for(partitions, dict.fromkeys(range(partitions), 400))
    bad = [i for i, (k, _) in enumerate(records) if partition_for(k, partitions) == 2][149]

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=partitions))
        pub = OrderedPublisher(nc, unique_name, ack_timeout=30.0)
        refused = {bad: {"Nats-Expected-Stream": "NOT-THIS-ONE"}}
        summary, error = await _publish_all(pub, records, refused)
        stored = await read_stream(nc, unique_name)
        await nc.close()
        return summary, error, stored

    summary, error, stored = asyncio.run(asyncio.wait_for(go(), 120.0))
    assert error is not None and "expected stream does not match" in str(error), error
    got = {p.partition: (p.acked, p.failed, p.stored) for p in summary.partitions}
    assert got == {0: (400, 0, 400), 1: (400, 0, 400), 2: (149, 251, 149), 3: (400, 0, 400)}
    assert check_stored(records, stored, partitions, unique_name.lower())[2] == 149


def _per_key_problems(published: list[tuple[str, bytes]], stored) -> list[str]:
    """Each key's stored payloads are exactly its published ones, once each, in order."""
    want: dict[str, list[bytes]] = defaultdict(list)
    for k, body in published:
        want[k].append(body)
    got: dict[str, list[bytes]] = defaultdict(list)
    for s in stored:
        got[s.key].append(s.data)
    return [
        f"key {k}: {len(got[k])} stored, not its {len(w)} in order"
        for k, w in want.items()
        if got[k] != w
    ] + [f"key {k} was never published" for k in got if k not in want]


def test_publishers_and_tasks_sharing_one_connection_keep_each_keys_order(
    shared_nats_server, unique_name
):
    """Three publishers on one connection, two on the same stream, each fed by two tasks
    with keys of their own at once: every sender task writes into the same connection.
    Every key's records are stored once, in the order its task published them."""
    streams = [f"{unique_name}_A", f"{unique_name}_B"]
    feeds = {  # (stream, publisher) -> two tasks' records, keys disjoint everywhere
        (s, n): [[(f"{s}-{n}-{t}-{k % 23}", b"%d" % k) for k in range(1_500)] for t in range(2)]
        for s, n in ((streams[0], 0), (streams[0], 1), (streams[1], 0))
    }

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        for s in streams:
            await provision(nc, StreamSpec(s, partitions=6))

        async def run(stream, tasks):
            async with OrderedPublisher(nc, stream) as pub:

                async def feed(recs):
                    for k, body in recs:
                        await pub.publish(k, body)

                await asyncio.gather(*(feed(r) for r in tasks))
            return pub.summary

        summaries = await asyncio.gather(*(run(s, t) for (s, _), t in feeds.items()))
        stored = {s: await read_stream(nc, s) for s in streams}
        await nc.close()
        return summaries, stored

    summaries, stored = asyncio.run(asyncio.wait_for(go(), 120.0))
    assert [(s.acked, s.failed) for s in summaries] == [(3_000, 0)] * 3
    for s in streams:
        published = [r for (st, _), tasks in feeds.items() if st == s for t in tasks for r in t]
        assert not _per_key_problems(published, stored[s]), _per_key_problems(published, stored[s])[
            :5
        ]


def test_a_publisher_cancelled_while_the_sender_holds_its_lanes_stores_what_it_accepted(
    shared_nats_server, unique_name
):
    """The task publishing inside ``async with`` is cancelled mid-stream, while lanes are
    parked with the sender. The task ends (no hang), the publisher's tasks are all done, and
    every record it accepted is stored once, in order, and counted acknowledged."""
    partitions = 8
    records = make_records(20_000, keys=300)

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        try:
            await provision(nc, StreamSpec(unique_name, partitions=partitions))
            holder: dict[str, OrderedPublisher] = {}

            async def publish_all():
                async with OrderedPublisher(nc, unique_name) as pub:
                    holder["pub"] = pub
                    for k, body in records:
                        await pub.publish(k, body)

            task = asyncio.ensure_future(publish_all())
            while "pub" not in holder or holder["pub"].acked < 2_000:
                assert not task.done(), "published everything before the cancel"
                await asyncio.sleep(0.002)
            pub = holder["pub"]
            parked = sum(getattr(lane, "parked", False) for lane in pub._lanes)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=60.0)
            assert done, "the cancelled publisher did not finish within 60 s"
            sender = getattr(pub, "_sender", None)  # ee70a95 has none
            tasks = [lane.task for lane in pub._lanes] + ([sender.task] if sender else [])
            return pub, parked, tasks, await read_stream(nc, unique_name)
        finally:
            await nc.close()

    pub, parked, tasks, stored = asyncio.run(asyncio.wait_for(go(), 120.0))
    assert all(t is not None and t.done() for t in tasks)
    accepted = pub.accepted
    assert 2_000 <= accepted < len(records) and pub.acked == accepted and pub.failed == 0
    counts = check_stored(records[:accepted], stored, partitions, unique_name.lower())
    assert sum(counts.values()) == accepted, parked


_REPLIES = [  # flow acks in forms a future server may write, and the replies that are not
    b'{"type":"ack","seq":5,"msgs":500}',
    b'{"seq":5,"msgs":250,"type":"ack"}',
    b'{"type": "ack", "seq": 5, "msgs": 250}',
    b'{"type":"ack","seq":5,"msgs":500,"count":5}',
    b'{"type":"ack","seq":5,"msgs":500,"batch":"x"}',
    b'{"type":"ack","seq":5}',
    b'{"type":"ack","seq":99,"msgs":0}',
    b'{"type":"ack","seq":5,"msgs":500}\n',
    b'{"type":"ack","seq":5,"msgs":500,"error":{"code":503,"err_code":10077}}',
    b'{"type":"err","seq":6,"error":{"code":400,"err_code":10071,"description":"x"}}',
    b'{"type":"gap","last_seq":4,"seq":6}',
    b'{"stream":"S","seq":7,"batch":"b1","count":5}',
    b'{"error":{"code":400,"err_code":10208,"description":"batch publish ID unknown"}}',
    b"",
]


def test_the_senders_flow_ack_reading_agrees_with_the_lanes_for_any_reply(
    shared_nats_server, unique_name
):
    """The sender applies a plain flow ack itself (a regex for the exact form nats-server
    writes, json.loads for any other) and hands every other reply to the lane. For each
    reply: what the sender applies equals what the lane's own reading applies, and what the
    lane's reading treats as more than an ack stays queued for the lane."""

    async def go():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=1))
        pub = OrderedPublisher(nc, unique_name)
        await pub.start()
        lane = pub._lanes[0]
        out = []
        for data in _REPLIES:
            seen = []
            for how in ("sender", "lane"):
                lane.batch_id, lane.batch_seq, lane.acked_bseq, lane.flow = "b1", 10, 0, 500
                lane.broken, lane.inflight = False, deque([(b"", 0, 0)] * 10)
                lane.replies = deque([("b1", data)])
                if how == "sender":
                    more = not lane.take_acks()
                    assert more == bool(lane.replies), data
                else:
                    lane.replies.clear()
                    try:
                        more = lane._handle("b1", data) and (lane.broken or lane.batch_id is None)
                    except Exception:  # noqa: BLE001 - a reply only the lane's task handles
                        more = True
                seen.append((more, lane.acked_bseq, lane.flow) if not more else (True,))
            out.append((data, *seen))
        lane.batch_id, lane.inflight, lane.replies = None, deque(), deque()
        await pub.close(raise_on_failure=False)  # its counts were made up above
        await nc.close()
        return out

    for data, sender, lane in asyncio.run(asyncio.wait_for(go(), 60.0)):
        assert sender == lane, (data, sender, lane)


# a program whose main coroutine fails while a task of it publishes inside `async with`:
# asyncio.run then cancels every task left, the publisher's own ones with the publishing one
_ABANDONED = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[3])
import nats
from streamcheck import make_records
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

holder = {}


async def main(url, name):
    nc = await nats.connect(url)

    async def publish_all():
        async with OrderedPublisher(nc, name) as pub:
            holder["pub"] = pub
            for k, body in make_records(20_000, keys=300):
                await pub.publish(k, body)

    asyncio.ensure_future(publish_all())
    while "pub" not in holder or holder["pub"].acked < 2_000:
        await asyncio.sleep(0.002)
    raise RuntimeError("main failed")

try:
    asyncio.run(main(sys.argv[1], sys.argv[2]))
except RuntimeError:
    pub = holder["pub"]
    print(json.dumps([pub.accepted, pub.acked, pub.failed]))
"""


def test_a_program_ending_while_it_publishes_exits_and_reports_what_it_did_not_store(
    shared_nats_server, unique_name
):
    """The main coroutine of ``asyncio.run`` fails while another task publishes: asyncio
    cancels the publishing task and the publisher's own tasks at once. The program must exit
    (the publisher's close() waited forever for lanes whose tasks were gone); what was
    stored is a prefix of each partition's records, once each."""

    async def setup():
        nc = await nats.connect(shared_nats_server.url)
        await provision(nc, StreamSpec(unique_name, partitions=8))
        await nc.close()

    asyncio.run(setup())
    tests_dir = str(TESTS)
    args = [sys.executable, "-c", _ABANDONED, shared_nats_server.url, unique_name, tests_dir]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("the program did not exit within 90 s: close() hung") from None
    assert done.returncode == 0, done.stderr[-2000:]
    assert "was cancelled;" in done.stderr, done.stderr[-2000:]  # the unsent, reported

    async def read():
        nc = await nats.connect(shared_nats_server.url)
        try:
            return await read_stream(nc, unique_name)
        finally:
            await nc.close()

    stored = asyncio.run(read())
    accepted, acked, failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert acked + failed == accepted and acked <= len(stored) <= accepted < 20_000
    check_stored(make_records(20_000, keys=300), stored, 8, unique_name.lower())
