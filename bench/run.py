"""`make bench`: publishing techniques on one stream layout, as ratios to raw core publish.

Every variant publishes the same records (16 partitions, 100-byte payloads, file storage,
keys spread over the partitions) into a fresh stream on the same embedded nats-server.
Variants run interleaved for several rounds and each figure is reported as a ratio to the
raw core publish measured in the same round, because these machines are shared and
noisy: absolute rates drift, ratios much less.

Variants
  raw        core publish with the same headers (msg-id, key, sequence), no acks: the limit
  raw-wire   the same with pre-encoded header blocks (what the ordered publisher sends)
  async      nats-py ``js.publish_async`` with msg-ids: what a user would write
             (fast, but a failed message can be resent after later ones: not order-safe)
  atomic     per-partition atomic batches (ADR-50, 1000 messages, one batch in flight per
             partition): order-safe, the alternative we did not choose
  sync       ``js.publish`` one at a time (on fewer records; rate only)
  ordered    airflow_nats_ordered OrderedPublisher (fast-ingest batches, gap=fail)
  ordered-many  the same fed through ``publish_many`` (one call for all records)
  fastbatch  a plain fast batch per partition of frames like the publisher's, built before
             the clock starts and sent at the server's flow: issue 33 goal 2's server baseline

Memory (1 MB payloads): each variant runs in a child process that publishes BENCH_MEM_N
records of 1,000,000 bytes (generated on the fly, so the input itself holds nothing) and
reports its peak RSS (VmHWM). The baseline is raw core publish of the same records in the
same run; the ordered publisher holds at most ``max_pending_bytes`` of payload, so its
figure is the baseline plus about that bound, however long the input.

Figures: each variant's rate as a ratio to ``raw`` and, for the ordered publisher, to
``raw-wire`` (issue 19's goal: >= 0.8 x raw-wire); issue 33 goal 2's three figures (client
CPU per record <= 3 us, server CPU per record no higher than ``fastbatch``'s, rate >= 0.85 x
raw-wire), each against this run's baseline; and the CPU each variant costs per record
in this process (``client``) and in the nats-server process (``server``), from
``time.process_time()`` and ``/proc/<pid>/stat``: far steadier than rates on a shared
machine, and where the remaining gap to raw-wire lies (docs/benchmarks.md, issue 19).

Environment (each also a flag, see ``--help``): BENCH_N (records, default 200000),
BENCH_ROUNDS (default 3), BENCH_MEM_N (1 MB records, default 300), BENCH_SECTIONS (default
"publish,memory"), BENCH_VARIANTS (default: all of them). ``raw``, ``raw-wire`` and
``fastbatch`` always run: they are the same-round baselines of every ratio. Only the
publisher against its baselines, several rounds::

    .venv/bin/python bench/run.py --variants ordered --sections publish --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.nuid import NUID

from airflow_nats_ordered.core.publish import wire
from airflow_nats_ordered.core.publish.msg_ids import derive_msg_id
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.partitioned import StreamSpec
from airflow_nats_ordered.core.stream.partitioning import partition_for, partition_subject
from airflow_nats_ordered.embedded.servers import NatsServer

PARTITIONS = 16
PAYLOAD = 100
N = int(os.environ.get("BENCH_N", "200000"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SYNC_N = max(1000, N // 40)
MEM_N = int(os.environ.get("BENCH_MEM_N", "300"))
MEM_PAYLOAD = 1_000_000
SECTIONS = set(os.environ.get("BENCH_SECTIONS", "publish,memory").split(","))
# every round runs them: each ratio is to its own round (fastbatch: issue 33 goal 2's server)
BASELINES = ("raw", "raw-wire", "fastbatch")
# (name, max_pending_bytes of the ordered publisher; None: raw core publish, the baseline)
MEM_VARIANTS: list[tuple[str, int | None]] = [
    ("raw", None),
    ("ordered 64 MiB", 64 * 1024 * 1024),  # the default bound
    ("ordered 16 MiB", 16 * 1024 * 1024),
]

Record = tuple[str, str, int, bytes, str]  # key, subject, producer seq, payload, msg id


def make_records(n: int, prefix: str) -> list[Record]:
    seqs = [0] * PARTITIONS
    out = []
    for i in range(n):
        key = f"key-{(i * 7919) % 5000}"
        p = partition_for(key, PARTITIONS)
        seqs[p] += 1
        payload = (b"%d:" % i).ljust(PAYLOAD, b"x")
        out.append(
            (
                key,
                partition_subject(prefix, p),
                seqs[p],
                payload,
                derive_msg_id("bench", i + 1, key, payload),
            )
        )
    return out


SERVER_PID = 0  # the embedded nats-server, for its CPU time
LOADS: list[float] = []  # the 1-minute load average when the publish section started
_START: dict[str, float] = {}  # a variant's own start (after its preparation), see mark_start


def server_cpu() -> float:
    """CPU seconds (user + system) the nats-server process has used so far."""
    fields = Path(f"/proc/{SERVER_PID}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mark_start() -> None:
    """Start this variant's clocks here: what it did before (encoding) is not counted."""
    _START.update(wall=time.perf_counter(), cpu=time.process_time(), srv=server_cpu())


def headers(rec: Record) -> dict[str, str]:
    return {"Nats-Msg-Id": rec[4], "Nats-Ordered-Key": rec[0], "Nats-Ordered-Seq": str(rec[2])}


async def wait_stored(nc: NATS, stream: str, n: int, timeout: float = 60.0) -> int:
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    while True:
        got = (await js.stream_info(stream)).state.messages
        if got >= n or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.02)


async def v_raw(nc: NATS, stream: str, recs: list[Record]) -> int:
    for r in recs:
        await nc.publish(r[1], r[3], headers=headers(r))
    await nc.flush()
    return await wait_stored(nc, stream, len(recs))


async def v_raw_wire(nc: NATS, stream: str, recs: list[Record]) -> int:
    fast = wire.supports_fast_path(nc)
    pre = [(r[1].encode(), wire.header_block(headers(r)), r[3]) for r in recs]
    mark_start()  # encoding is excluded from this variant's time: report only the send
    for subject, hdr, data in pre:
        await wire.send(nc, fast, subject, b"", hdr, data)
    await nc.flush()
    return await wait_stored(nc, stream, len(recs))


async def v_async(nc: NATS, stream: str, recs: list[Record]) -> int:
    js = nc.jetstream(publish_async_max_pending=4000)
    for r in recs:
        await js.publish_async(r[1], r[3], headers=headers(r))
    await js.publish_async_completed()
    return await wait_stored(nc, stream, len(recs))


async def v_sync(nc: NATS, stream: str, recs: list[Record]) -> int:
    js = nc.jetstream()
    for r in recs[:SYNC_N]:
        await js.publish(r[1], r[3], headers=headers(r))
    return SYNC_N


async def v_atomic(nc: NATS, stream: str, recs: list[Record], batch: int = 1000) -> int:
    by_part: dict[str, list[Record]] = {}
    for r in recs:
        by_part.setdefault(r[1], []).append(r)

    async def one_partition(subject: str, prs: list[Record]) -> None:
        for start in range(0, len(prs), batch):
            chunk = prs[start : start + batch]
            bid = NUID().next().decode()
            for i, r in enumerate(chunk, 1):
                h = headers(r) | {"Nats-Batch-Id": bid, "Nats-Batch-Sequence": str(i)}
                if i == len(chunk):
                    h["Nats-Batch-Commit"] = "1"
                if i == 1 or i == len(chunk):
                    resp = await nc.request(subject, r[3], headers=h, timeout=30)
                    if b"error" in resp.data:
                        raise RuntimeError(resp.data.decode())
                else:
                    await nc.publish(subject, r[3], headers=h)

    await asyncio.gather(*(one_partition(s, prs) for s, prs in by_part.items()))
    return await wait_stored(nc, stream, len(recs))


async def v_ordered(nc: NATS, stream: str, recs: list[Record]) -> int:
    async with OrderedPublisher(nc, stream, producer_id="bench") as pub:
        for r in recs:
            await pub.publish(r[0], r[3])
    assert pub.summary is not None and pub.summary.failed == 0
    return pub.summary.acked


def publisher_frame(key: str, subject: str, seq: int, data: bytes, mid: str, reply: bytes) -> bytes:
    """A frame like the ordered publisher's: its four headers (the producer line
    included) and a fast-batch reply subject."""
    hdr = wire.header_block(
        {
            "Nats-Msg-Id": mid,
            "Nats-Ordered-Key": key,
            "Nats-Ordered-Seq": str(seq),
            "Nats-Ordered-Producer": "bench",
        }
    )
    return wire.frame(subject.encode(), reply, hdr, data)


async def v_fastbatch(nc: NATS, stream: str, recs: list[Record]) -> int:
    """Issue 33 goal 2's server baseline: a plain fast batch per partition (gap ``fail``,
    flow 500 asked) of frames like the ordered publisher's (the same four headers, the
    producer line included, and reply subjects of the same form and length), all built
    before the clock starts, then sent at the server's flow: each partition up to two flows
    past its last acknowledgement (ADR-50; a batch sent without waiting for its
    acknowledgements was abandoned by a loaded server, and the round waited 60 s), every
    ready partition's frames in one write (at most 1,000 frames), one commit per partition
    at the end. No msg-id derivation, no queues, no resends: what any order-safe batch of
    these frames costs the server."""
    inbox = nc.new_inbox()
    tag = inbox.rsplit(".", 1)[1][:12]
    frames: dict[int, list[bytes]] = {}
    sizes: dict[int, int] = {}
    for key, subject, seq, data, mid in recs:
        p = int(subject.rsplit(".", 1)[1])
        got = frames.setdefault(p, [])
        n = len(got) + 1
        reply = f"{inbox}.{p}.{tag}p{p}b1.500.fail.{n}.{0 if n == 1 else 1}.$FI".encode()
        got.append(publisher_frame(key, subject, seq, data, mid, reply))
        sizes[p] = len(data)
    ends = []
    for p, fs in frames.items():
        end_to = partition_subject(recs[0][1].rsplit(".", 2)[0], p).encode()
        reply = f"{inbox}.{p}.{tag}p{p}b1.500.fail.{len(fs) + 1}.3.$FI".encode()
        ends.append(wire.frame(end_to, reply, b"NATS/1.0\r\n\r\n", b""))
    acked = dict.fromkeys(frames, 0)
    flow = dict.fromkeys(frames, 1)  # until the first acknowledgement says
    sent = dict.fromkeys(frames, 0)
    done = asyncio.Event()
    more = asyncio.Event()
    finals = [0]
    start = len(inbox) + 1

    async def on_reply(msg: Any) -> None:
        p = int(msg.subject[start:].partition(".")[0])
        ack = json.loads(msg.data)
        if ack.get("type") == "ack":
            acked[p] = max(acked[p], int(ack["seq"]))
            flow[p] = max(1, int(ack["msgs"]))
            more.set()
        elif "batch" in ack or ack.get("error"):
            finals[0] += 1
            if ack.get("error"):
                raise RuntimeError(f"fast batch baseline failed: {ack}")
            if finals[0] == len(frames):
                done.set()

    sub = await nc.subscribe(f"{inbox}.>", cb=on_reply, pending_msgs_limit=-1)
    mark_start()
    fast = wire.supports_fast_path(nc)
    left = len(frames)
    while left:
        more.clear()
        out: list[bytes] = []
        payload = 0
        for p, fs in frames.items():
            s = sent[p]
            if s == len(fs):
                continue
            n = min(len(fs), acked[p] + 2 * flow[p], s + 1000 - len(out)) - s
            if s == 0:
                n = 1  # the first message alone: its acknowledgement gives the flow
            if n > 0:
                out += fs[s : s + n]
                payload += n * sizes[p]
                sent[p] = s + n
                left -= sent[p] == len(fs)
        if out:
            await wire.send_frames(nc, fast, out, payload, 400)
        else:
            await more.wait()
    await wire.send_frames(nc, fast, ends, 0, 20)
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    return await wait_stored(nc, stream, len(recs))


async def v_fastbatch_one(nc: NATS, stream: str, recs: list[Record]) -> int:
    """The server's cost of the cheapest order-safe batch of these frames: **one** fast batch
    for the whole run over every partition (lever (b) of docs/benchmarks-publisher.md), the
    frames of ``fastbatch`` (reply subjects one token shorter: no partition), built before
    the clock starts and sent at the server's flow (up to two flows past the last
    acknowledgement, at most 1,000 frames per write), one commit at the end. Where it stands
    against ``raw-wire`` bounds what any fast-batch publisher of these records can reach."""
    inbox = nc.new_inbox()
    tag = inbox.rsplit(".", 1)[1][:12]
    frames: list[bytes] = []
    payload_of: list[int] = []
    for key, subject, seq, data, mid in recs:
        n = len(frames) + 1
        reply = f"{inbox}.{tag}all1.500.fail.{n}.{0 if n == 1 else 1}.$FI".encode()
        frames.append(publisher_frame(key, subject, seq, data, mid, reply))
        payload_of.append(len(data))
    end_reply = f"{inbox}.{tag}all1.500.fail.{len(frames) + 1}.3.$FI".encode()
    end = wire.frame(recs[-1][1].encode(), end_reply, b"NATS/1.0\r\n\r\n", b"")
    state = {"acked": 0, "flow": 1}
    done = asyncio.Event()
    more = asyncio.Event()
    failed: list[Any] = []

    async def on_reply(msg: Any) -> None:
        ack = json.loads(msg.data)
        if ack.get("type") == "ack":
            state["acked"] = max(state["acked"], int(ack["seq"]))
            state["flow"] = max(1, int(ack["msgs"]))
            more.set()
        elif "batch" in ack or ack.get("error"):
            if ack.get("error"):
                failed.append(ack)
            done.set()
            more.set()

    sub = await nc.subscribe(f"{inbox}.>", cb=on_reply, pending_msgs_limit=-1)
    mark_start()
    fast = wire.supports_fast_path(nc)
    sent = 0
    while sent < len(frames) and not failed:
        more.clear()
        n = min(len(frames), state["acked"] + 2 * state["flow"], sent + 1000) - sent
        if sent == 0:
            n = 1  # the first message alone: its acknowledgement gives the flow
        if n > 0:
            await wire.send_frames(
                nc, fast, frames[sent : sent + n], sum(payload_of[sent : sent + n]), 400
            )
            sent += n
        else:
            await more.wait()
    await wire.send_frames(nc, fast, [end], 0, 20)
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    if failed:
        raise RuntimeError(f"one-batch baseline failed: {failed[0]}")
    return await wait_stored(nc, stream, len(recs))


async def v_ordered_many(nc: NATS, stream: str, recs: list[Record]) -> int:
    """The ordered publisher fed in bulk (``publish_many``): the same records, msg-ids and
    frames as ``ordered``, without a coroutine per record."""
    async with OrderedPublisher(nc, stream, producer_id="bench") as pub:
        await pub.publish_many([(r[0], r[3]) for r in recs])
    assert pub.summary is not None and pub.summary.failed == 0
    return pub.summary.acked


VARIANTS: dict[str, Callable[[NATS, str, list[Record]], Awaitable[int]]] = {
    "raw": v_raw,
    "raw-wire": v_raw_wire,
    "async": v_async,
    "atomic": v_atomic,
    "sync": v_sync,
    "ordered": v_ordered,
    "ordered-many": v_ordered_many,
    "fastbatch": v_fastbatch,
    "fastbatch-one": v_fastbatch_one,
}
SELECTED = os.environ.get("BENCH_VARIANTS", ",".join(VARIANTS)).split(",")


async def run_variant(nc: NATS, name: str, rnd: int) -> tuple[float, int, float, float]:
    """(msg/s, stored, client CPU us per record, server CPU us per record)."""
    stream = f"BENCH_{name.upper().replace('-', '_')}_{rnd}"
    spec = StreamSpec(stream, partitions=PARTITIONS, subject_prefix=stream.lower())
    cfg = spec.stream_config()
    cfg.allow_atomic = name == "atomic"
    js = nc.jetstream()
    await js.add_stream(cfg)
    recs = make_records(N, spec.prefix)
    await asyncio.sleep(0.2)
    mark_start()
    stored = await VARIANTS[name](nc, stream, recs)
    elapsed = time.perf_counter() - _START["wall"]
    cpu = time.process_time() - _START["cpu"]
    srv = server_cpu() - _START["srv"]
    count = SYNC_N if name == "sync" else N
    await js.delete_stream(stream)
    return count / elapsed, stored, cpu / count * 1e6, srv / count * 1e6


def peak_rss_kib() -> int:
    """This process's peak resident set size (VmHWM), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


async def memory_child(url: str, stream: str, bound: int | None) -> None:
    """Publish MEM_N 1 MB records (raw when ``bound`` is None); print peak RSS as JSON."""
    nc = await nats.connect(url, pending_size=8 * 1024 * 1024)
    prefix = stream.lower()
    t0 = time.perf_counter()
    if bound is None:
        for i in range(MEM_N):
            key = f"key-{i % 64}"
            payload = (b"%d:" % i).ljust(MEM_PAYLOAD, b"x")
            subject = partition_subject(prefix, partition_for(key, PARTITIONS))
            await nc.publish(subject, payload, headers={"Nats-Ordered-Key": key})
        await nc.flush()
    else:
        async with OrderedPublisher(
            nc, stream, producer_id="bench", max_pending_bytes=bound
        ) as pub:
            for i in range(MEM_N):
                await pub.publish(f"key-{i % 64}", (b"%d:" % i).ljust(MEM_PAYLOAD, b"x"))
    elapsed = time.perf_counter() - t0
    await nc.close()
    print(json.dumps({"peak_kib": peak_rss_kib(), "seconds": elapsed}))


async def run_memory(nc: NATS, url: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    js = nc.jetstream()
    for i, (name, bound) in enumerate(MEM_VARIANTS):
        stream = f"BENCH_MEM_{i}"
        await js.add_stream(StreamSpec(stream, partitions=PARTITIONS).stream_config())
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--memory-child",
            url,
            stream,
            "raw" if bound is None else str(bound),
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"memory variant {name} failed (exit {proc.returncode})")
        res = json.loads(stdout.decode().strip().splitlines()[-1])
        await js.delete_stream(stream)
        out[name] = res
        print(
            f"  memory {name:15s} peak RSS {res['peak_kib'] / 1024:7.1f} MiB "
            f"({MEM_N} x 1 MB in {res['seconds']:.1f}s)",
            file=sys.stderr,
        )
    return out


def print_memory(mem: dict[str, dict[str, float]]) -> None:
    base = mem["raw"]["peak_kib"]
    print(f"\nmemory: {MEM_N} records x 1 MB, peak RSS of the publishing process")
    print(f"{'variant':16s} {'peak RSS MiB':>13s} {'x raw':>7s}")
    for name, res in mem.items():
        print(f"{name:16s} {res['peak_kib'] / 1024:>13.1f} {res['peak_kib'] / base:>7.2f}")


async def main() -> int:
    names = [v for v in VARIANTS if v in BASELINES or v in SELECTED]
    names = names if "publish" in SECTIONS else []
    results: dict[str, list[float]] = {v: [] for v in names}
    ratios: dict[str, list[float]] = {v: [] for v in names}
    vs_wire: list[float] = []  # ordered / raw-wire, per round
    many_vs_wire: list[float] = []  # ordered-many / raw-wire, per round
    wire_lost: list[int] = []  # rounds where raw-wire lost messages: left out of vs_wire
    ceilings: dict[str, list[float]] = {}  # the plain fast batches / raw-wire, per round
    cpu: dict[str, list[tuple[float, float]]] = {v: [] for v in names}
    stored_ok: dict[str, bool] = {v: True for v in names}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, NatsServer(Path(tmp)) as srv:
        global SERVER_PID
        SERVER_PID = srv.pid or 0
        nc = await nats.connect(srv.url, pending_size=8 * 1024 * 1024)
        LOADS.append(os.getloadavg()[0])  # a shared machine: the load explains the spread
        print(
            f"nats-server {srv.url}: {N:,} records x {PAYLOAD} B, {PARTITIONS} partitions, "
            f"file storage, {ROUNDS} rounds, load average {LOADS[0]:.1f}",
            file=sys.stderr,
        )
        for rnd in range(ROUNDS if names else 0):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            round_rates = {}
            round_stored: dict[str, bool] = {}
            for name in order:
                rate, stored, client_us, server_us = await run_variant(nc, name, rnd)
                round_rates[name] = rate
                cpu[name].append((client_us, server_us))
                expected = SYNC_N if name == "sync" else N
                round_stored[name] = stored == expected
                stored_ok[name] &= stored == expected
                print(
                    f"  round {rnd + 1} {name:12s} {rate:>10,.0f} msg/s  stored {stored:,}  "
                    f"CPU/record {client_us:.2f} us client, {server_us:.2f} us server",
                    file=sys.stderr,
                )
            for name, rate in round_rates.items():
                results[name].append(rate)
                ratios[name].append(rate / round_rates["raw"])
            if round_stored["raw-wire"]:
                if "ordered" in round_rates:
                    vs_wire.append(round_rates["ordered"] / round_rates["raw-wire"])
                if "ordered-many" in round_rates:
                    many_vs_wire.append(round_rates["ordered-many"] / round_rates["raw-wire"])
                for b in ("fastbatch", "fastbatch-one"):
                    if b in round_rates:
                        ceiling = round_rates[b] / round_rates["raw-wire"]
                        ceilings.setdefault(b, []).append(ceiling)
            else:  # the ack-less baseline lost messages (and waited for them): no baseline
                wire_lost.append(rnd + 1)
                cpu["raw-wire"].pop()
        mem = await run_memory(nc, srv.url) if "memory" in SECTIONS else {}
        await nc.close()

    out = Path(".bench")
    out.mkdir(exist_ok=True)
    if names:
        print_publish(results, ratios, stored_ok, vs_wire, cpu, wire_lost, many_vs_wire, ceilings)
        (out / "publish.json").write_text(
            json.dumps(
                {
                    "n": N,
                    "rounds": ROUNDS,
                    "rates": results,
                    "ratios_vs_raw": ratios,
                    "ordered_vs_raw_wire": vs_wire,
                    "ordered_many_vs_raw_wire": many_vs_wire,
                    "fast_batches_vs_raw_wire": ceilings,
                    "raw_wire_lost_rounds": wire_lost,
                    "cpu_us_per_record_client_server": cpu,
                    "all_stored": stored_ok,
                    "load_average_start_end": [LOADS[0], os.getloadavg()[0]],
                },
                indent=2,
            )
        )
    if mem:
        print_memory(mem)
        (out / "publish_memory.json").write_text(json.dumps({"n": MEM_N, "variants": mem}))
    return 0


def print_publish(
    results: dict[str, list[float]],
    ratios: dict[str, list[float]],
    stored_ok: dict[str, bool],
    vs_wire: list[float],
    cpu: dict[str, list[tuple[float, float]]],
    wire_lost: list[int],
    many_vs_wire: list[float] | None = None,
    ceilings: dict[str, list[float]] | None = None,
) -> None:
    print()
    print(
        f"{'variant':12s} {'msg/s (median)':>15s} {'x raw (median)':>15s} "
        f"{'x raw (min..max)':>18s}  all stored  {'CPU us/record client':>20s} {'server':>7s}"
    )
    for name in ratios:
        r = ratios[name]
        client = statistics.median(c for c, _ in cpu[name]) if cpu[name] else float("nan")
        server = statistics.median(s for _, s in cpu[name]) if cpu[name] else float("nan")
        print(
            f"{name:12s} {statistics.median(results[name]):>15,.0f} "
            f"{statistics.median(r):>15.2f} {min(r):>8.2f}..{max(r):<8.2f}  "
            f"{'yes' if stored_ok[name] else 'NO ':3s}         {client:>20.2f} {server:>7.2f}"
        )
    if "ordered" not in ratios:
        return
    goal = statistics.median(ratios["ordered"])
    verdict = "meets" if goal >= 0.5 else "MISSES"
    print(f"\nordered publisher = {goal:.2f} x raw core publish ({verdict} the >= 0.5 x goal)")
    if wire_lost:
        print(
            f"(raw-wire lost messages in round(s) {wire_lost}: the ack-less baseline has no flow "
            "control; those rounds are left out of the raw-wire figures below)"
        )
    if not vs_wire:
        print("ordered publisher vs raw-wire: no round with a complete raw-wire baseline")
        return
    wire_goal = statistics.median(vs_wire)
    verdict = "meets" if wire_goal >= 0.8 else "MISSES"
    print(
        f"ordered publisher = {wire_goal:.2f} x raw-wire ({min(vs_wire):.2f}..{max(vs_wire):.2f}; "
        f"{verdict} issue 19's >= 0.8 x goal); per round: "
        + ", ".join(f"{r:.2f}" for r in vs_wire)
        + f"; load average {LOADS[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    for name, rs in (ceilings or {}).items():
        print(
            f"{name} = {statistics.median(rs):.2f} x raw-wire ({min(rs):.2f}..{max(rs):.2f}): "
            "pre-built frames, no client work, the server's cost of an order-safe batch of "
            "these records; a ceiling for any fast-batch publisher's rate"
        )
    for name in ("ordered", "ordered-many"):
        if name in cpu and cpu[name]:
            print_goal2(name, vs_wire if name == "ordered" else many_vs_wire or [], cpu)
    cpu_of = {n: sum(statistics.median(x[i] for x in cpu[n]) for i in (0, 1)) for n in cpu}
    print(
        f"CPU per record, client + server: ordered {cpu_of['ordered']:.2f} us, raw-wire "
        f"{cpu_of['raw-wire']:.2f} us (ratio {cpu_of['raw-wire'] / cpu_of['ordered']:.2f}: the "
        "rate ratio a CPU-bound machine allows)"
    )


def print_goal2(name: str, vs_wire: list[float], cpu: dict[str, list[tuple[float, float]]]) -> None:
    """Issue 33 goal 2's three figures for ``name`` against this run's baselines: client CPU
    per record (<= 3 us), server CPU per record against a plain fast batch of the same
    frames (no higher), rate against raw-wire (>= 0.85 x, median of the rounds)."""
    client = statistics.median(c for c, _ in cpu[name])
    server = statistics.median(s for _, s in cpu[name])
    fast = [s for _, s in cpu.get("fastbatch", [])]
    base = statistics.median(fast) if fast else float("nan")
    ratio = statistics.median(vs_wire) if vs_wire else float("nan")
    figures = [
        (client <= 3.0, f"client {client:.2f} us/record (goal <= 3)"),
        (server <= base, f"server {server:.2f} us/record against the fast batch's {base:.2f}"),
        (ratio >= 0.85, f"{ratio:.2f} x raw-wire (goal >= 0.85)"),
    ]
    met = sum(ok for ok, _ in figures)
    print(
        f"issue 33 goal 2, {name}: "
        + "; ".join(f"{text} {'met' if ok else 'MISSED'}" for ok, text in figures)
        + f": {'meets' if met == 3 else 'MISSES'} it ({met} of 3)"
    )


def parse_args(argv: list[str]) -> None:
    """Flags over the environment's defaults (the module header lists both)."""
    global N, ROUNDS, SYNC_N, MEM_N, SECTIONS, SELECTED
    ap = argparse.ArgumentParser(
        description="Publishing techniques as ratios to raw core publish in the same round "
        "(and the ordered publisher to raw-wire: issue 19's >= 0.8 x goal); results go to "
        ".bench/publish.json and .bench/publish_memory.json.",
        epilog="Only the publisher against its baselines, five rounds: "
        "bench/run.py --variants ordered --sections publish --rounds 5",
    )
    ap.add_argument("-n", "--records", type=int, default=N, help="records per variant and round")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="rounds (variants interleaved)")
    ap.add_argument(
        "--variants",
        default=",".join(SELECTED),
        help=f"comma-separated, of {', '.join(VARIANTS)}; raw, raw-wire and fastbatch always run "
        "(the baselines)",
    )
    ap.add_argument("--sections", default=",".join(sorted(SECTIONS)), help="publish,memory")
    ap.add_argument("--mem-records", type=int, default=MEM_N, help="1 MB records (memory)")
    args = ap.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))}; known: {', '.join(VARIANTS)}")
    N, ROUNDS, MEM_N = args.records, args.rounds, args.mem_records
    SYNC_N = max(1000, N // 40)
    SELECTED = args.variants.split(",")
    SECTIONS = set(args.sections.split(","))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory-child"]:
        url, stream, bound = sys.argv[2:5]
        asyncio.run(memory_child(url, stream, None if bound == "raw" else int(bound)))
        sys.exit(0)
    parse_args(sys.argv[1:])
    sys.exit(asyncio.run(main()))
