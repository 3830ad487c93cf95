"""`group delete` of a group that is gone but left dead letters words the fix in the terms of
the interface in use: `--dead-letters` on the command line, `dead_letters=True` in Python
(issue 15 item 10)."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from streamcheck import write_jsonl

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.admin.delete import delete_group
from airflow_nats_ordered.core.admin.drain import wait_drained
from airflow_nats_ordered.core.admin.membership import GroupNotFoundError
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool

N = 20


def _rejects_every_tenth(msg):
    if json.loads(msg.data)["i"] % 10 == 0:
        raise RuntimeError("rejected")


def test_deleting_a_gone_group_with_dead_letters_names_the_cli_flag(
    shared_nats_server, unique_name, tmp_path, capsys
):
    url = shared_nats_server.url
    rows = write_jsonl(tmp_path / "rows.jsonl", ({"k": f"k{i % 7}", "i": i} for i in range(N)))
    assert cli(["provision", "--stream", unique_name, "--partitions", "2", "--server", url]) == 0
    assert (
        cli(["publish", "--stream", unique_name, str(rows), "--key-field", "k", "--server", url])
        == 0
    )
    cfg = WorkerConfig(
        unique_name, "g", member_id="m", lease_ttl=2.0, commit_interval=0.1, max_retries=0
    )

    async def drained():
        async with WorkerPool(url, cfg, _rejects_every_tenth, size=1):
            nc = await nats.connect(url)
            await wait_drained(nc, unique_name, "g", timeout=60)
            await nc.close()

    asyncio.run(drained())
    delete = ["group", "delete", "--stream", unique_name, "--group", "g", "--server", url]
    assert cli(delete) == 0  # the state goes, the dead letters stay

    capsys.readouterr()
    assert cli(delete) == 2
    err = capsys.readouterr().err
    assert f"group g of stream {unique_name} does not exist" in err
    assert f"its {N // 10} dead letter(s) are kept: pass --dead-letters to purge them" in err
    assert "dead_letters=True" not in err  # the Python parameter means nothing here

    async def python_api():
        nc = await nats.connect(url)
        try:
            with pytest.raises(GroupNotFoundError) as gone:
                await delete_group(nc, unique_name, "g")
        finally:
            await nc.close()
        return gone.value

    gone = asyncio.run(python_api())
    assert "pass dead_letters=True to purge them" in str(gone) and gone.dead_letters_kept == N // 10

    assert cli([*delete, "--dead-letters"]) == 0  # what the message said to do
    assert f"dead letters: {N // 10} purged" in capsys.readouterr().out
