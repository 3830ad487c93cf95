"""``nats-ordered publish`` keeps keys exact and names --key-field for a key value it cannot
send (issue 13 items 4 and 5), against a real nats-server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from spark_helpers import make_stream, on_server

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.stream.keys import message_key
from airflow_nats_ordered.core.stream.partitioning import partition_for


@pytest.fixture(autouse=True)
def _no_nats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("NATS_"):
            monkeypatch.delenv(var)


def _publish(capsys, url: str, stream: str, path: Path) -> tuple[int, str]:
    rc = cli.main(["publish", "--stream", stream, str(path), "--key-field", "k", "--server", url])
    return rc, capsys.readouterr().err


def test_cli_keys_arrive_exact_and_integers_are_their_digits(
    capsys, tmp_path, nats_url, unique_name
):
    make_stream(nats_url, unique_name, 4)
    keys = [" lead", "trail ", "Zürich", "a\r\nb", 10**22, -3]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"k": k, "i": i}) + "\n" for i, k in enumerate(keys)))
    rc, err = _publish(capsys, nats_url, unique_name, path)
    assert rc == 0, err

    async def read(nc):
        sub = await nc.jetstream().pull_subscribe(">", stream=unique_name)
        return [(message_key(m.headers), m.subject) for m in await sub.fetch(6, timeout=30)]

    texts = [k if isinstance(k, str) else str(k) for k in keys]
    got = on_server(nats_url, read)
    assert sorted(k for k, _ in got) == sorted(texts)
    for k, subject in got:
        assert subject.endswith(f".p.{partition_for(k, 4)}")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1.0", "value 1.0 is a floating-point number"),
        ("true", "value True is a boolean"),
        ('"' + "k" * 4097 + '"', "is 4097 bytes in UTF-8; at most 4096"),
    ],
)
def test_cli_refuses_a_key_it_cannot_send_naming_the_flag(
    capsys, tmp_path, nats_url, unique_name, value, why
):
    make_stream(nats_url, unique_name, 2)
    path = tmp_path / "in.jsonl"
    path.write_text('{"k": "ok"}\n{"k": %s}\n' % value)  # noqa: UP031
    rc, err = _publish(capsys, nats_url, unique_name, path)
    assert rc == 2, err
    assert "line 2: --key-field 'k' value " in err and why in err, err
