"""A stream whose subjects are not the layout its metadata describes is refused by every
command with one message naming the mismatch and the fix (issue 28 item 5), and the
repartition it names completes the change."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import nats
import pytest
from locations import TESTS

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.errors import StreamConflictError
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher
from airflow_nats_ordered.core.stream.layout import META_EPOCH, META_LAYOUTS
from airflow_nats_ordered.core.stream.partitioned import (
    META_PARTITIONS,
    StreamSpec,
    describe,
    provision,
)

TESTS = str(TESTS)


def _mismatched(url: str, stream: str, layouts: str | None) -> None:
    """A 4-partition stream holding records, whose metadata then says 8 partitions in
    epoch 1 while its subjects stay the 4 of epoch 0."""

    async def main() -> None:
        nc = await nats.connect(url)
        await provision(nc, StreamSpec(stream, partitions=4, storage="memory"))
        async with OrderedPublisher(nc, stream) as pub:
            for i in range(40):
                await pub.publish(f"k{i % 10}", b"{}", msg_id=f"m{i}")
        cfg = (await nc.jetstream().stream_info(stream)).config
        meta = {**cfg.metadata, META_PARTITIONS: "8", META_EPOCH: "1"}
        if layouts is not None:
            meta[META_LAYOUTS] = layouts
        cfg.metadata = meta
        await nc.jetstream().update_stream(cfg)
        await nc.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "layouts",
    [None, '[{"epoch":0,"partitions":4,"switch_seq":0}]'],
    ids=["no-layouts", "pending-layout"],
)
def test_a_stream_whose_subjects_are_not_its_metadata_layout_is_refused_with_the_fix(
    shared_nats_server, unique_name, tmp_path, capsys, layouts
):
    url, stream = shared_nats_server.url, unique_name
    _mismatched(url, stream, layouts)
    prefix = stream.lower()
    fix = f"nats-ordered repartition --stream {stream} --partitions 8"

    def refused(err: str) -> None:
        assert "metadata says 8 partitions in layout epoch 1" in err, err
        assert f"takes {prefix}.p.0 to {prefix}.p.3" in err, err
        assert fix in err, err

    # info: one refusal, not a list of strays
    assert cli.main(["info", "--stream", stream, "--server", url]) == 2
    out = capsys.readouterr()
    refused(out.err)
    assert "stray" not in out.out + out.err
    # publish: the same refusal, nothing published
    records = tmp_path / "r.jsonl"
    records.write_text('{"k": "a"}\n')
    argv = ["publish", "--stream", stream, str(records), "--key-field", "k", "--server", url]
    assert cli.main(argv) == 2
    refused(capsys.readouterr().err)
    # worker: refuses to join (it used to join silently and run)
    worker = subprocess.run(
        [
            sys.executable,
            "-m",
            "airflow_nats_ordered.cli",
            "worker",
            "--stream",
            stream,
            "--group",
            "g",
            "--handler",
            "chaos_handlers:ignore",
            "--server",
            url,
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 2, (worker.returncode, worker.stderr[-2000:])
    refused(worker.stderr)

    # the command it names completes the change
    assert cli.main([*fix.split()[1:], "--server", url, "--json"]) == 0
    done = capsys.readouterr()
    result = json.loads(done.out)
    assert result["action"] == "completed", done.err
    assert (result["previous_partitions"], result["partitions"], result["epoch"]) == (4, 8, 1)
    assert result["switch_seq"] == 40  # the last record of the 4-partition layout

    async def after() -> None:
        nc = await nats.connect(url)
        s = await describe(nc, stream)
        assert s.explicit_subjects and s.subject(7) == f"{prefix}.p.e1-7"
        assert [lay.to_json() for lay in s.layouts] == [
            {"epoch": 0, "partitions": 4, "switch_seq": 40}
        ]
        await nc.close()

    asyncio.run(after())
    assert cli.main(["info", "--stream", stream, "--server", url]) == 0


def test_describe_refuses_the_mismatch_but_the_repartition_can_read_it(
    shared_nats_server, unique_name
):
    url, stream = shared_nats_server.url, unique_name
    _mismatched(url, stream, None)

    async def main() -> None:
        nc = await nats.connect(url)
        # (a LayoutMismatchError)
        with pytest.raises(StreamConflictError, match="subjects and its metadata disagree"):
            await describe(nc, stream)
        s = await describe(nc, stream, check_layout=False)
        assert (s.partitions, s.epoch, s.explicit_subjects) == (8, 1, False)
        await nc.close()

    asyncio.run(main())
