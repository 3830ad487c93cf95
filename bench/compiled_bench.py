"""`make bench`: the compiled fast path against its pure-Python twins (issue 33, goal 4).

Each hot loop the package compiles (``compiled.TWINS``) is timed both ways in the same run,
alternated, process time, best of ``--repeat``:

* read: ``bench/read_frames_micro.py`` in child processes, with and without
  ``NATS_ORDERED_NO_EXTENSIONS=1``: µs per frame from the socket's bytes to the reader's
  buffer, and per header block;
* publish: in this process, ``records.record_rest`` (a record's msg-id, header block and
  frame rest) and ``records.window_frames`` (a window's frames) of the compiled twin and of
  the pure ``*_py`` functions on the same 200k records (100 B payloads, 1,000 keys).

The twins' outputs are checked equal on these records before anything is timed (the golden
vectors are in the tests). What the end-to-end figures gained (worker and publisher CPU per
record) is printed by bench/worker_bench.py and bench/run.py against their goals.

    python bench/compiled_bench.py [--n 200000] [--rounds 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from airflow_nats_ordered.core.publish import records
from airflow_nats_ordered.core.stream import compiled

HERE = Path(__file__).resolve().parent


def read_side(n: int, rounds: int, repeat: int) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"compiled": [], "pure": []}
    for rnd in range(rounds):
        order = ["compiled", "pure"] if rnd % 2 == 0 else ["pure", "compiled"]
        for name in order:
            env = dict(os.environ, NATS_ORDERED_NO_EXTENSIONS="1" if name == "pure" else "")
            run = subprocess.run(
                [sys.executable, str(HERE / "read_frames_micro.py"), "--n", str(n)]
                + ["--repeat", str(repeat)],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            got = json.loads(run.stdout.strip().splitlines()[-1])
            if got["compiled"] != (name == "compiled"):
                raise SystemExit(f"the {name} child ran compiled={got['compiled']}")
            out[name].append(got)
    return out


def _records(n: int) -> list[tuple[int, bytes, bytes, int, bytes]]:
    data = b"x" * 100
    return [
        (i, b"key-%d" % (i % 1000), b"Nats-Ordered-Key: key-%d\r\n" % (i % 1000), i, data)
        for i in range(1, n + 1)
    ]


def _time_rest(fn, form, recs) -> tuple[float, list]:  # type: ignore[no-untyped-def]
    t0 = time.process_time()
    got = [fn(form, place, kb, line, seq, data) for place, kb, line, seq, data in recs]
    return time.process_time() - t0, got


def _time_window(fn, rests, window: int) -> float:  # type: ignore[no-untyped-def]
    queue: deque = deque(rests)
    inflight: deque = deque()
    head = b"HPUB _INBOX.bench.0.b1.500.fail."
    t0 = time.process_time()
    seq = 0
    while queue:
        frames: list[bytes] = []
        k = min(window, len(queue))
        fn(head, seq, queue, inflight, k, frames)
        seq += k
        inflight.clear()
    return time.process_time() - t0


def publish_side(n: int, rounds: int, repeat: int) -> dict[str, dict[str, float]] | None:
    twin = compiled.load("airflow_nats_ordered.core.publish._records")
    if twin is None:
        return None
    recs = _records(n)
    producer = b"bench-producer"
    ways = {
        "compiled": (twin.rest_form(producer), twin.record_rest, twin.window_frames),
        "pure": (records.rest_form_py(producer), records.record_rest_py, records.window_frames_py),
    }
    _, a = _time_rest(ways["compiled"][1], ways["compiled"][0], recs[:2000])
    _, b = _time_rest(ways["pure"][1], ways["pure"][0], recs[:2000])
    if a != b:
        raise SystemExit("the compiled and pure record_rest differ on the bench's records")
    best: dict[str, dict[str, float]] = {k: {"rest": 1e9, "window": 1e9} for k in ways}
    for rnd in range(rounds * repeat):
        for name in ["compiled", "pure"] if rnd % 2 == 0 else ["pure", "compiled"]:
            form, rest, window = ways[name]
            t, got = _time_rest(rest, form, recs)
            best[name]["rest"] = min(best[name]["rest"], t * 1e6 / n)
            w = _time_window(window, got, 212)
            best[name]["window"] = min(best[name]["window"], w * 1e6 / n)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    print("\n== compiled fast path against its pure-Python twins (issue 33, goal 4) ==")
    status = {name: compiled.load(name) is not None for name in compiled.TWINS}
    print("twins built here: " + ", ".join(f"{k.rsplit('.', 1)[1]} {v}" for k, v in status.items()))
    if not all(status.values()):
        print("not every twin is built here (no compiler at install?): nothing to compare")
        return 0
    read = read_side(a.n, a.rounds, a.repeat)
    c_cut = statistics.median(r["cut_us"] for r in read["compiled"])
    p_cut = statistics.median(r["cut_us"] for r in read["pure"])
    c_hdr = statistics.median(r["headers_us"] for r in read["compiled"])
    p_hdr = statistics.median(r["headers_us"] for r in read["pure"])
    print(
        f"read, a frame from the socket's bytes to the reader's buffer: compiled {c_cut:.2f} us, "
        f"pure {p_cut:.2f} us: {p_cut / c_cut:.1f} x cheaper"
    )
    print(
        f"read, a header block: compiled {c_hdr:.2f} us, pure {p_hdr:.2f} us: "
        f"{p_hdr / c_hdr:.1f} x cheaper"
    )
    pub = publish_side(a.n, a.rounds, a.repeat)
    if pub is not None:
        c, p = pub["compiled"], pub["pure"]
        print(
            f"publish, a record's msg-id, header block and frame rest: compiled "
            f"{c['rest']:.2f} us, pure {p['rest']:.2f} us: {p['rest'] / c['rest']:.1f} x cheaper"
        )
        print(
            f"publish, a frame of a window: compiled {c['window']:.2f} us, pure "
            f"{p['window']:.2f} us: {p['window'] / c['window']:.1f} x cheaper"
        )
    dest = Path(".bench")
    dest.mkdir(exist_ok=True)
    (dest / "compiled.json").write_text(json.dumps({"read": read, "publish": pub}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
