"""Record readers: formats, key/msg-id extraction, JSON-safe payloads, sorting, clear errors."""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import gzip
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from streamcheck import write_jsonl

from airflow_nats_ordered.core.errors import KeyTextError
from airflow_nats_ordered.core.stream.keys import key_text
from airflow_nats_ordered.inputs.files import PROBE_ROWS, detect_format, open_records
from airflow_nats_ordered.inputs.records import InputError, InputRecord, json_safe

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _read(path: Path | str, **kw: Any) -> list[InputRecord]:
    with open_records(path, **kw) as reader:
        return list(reader)


def _payloads(records: list[InputRecord]) -> list[dict[str, Any]]:
    return [json.loads(r.payload) for r in records]


# ---------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("a.jsonl", "jsonl"),
        ("a.ndjson", "jsonl"),
        ("A.JSON", "jsonl"),
        ("a.jsonl.gz", "jsonl"),
        ("a.csv", "csv"),
        ("a.csv.gz", "csv"),
        ("a.parquet", "parquet"),
        ("-", "jsonl"),
    ],
)
def test_format_follows_the_extension(name: str, fmt: str) -> None:
    assert detect_format(name) == fmt


def test_format_flag_wins_and_unknown_extensions_say_what_to_pass() -> None:
    assert detect_format("data.txt", "csv") == "csv"
    with pytest.raises(InputError, match=r"--format jsonl\|csv\|parquet"):
        detect_format("data.txt")
    with pytest.raises(InputError, match="unknown input format 'xml'"):
        detect_format("data.xml", "xml")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot open input .*nope.jsonl.*check the path"):
        open_records(tmp_path / "nope.jsonl", key_field="k")


# ---------------------------------------------------------------------------- JSON lines


def test_jsonl_rows_become_compact_json_with_key_and_msg_id(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"id": "a", "k": "x", "v": 1}\n'
        "\n"  # blank lines are skipped, line numbers stay physical
        '{"id": 7, "k": 42, "v": "é"}\n'
        '{"id": "c", "k": -10000000000000000000000}\n'
        '{"id": "d", "k": null}\n'
        '{"id": "e", "k": ""}\n'
        '{"id": "", "v": 2}\n'
    )
    recs = _read(path, key_field="k", msg_id_field="id")
    assert [r.key for r in recs] == ["x", "42", "-10000000000000000000000", None, None, None]
    assert [r.msg_id for r in recs] == ["a", "7", "c", "d", "e", None]
    assert [r.where for r in recs] == ["line 1", "line 3", "line 4", "line 5", "line 6", "line 7"]
    assert recs[0].payload == b'{"id":"a","k":"x","v":1}'
    assert recs[1].payload == '{"id":7,"k":42,"v":"é"}'.encode()


def test_json_safe_values() -> None:
    ts = dt.datetime(2024, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)
    assert json_safe(
        {
            "ts": ts,
            "d": dt.date(2024, 1, 2),
            "dec": decimal.Decimal("1.10"),
            "b": b"\x00\xff",
            "nan": float("inf"),
            "m": [("a", 1)],
            "dur": dt.timedelta(minutes=1),
        }
    ) == {
        "ts": "2024-01-02T03:04:05.678000+00:00",
        "d": "2024-01-02",
        "dec": "1.10",
        "b": "AP8=",
        "nan": None,
        "m": {"a": 1},
        "dur": 60.0,
    }


def test_jsonl_key_field_absent_everywhere_is_an_immediate_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"customer": "a", "ts": 1}] * 3)
    with pytest.raises(InputError) as e:
        open_records(path, key_field="custmer")
    msg = str(e.value)
    assert "--key-field 'custmer' is not a field of" in msg
    assert "'customer', 'ts'" in msg and "Did you mean 'customer'?" in msg


def test_jsonl_key_field_seen_in_a_later_row_is_fine(tmp_path: Path) -> None:
    rows = [{"v": i} for i in range(10)] + [{"k": "x", "v": 10}]
    recs = _read(write_jsonl(tmp_path / "in.jsonl", rows), key_field="k")
    assert [r.key for r in recs] == [None] * 10 + ["x"]


def test_jsonl_probe_is_bounded(tmp_path: Path) -> None:
    rows = [{"v": i} for i in range(PROBE_ROWS + 5)] + [{"k": "x"}]
    with pytest.raises(InputError, match=f"first {PROBE_ROWS} records"):
        open_records(write_jsonl(tmp_path / "in.jsonl", rows), key_field="k")


def test_invalid_json_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"k": "a"}\n{"k": "b",\n{"k": "c"}\n')
    with open_records(path, key_field="k") as reader:
        it = iter(reader)
        assert next(it).key == "a"
        with pytest.raises(InputError, match=r"in.jsonl line 2 is not valid JSON"):
            next(it)


def test_json_array_file_gets_a_conversion_hint(tmp_path: Path) -> None:
    path = tmp_path / "in.json"
    path.write_text('[{"k": "a"}, {"k": "b"}]\n')
    with pytest.raises(InputError, match=r"holds a JSON list.*jq -c"):
        _read(path, key_field="k")


def test_stdin_and_gzip(tmp_path: Path) -> None:
    data = b'{"k": "a", "n": 1}\n{"k": "b", "n": 2}\n'
    recs = _read("-", key_field="k", stdin=io.BytesIO(data))
    assert [r.key for r in recs] == ["a", "b"]
    gz = tmp_path / "in.jsonl.gz"
    gz.write_bytes(gzip.compress(data))
    assert [r.key for r in _read(gz, key_field="k")] == ["a", "b"]


def test_without_order_by_rows_stream_without_reading_everything() -> None:
    big = b"".join(b'{"k": "k%d", "pad": "%s"}\n' % (i, b"x" * 100) for i in range(20_000))
    stdin = io.BytesIO(big)
    with open_records("-", key_field="k", stdin=stdin) as reader:
        first = next(iter(reader))
        assert first.key == "k0"
        assert stdin.tell() < len(big) // 10  # only a buffer's worth was read


# ---------------------------------------------------------------------------- CSV


def test_csv_rows_are_string_objects(tmp_path: Path) -> None:
    path = _csv(
        tmp_path / "in.csv",
        ["id", "customer", "note"],
        [["1", "c1", "has, comma"], ["2", "", "multi\nline"], ["3", "c3", ""]],
    )
    recs = _read(path, key_field="customer", msg_id_field="id")
    assert _payloads(recs) == [
        {"id": "1", "customer": "c1", "note": "has, comma"},
        {"id": "2", "customer": "", "note": "multi\nline"},
        {"id": "3", "customer": "c3", "note": ""},
    ]
    assert [r.key for r in recs] == ["c1", None, "c3"]
    assert [r.msg_id for r in recs] == ["1", "2", "3"]
    assert [r.where for r in recs] == ["line 2", "line 4", "line 5"]


def test_csv_with_bom_and_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_bytes("\ufeffid,Customer\n1,a\n".encode())
    assert [r.key for r in _read(path, key_field="Customer")] == ["a"]
    with pytest.raises(InputError) as e:
        open_records(path, key_field="customer")
    assert "is not a column of" in str(e.value) and "'id', 'Customer'" in str(e.value)
    assert "Did you mean 'Customer'?" in str(e.value)
    with pytest.raises(InputError, match="--msg-id-field 'uid'"):
        open_records(path, key_field="Customer", msg_id_field="uid")
    with pytest.raises(InputError, match="--order-by 'ts'"):
        open_records(path, key_field="Customer", order_by="ts")


def test_csv_ragged_row_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("a,b\n1,2\n3,4,5\n")
    with pytest.raises(InputError, match=r"line 3 has 3 fields but the header has 2"):
        _read(path, key_field="a")


def test_csv_duplicate_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("a,b,a\n1,2,3\n")
    with pytest.raises(InputError, match="repeats column"):
        open_records(path, key_field="a")


# ---------------------------------------------------------------------------- order-by


def test_order_by_is_a_stable_sort_with_nulls_last(tmp_path: Path) -> None:
    rows = [
        {"k": "a", "ts": 3, "n": 0},
        {"k": "b", "ts": 1, "n": 1},
        {"k": "a", "n": 2},
        {"k": "a", "ts": 1, "n": 3},
        {"k": "b", "ts": 3, "n": 4},
        {"k": "a", "ts": None, "n": 5},
        {"k": "b", "ts": 1, "n": 6},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    assert [p["n"] for p in _payloads(_read(path, key_field="k", order_by="ts"))] == [
        1, 3, 6, 0, 4, 2, 5
    ]  # fmt: skip
    by_two = _read(path, key_field="k", order_by=["k", "ts"])
    assert [p["n"] for p in _payloads(by_two)] == [3, 0, 2, 5, 1, 6, 4]
    assert [r.where for r in by_two][:2] == ["line 4", "line 1"]  # original positions


def test_order_by_csv_numbers_sort_as_numbers(tmp_path: Path) -> None:
    path = _csv(
        tmp_path / "in.csv", ["k", "n", "s"], [["a", "10", "10"], ["a", "9", "9"], ["a", "", "x"]]
    )
    assert [p["n"] for p in _payloads(_read(path, key_field="k", order_by="n"))] == ["9", "10", ""]
    # a column that is not all numbers sorts as text
    assert [p["s"] for p in _payloads(_read(path, key_field="k", order_by="s"))] == [
        "10",
        "9",
        "x",
    ]


def test_order_by_unknown_jsonl_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"k": "a", "ts": 1}])
    with pytest.raises(InputError, match=r"--order-by 'tss'.*Did you mean 'ts'"):
        open_records(path, key_field="k", order_by="tss")


# ---------------------------------------------------------------------------- Parquet


def _parquet(path: Path) -> Path:
    table = pa.table(
        {
            "id": pa.array([1, 2, 3, 4], pa.int64()),
            "carrier": pa.array(["UA", None, "AA", "UA"]),
            "time_hour": pa.array(
                [
                    dt.datetime(2013, 1, 1, 5, tzinfo=dt.UTC),
                    dt.datetime(2013, 1, 1, 6, tzinfo=dt.UTC),
                    dt.datetime(2013, 1, 1, 4, tzinfo=dt.UTC),
                    dt.datetime(2013, 1, 1, 5, 30, tzinfo=dt.UTC),
                ],
                pa.timestamp("us", tz="UTC"),
            ),
            "day": pa.array([dt.date(2013, 1, 1)] * 4),
            "dep_delay": pa.array([1.5, float("nan"), None, -2.0]),
            "price": pa.array([decimal.Decimal("9.99")] * 4, pa.decimal128(5, 2)),
            "tags": pa.array([["a"], [], None, ["b", "c"]]),
        }
    )
    pq.write_table(table, path)
    return path


def test_parquet_values_become_json_safe(tmp_path: Path) -> None:
    recs = _read(_parquet(tmp_path / "f.parquet"), key_field="carrier", msg_id_field="id")
    assert [r.key for r in recs] == ["UA", None, "AA", "UA"]
    assert [r.msg_id for r in recs] == ["1", "2", "3", "4"]
    assert [r.where for r in recs] == ["row 1", "row 2", "row 3", "row 4"]
    first, second = _payloads(recs)[:2]
    assert first == {
        "id": 1,
        "carrier": "UA",
        "time_hour": "2013-01-01T05:00:00+00:00",
        "day": "2013-01-01",
        "dep_delay": 1.5,
        "price": "9.99",
        "tags": ["a"],
    }
    assert second["dep_delay"] is None and second["carrier"] is None


def test_parquet_order_by_timestamp_and_missing_column(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "f.parquet")
    recs = _read(path, key_field="carrier", order_by="time_hour")
    assert [p["id"] for p in _payloads(recs)] == [3, 1, 4, 2]
    with pytest.raises(InputError) as e:
        open_records(path, key_field="carier")
    assert "Its schema has: 'id', 'carrier', 'time_hour'" in str(e.value)


def test_parquet_without_pyarrow_says_how_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _parquet(tmp_path / "f.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import now raises ImportError
    with pytest.raises(InputError, match=r"needs pyarrow.*pip install"):
        open_records(path, key_field="carrier")


def test_not_a_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "f.parquet"
    path.write_text("hello")
    with pytest.raises(InputError, match="is not a readable Parquet file"):
        open_records(path, key_field="k")


def test_rows_in_memory_become_records_exactly_as_from_a_file():
    import datetime as dt

    from airflow_nats_ordered.inputs.files import records_from_rows

    rows = [
        {"tail": "N2", "t": dt.datetime(2013, 1, 1, 6, 0), "n": 2},
        {"tail": "N1", "t": dt.datetime(2013, 1, 1, 5, 0), "n": 1},
        {"tail": None, "t": dt.datetime(2013, 1, 1, 7, 0), "n": 3},
    ]
    recs = list(records_from_rows(rows, key_field="tail", msg_id_field="n", order_by="t"))
    assert [r.key for r in recs] == ["N1", "N2", None]  # sorted; a missing key stays None
    assert [r.msg_id for r in recs] == ["1", "2", "3"]
    assert [r.where for r in recs] == ["record 2", "record 1", "record 3"]
    assert json.loads(recs[0].payload) == {"tail": "N1", "t": "2013-01-01T05:00:00", "n": 1}
    with pytest.raises(InputError, match="record 2 is a int, not an object"):
        list(records_from_rows([{"a": 1}, 5], key_field="a"))
    with pytest.raises(InputError, match="must be a list of objects"):
        list(records_from_rows({"a": 1}, key_field="a"))


# ---------------------------------------------------------------------------- key text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("N123", "N123"),
        (" lead", " lead"),  # strings are themselves, blanks included
        ("", None),
        (None, None),
        (0, "0"),
        (42, "42"),
        (-7, "-7"),
        (10**22, "10000000000000000000000"),
        (-(10**22), "-10000000000000000000000"),
        ("Zürich".encode(), "Zürich"),
        (b"", None),
    ],
)
def test_key_text_is_the_canonical_rule(value: Any, text: str | None) -> None:
    assert key_text(value) == text


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (1.0, "is a floating-point number"),
        (3e-07, "is a floating-point number"),
        (float("nan"), "is a floating-point number"),
        (True, "is a boolean"),
        (False, "is a boolean"),
        (decimal.Decimal("1.10"), "is a decimal number"),
        ({"b": 1}, "is an object"),
        ([1], "is an array"),
        (dt.date(2024, 1, 2), "is a date"),
        (dt.datetime(2024, 1, 2, 3), "is a timestamp"),
        (b"caf\xe9", "is binary that is not UTF-8"),
        ("x\ud800", "is not valid text"),
    ],
)
def test_key_text_refuses_values_without_one_spelling(value: Any, kind: str) -> None:
    with pytest.raises(KeyTextError) as e:
        key_text(value)
    assert kind in str(e.value) and str(e.value).startswith("key_field value ")


def _jsonl_with_key(tmp_path: Path, raw_key: str) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text('{"k": "a", "v": 1}\n' + f'{{"k": {raw_key}, "v": 2}}\n')
    return path


@pytest.mark.parametrize(
    ("raw_key", "key"),
    [
        ("10000000000000000000000", "10000000000000000000000"),
        ("-5", "-5"),
        ("null", None),
        ('"1.0"', "1.0"),
        ('" lead"', " lead"),
    ],
)
def test_jsonl_keys_follow_the_canonical_rule(tmp_path: Path, raw_key: str, key: Any) -> None:
    assert [r.key for r in _read(_jsonl_with_key(tmp_path, raw_key), key_field="k")] == [
        "a",
        key,
    ]


@pytest.mark.parametrize(
    ("raw_key", "why"),
    [
        ("1.0", "value 1.0 is a floating-point number"),
        ("3e-07", "value 3e-07 is a floating-point number"),
        ("1e22", "value 1e+22 is a floating-point number"),
        ("true", "value True is a boolean"),
        ('{"a": 1}', "value {'a': 1} is an object"),
        ('"' + "k" * 4097 + '"', "is 4097 bytes in UTF-8; at most 4096"),
        ('"\\ud800"', "is not valid text"),
    ],
)
def test_a_jsonl_key_without_canonical_text_is_refused_naming_the_flag_and_line(
    tmp_path: Path, raw_key: str, why: str
) -> None:
    with pytest.raises(InputError) as e:
        _read(_jsonl_with_key(tmp_path, raw_key), key_field="k")
    msg = str(e.value)
    assert "in.jsonl line 2: --key-field 'k' value " in msg and why in msg, msg
    assert "make the field a string" in msg or "shorten" in msg or "fix the value" in msg


def test_a_jsonl_msg_id_follows_the_same_rule(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"k": "a", "id": 10000000000000000000001}\n{"k": "a", "id": 2.5}\n')
    with open_records(path, key_field="k", msg_id_field="id") as reader:
        it = iter(reader)
        assert next(it).msg_id == "10000000000000000000001"
        with pytest.raises(InputError, match=r"line 2: --msg-id-field 'id' value 2.5 is a float"):
            next(it)


def test_csv_keys_are_the_text_as_written(tmp_path: Path) -> None:
    path = _csv(tmp_path / "in.csv", ["k"], [["1.0"], ["007"], [" lead"], [""]])
    assert [r.key for r in _read(path, key_field="k")] == ["1.0", "007", " lead", None]


def test_parquet_integer_and_binary_keys_are_canonical_text(tmp_path: Path) -> None:
    path = tmp_path / "k.parquet"
    pq.write_table(
        pa.table(
            {
                "i": pa.array([10**18, -3, None], pa.int64()),
                "u": pa.array([2**64 - 1, 0, 1], pa.uint64()),
                "b": pa.array(["Zürich".encode(), b"", None], pa.binary()),
                "s": pa.array(["x", "y", "z"]).dictionary_encode(),
            }
        ),
        path,
    )
    assert [r.key for r in _read(path, key_field="i")] == ["1000000000000000000", "-3", None]
    assert [r.key for r in _read(path, key_field="u")] == ["18446744073709551615", "0", "1"]
    assert [r.key for r in _read(path, key_field="b")] == ["Zürich", None, None]
    assert [r.key for r in _read(path, key_field="s")] == ["x", "y", "z"]
    # the payload keeps binary as base64, as before
    assert _payloads(_read(path, key_field="i"))[0]["b"] == "WsO8cmljaA=="


@pytest.mark.parametrize(
    ("column", "typ"),
    [("dep_delay", "double"), ("price", "decimal128(5, 2)"), ("day", "date32[day]")],
)
def test_a_parquet_key_column_without_canonical_text_is_refused_before_publishing(
    tmp_path: Path, column: str, typ: str
) -> None:
    with pytest.raises(InputError) as e:
        open_records(_parquet(tmp_path / "f.parquet"), key_field=column)
    msg = str(e.value)
    assert f"--key-field {column!r} is a Parquet {typ} column" in msg, msg
    assert "write the column as a string" in msg
    with pytest.raises(InputError, match=r"^key_field 'day' is a Parquet"):
        open_records(tmp_path / "f.parquet", key_field="day", python_terms=True)


def test_a_parquet_binary_key_that_is_not_utf8_is_refused_naming_the_row(tmp_path: Path) -> None:
    path = tmp_path / "k.parquet"
    pq.write_table(pa.table({"b": pa.array([b"ok", b"caf\xe9"], pa.binary())}), path)
    with pytest.raises(InputError, match=r"row 2: --key-field 'b' value b'caf\\xe9' is binary"):
        _read(path, key_field="b")


def test_rows_in_memory_follow_the_same_rule_in_python_terms():
    from airflow_nats_ordered.inputs.files import records_from_rows

    rows = [{"k": 10**22}, {"k": b"caf\xc3\xa9"}, {"k": -1}, {"k": None}]
    assert [r.key for r in records_from_rows(rows, key_field="k")] == [
        "10000000000000000000000",
        "café",
        "-1",
        None,
    ]
    for bad, why in [
        (1.0, "1.0 is a floating-point number"),
        (True, "True is a boolean"),
        (decimal.Decimal("1"), "is a decimal number"),
        (dt.datetime(2024, 1, 1), "is a timestamp"),
        ("k" * 4097, "is 4097 bytes in UTF-8; at most 4096"),
    ]:
        with pytest.raises(InputError) as e:
            list(records_from_rows([{"k": "a"}, {"k": bad}], key_field="k"))
        assert str(e.value).startswith("record 2: key_field 'k' value "), str(e.value)
        assert why in str(e.value), str(e.value)
