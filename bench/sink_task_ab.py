"""The sink's routed-row batch path without Spark, per code tree (child per tree, alternated):
ResumingPublisher.publish_routed on N rows (5,000 keys, ~100 B payloads, routed order), Python
CPU (process_time) per row of the whole publish (start..close), and OrderedPublisher.publish_many
on the same rows as the core reference."""

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(url, n, tree):
    import nats

    from airflow_nats_ordered.core.publish.config import PublisherConfig
    from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
    from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
    from airflow_nats_ordered.core.stream.partitioning import partition_for
    from airflow_nats_ordered.spark.resume import ResumingPublisher

    keys = [f"customer-{i % 5000}" for i in range(n)]
    pays = [
        b'{"customer":"%s","ts":%d,"amount":%d,"note":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}'
        % (k.encode(), i, i * 7 % 1000)
        for i, k in enumerate(keys)
    ]
    parts = [partition_for(k, 16) for k in keys]
    order = sorted(range(n), key=parts.__getitem__)
    keys = [keys[i] for i in order]
    pays = [pays[i] for i in order]
    parts = [parts[i] for i in order]

    async def go():
        nc = await nats.connect(url)
        out = {}
        for variant in ("core", "sink"):
            s = f"AB{variant}{os.getpid()}{time.time_ns() % 10**6}"
            await provision(nc, StreamSpec(s, partitions=16))
            c0 = time.process_time()
            t0 = time.monotonic()
            if variant == "sink":
                pub = ResumingPublisher(
                    nc, s, PublisherConfig(producer_id="run"), resume={}, run="run", label="t"
                )
                await pub.start()
                for lo in range(0, n, 10_000):
                    await pub.publish_routed(
                        keys[lo : lo + 10_000],
                        pays[lo : lo + 10_000],
                        parts[lo : lo + 10_000],
                        [None] * len(keys[lo : lo + 10_000]),
                        lambda i, e: None,
                    )
                await pub.close()
                assert pub.summary is not None and pub.summary.acked == n
            else:
                core = OrderedPublisher(nc, s, PublisherConfig(producer_id="run"))
                await core.start()
                await core.publish_many(zip(keys, pays, strict=True))
                await core.close()
                assert core.summary is not None and core.summary.acked == n
            out[variant] = ((time.process_time() - c0) / n * 1e6, n / (time.monotonic() - t0))
            await nc.jetstream().delete_stream(s)
        await nc.close()
        return out

    print(json.dumps(asyncio.run(go())))


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        sys.exit()
    n, rounds, trees = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    from pathlib import Path

    from airflow_nats_ordered.embedded.servers import NatsServer

    with tempfile.TemporaryDirectory() as d, NatsServer(Path(d) / "n") as s:
        res: dict[str, list[dict[str, list[float]]]] = {t: [] for t in trees}
        for r in range(rounds):
            for t in trees if r % 2 == 0 else trees[::-1]:
                env = dict(os.environ, PYTHONPATH=t)
                p = subprocess.run(
                    [sys.executable, __file__, "--child", s.url, str(n), t],
                    env=env,
                    capture_output=True,
                    text=True,
                    cwd=t,
                )
                if p.returncode:
                    print(p.stderr[-2000:])
                    continue
                res[t].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(r, t, res[t][-1], flush=True)
        for t, rs in res.items():
            print(
                t,
                "core us/rec median {:.2f}".format(statistics.median(x["core"][0] for x in rs)),
                "sink us/row median {:.2f}".format(statistics.median(x["sink"][0] for x in rs)),
                "rounds sink",
                [round(x["sink"][0], 2) for x in rs],
                "core",
                [round(x["core"][0], 2) for x in rs],
            )
