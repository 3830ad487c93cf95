"""Producer ids that make a rerun store nothing twice (issue 15 items 1 and 2), against a
real nats-server: an empty or blank id is refused on every interface instead of being taken
for "none given" (which published everything again), the README's publish example runs as
written, and a file refused at a malformed line, once fixed, is stored exactly once when
re-published the way the error says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from locations import ROOT
from spark_helpers import make_stream, on_server, stored

from airflow_nats_ordered import cli
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.publish.config import PublisherConfig
from airflow_nats_ordered.core.publish.publisher import OrderedPublisher

README = ROOT / "README.md"


@pytest.fixture(autouse=True)
def _no_nats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("NATS_"):
            monkeypatch.delenv(var)


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize("value", ["", "   "])
def test_cli_refuses_an_empty_producer_id_naming_the_flag(
    capsys, tmp_path, nats_url, unique_name, value
):
    make_stream(nats_url, unique_name, 2)
    path = tmp_path / "in.jsonl"
    path.write_text(_lines([{"k": "a"}, {"k": "b"}]))
    argv = ["publish", "--stream", unique_name, str(path), "--key-field", "k"]
    rc = cli.main([*argv, "--producer-id", value, "--server", nats_url])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "argument --producer-id" in err and "is empty" in err, err
    assert "unset shell variable" in err, err
    assert stored(nats_url, unique_name) == []  # nothing was published


@pytest.mark.parametrize("value", ["", " \t"])
def test_python_publisher_refuses_an_empty_producer_id_naming_the_parameter(
    nats_url, unique_name, value
):
    with pytest.raises(ConfigError, match=r"producer_id is empty"):
        PublisherConfig(producer_id=value)
    make_stream(nats_url, unique_name, 1)

    async def make(nc):
        return OrderedPublisher(nc, unique_name, producer_id=value)

    with pytest.raises(ConfigError, match=r"producer_id is empty"):
        on_server(nats_url, make)
    # left out, a publisher still gets a unique id of its own
    assert PublisherConfig().producer_id is None


def test_publish_operator_refuses_an_empty_producer_id_also_once_rendered():
    from airflow_nats_ordered.operators.publish import NatsPublishOperator

    common = {"task_id": "pub", "stream": "S", "path": "/x.jsonl", "key_field": "k"}
    with pytest.raises(ConfigError, match=r"'pub': producer_id is empty"):
        NatsPublishOperator(**common, producer_id="")
    op = NatsPublishOperator(**common, producer_id="{{ var.value.run_id }}")
    op.producer_id = " "  # what the template rendered to
    # at run time it fails the task at once (no retry can fix it), with the same message
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(
        AirflowFailException, match=r"producer_id is empty.*<dag id>.<task id>"
    ) as err:
        op.execute({})
    assert isinstance(err.value.__cause__, ConfigError)


def test_spark_option_refuses_an_empty_producer_id_naming_the_option():
    from airflow_nats_ordered.spark.options import SinkOptions

    with pytest.raises(ConfigError, match=r"option producerId .* given but empty"):
        SinkOptions.from_spark({"stream": "S", "keyColumn": "k", "producerId": "  "})


def _readme_publish_example() -> str:
    """The README's publish example: its lines from ``RUN_ID=`` to the end of the publish
    command (continuation lines included), exactly as written."""
    text = README.read_text()
    block = text.split("## Command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("RUN_ID="))
    end = next(i for i, line in enumerate(lines) if line.startswith("nats-ordered publish"))
    while lines[end].rstrip().endswith("\\"):
        end += 1
    return "\n".join(lines[start : end + 1])


def test_readme_publish_example_runs_as_written_and_a_rerun_stores_nothing_twice(
    tmp_path, nats_url, unique_name
):
    example = _readme_publish_example()
    assert "--producer-id" in example
    make_stream(nats_url, unique_name, 4)
    rows = [{"customer_id": f"c{i % 5}", "created_at": i, "n": i} for i in range(20)]
    (tmp_path / "orders.jsonl").write_text(_lines(rows))
    script = example.replace("--stream ORDERS", f"--stream {unique_name}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "RUN_ID"))}
    env["NATS_URL"] = nats_url
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for _ in range(2):
        r = subprocess.run(
            ["bash", "-euc", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, f"{script}\n{r.stdout}{r.stderr}"
    got = stored(nats_url, unique_name)
    assert len(got) == len(rows), f"{len(got)} messages stored for {len(rows)} records"
    assert sorted(json.loads(s.data)["n"] for s in got) == list(range(len(rows)))


@pytest.mark.parametrize("given_id", [None, "orders-fix-1"])
def test_a_fixed_file_republished_as_the_error_says_stores_each_record_once(
    capsys, tmp_path, nats_url, unique_name, given_id
):
    make_stream(nats_url, unique_name, 3)
    rows = [{"k": f"key{i % 4}", "n": i} for i in range(8)]
    path = tmp_path / "orders.jsonl"
    bad = _lines(rows[:5]) + '{"k": "key1", "n": 5,,}\n' + _lines(rows[6:])
    path.write_text(bad)
    base = ["publish", "--stream", unique_name, str(path), "--key-field", "k"]
    base += ["--server", nats_url, "--json"]
    if given_id is not None:
        base += ["--producer-id", given_id]
    assert cli.main(base) == 2
    out, err = capsys.readouterr()
    assert "line 6 is not valid JSON" in err, err
    assert len(stored(nats_url, unique_name)) == 5  # the records before the bad line
    m = re.search(r"re-publish the fixed file with (?:the same )?--producer-id (\S+) ", err)
    assert m, err
    producer_id = m.group(1)
    report = json.loads(out)
    assert report["republish_with"] == producer_id  # the id alone (issue 28 item 9)
    assert report["producer_id"] == producer_id
    if given_id is not None:
        assert producer_id == given_id
    else:
        assert "new default id" in err, err

    path.write_text(_lines(rows))  # the line fixed: a new content digest
    argv = ["publish", "--stream", unique_name, str(path), "--key-field", "k"]
    argv += ["--server", nats_url, "--producer-id", producer_id]
    assert cli.main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    got = stored(nats_url, unique_name)
    assert len(got) == len(rows), f"{len(got)} messages stored for {len(rows)} records"
    assert sorted(json.loads(s.data)["n"] for s in got) == list(range(len(rows)))
    assert len({s.msg_id for s in got}) == len(rows)


def test_an_input_error_says_what_was_published_before_it(capsys, tmp_path, nats_url, unique_name):
    """--order-by reads the whole file before publishing: a bad line there published nothing,
    and the error must not say that records before it were published (it did)."""
    make_stream(nats_url, unique_name, 3)
    rows = [{"k": f"key{i % 4}", "n": i} for i in range(8)]
    path = tmp_path / "orders.jsonl"
    path.write_text(_lines(rows[:5]) + '{"k": "key1", "n": 5,,}\n' + _lines(rows[6:]))
    base = ["publish", "--stream", unique_name, str(path), "--key-field", "k"]
    base += ["--server", nats_url]
    assert cli.main([*base, "--order-by", "n"]) == 2
    err = capsys.readouterr().err
    assert "line 6 is not valid JSON" in err and "Nothing was published" in err, err
    assert "were published" not in err, err
    assert stored(nats_url, unique_name) == []
    assert cli.main(base) == 2  # streaming: the 5 before it went out, and it says so
    err = capsys.readouterr().err
    assert "The 5 record(s) before it were published; to store them only once" in err, err
    assert len(stored(nats_url, unique_name)) == 5
