"""Record readers for the ``nats-ordered publish`` command: JSON lines, CSV and Parquet files.

This module reads files (:func:`open_records`) and in-memory rows (:func:`records_from_rows`);
what a row becomes is :mod:`.records` and the ``order_by`` rule :mod:`.order`.

Every input row becomes an :class:`InputRecord`:

* ``payload``: the row as compact JSON (UTF-8). JSON lines are re-serialized compactly; a CSV
  row is the object of its header names to their (string) values; a Parquet row has its
  values made JSON-safe (see :func:`~.records.json_safe`: timestamps and dates become ISO 8601
  strings, decimals strings, binary base64, NaN/inf null).
* ``key``: the canonical text of the row's ``key_field`` value (see
  :func:`~..core.stream.keys.key_text`: strings as they are, integers as exact decimal
  digits, UTF-8 binary as its text), or ``None`` when the field is missing, null or empty;
  the publisher refuses such a record with ``MissingKeyError`` (unless keyless round-robin
  was asked for), and the CLI counts it. A value with no canonical text (a float, decimal,
  boolean, object, array, date or timestamp), invalid text, or a key over 4096 UTF-8 bytes
  is an :class:`InputError` naming the row, the field and the value (for Parquet, a key
  column of such a type is refused when the file is opened, before anything is published).
* ``msg_id``: the text of the row's ``msg_id_field`` value when that field was given
  (``None`` if the row has none), by the same rule, else ``None`` (the publisher derives
  one).
* ``where``: ``"line N"`` (JSON lines, CSV: the physical line the row ends on) or
  ``"row N"`` (Parquet, 1-based), for reporting refused records.

Memory: without ``order_by`` rows stream through with bounded memory (one line, one CSV
record or one Parquet batch at a time). ``order_by`` sorts the rows (stably, so rows with
equal sort values keep their file order) and therefore **loads the whole input in memory**.

A ``key_field`` (or ``msg_id_field``/``order_by`` column) that the input does not have at
all is an immediate :class:`InputError` naming the field and the columns that exist: for
CSV and Parquet the header/schema decides; for JSON lines, the field must appear in at
least one of the first :data:`PROBE_ROWS` objects (or of all of them, when sorting).
"""

from __future__ import annotations

import contextlib
import csv
import difflib
import gzip
import hashlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, cast

from airflow_nats_ordered.inputs.order import numeric_columns, sorted_rows
from airflow_nats_ordered.inputs.records import (
    CLI_NAMES,
    PYTHON_NAMES,
    InputError,
    InputRecord,
    dumps_payload,
    json_safe,
    key_and_msg_id,
)

#: Input formats and the file extensions that select them (a trailing ``.gz`` is allowed
#: for JSON lines and CSV).
FORMATS: dict[str, tuple[str, ...]] = {
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "csv": (".csv",),
    "parquet": (".parquet", ".pq"),
}

#: JSON lines: how many objects are read ahead to check that ``key_field`` exists at all.
PROBE_ROWS = 1000

_PARQUET_BATCH = 8192
_MAX_EXAMPLE_COLUMNS = 30


# ---------------------------------------------------------------------------- formats


def detect_format(path: str, fmt: str | None = None) -> str:
    """The input format: ``fmt`` if given, else from the file extension; stdin is JSON lines."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise InputError(f"unknown input format {fmt!r}; use one of: {', '.join(FORMATS)}")
        return fmt
    if path == "-":
        return "jsonl"
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for f, exts in FORMATS.items():
        if name.endswith(exts):
            return f
    known = ", ".join(e for exts in FORMATS.values() for e in exts)
    raise InputError(
        f"cannot tell the format of {path!r} from its extension (known: {known}); "
        f"pass --format {'|'.join(FORMATS)}"
    )


def _columns_text(columns: Iterable[str]) -> str:
    cols = list(columns)
    if not cols:
        return "none"
    shown = ", ".join(repr(c) for c in cols[:_MAX_EXAMPLE_COLUMNS])
    return shown + (f" ... ({len(cols)} in all)" if len(cols) > _MAX_EXAMPLE_COLUMNS else "")


class RecordReader:
    """Iterates the :class:`InputRecord` of one input; use :func:`open_records` to build it.

    Opening checks the format and that the named fields exist (raising :class:`InputError`
    at once), so nothing is published from an input that cannot work. Iterating may raise
    :class:`InputError` for a malformed row (invalid JSON, wrong number of CSV fields); the
    message names the file and line. Iterate once. Use as a context manager (or call
    :meth:`close`) to close the file.
    """

    def __init__(
        self,
        path: str,
        *,
        key_field: str | None,
        fmt: str | None = None,
        msg_id_field: str | None = None,
        order_by: Sequence[str] = (),
        stdin: IO[bytes] | None = None,
        python_terms: bool = False,
    ) -> None:
        #: how errors name the fields: CLI flags, or (``python_terms``) parameter names
        self.flags = dict(PYTHON_NAMES if python_terms else CLI_NAMES)
        self.path = path
        self.name = "stdin" if path == "-" else path
        self.format = detect_format(path, fmt)
        self.key_field = key_field or None
        self.msg_id_field = msg_id_field or None
        self.order_by = tuple(order_by)
        for what, value in (
            (self.flags["key_field"], key_field),
            (self.flags["msg_id_field"], msg_id_field),
        ):
            if value is not None and not value:
                raise InputError(f"{what} is empty; give the name of a column of {self.name}")
        if any(not c for c in self.order_by):
            raise InputError(
                f"{self.flags['order_by']} has an empty column name; give COL[,COL...]"
            )
        #: rows taken from the input so far (refused ones included)
        self.rows_read = 0
        self.columns: list[str] = []
        self._stdin = stdin
        self._closers: list[Callable[[], object]] = []
        self._used = False
        self._keep: Any = None
        try:
            self._rows = self._open()
        except BaseException:
            self.close()
            raise

    # -- opening -----------------------------------------------------------------------
    def _binary(self) -> IO[bytes]:
        if self.path == "-":
            if self._stdin is not None:
                return self._stdin
            # Our own reader over a duplicate of fd 0, never closed explicitly: a thread may
            # be blocked reading it when the process ends (interrupted publish of a pipe), and
            # closing sys.stdin's buffer under such a thread aborts the interpreter.
            try:
                fd = os.dup(sys.stdin.fileno())
            except (AttributeError, OSError, ValueError):
                return sys.stdin.buffer
            return open(fd, "rb")  # noqa: SIM115 - released with the reader object
        try:
            raw: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise InputError(
                f"cannot open input {self.path!r}: {exc.strerror or exc}; check the path"
            ) from None
        self._closers.append(raw.close)
        if self.path.lower().endswith(".gz"):
            gz = cast(IO[bytes], gzip.GzipFile(fileobj=raw))
            self._closers.append(gz.close)
            return gz
        return raw

    def _text(self) -> IO[str]:
        text = io.TextIOWrapper(self._binary(), encoding="utf-8-sig", newline="")
        if self.path != "-":
            self._closers.insert(0, text.close)
        elif self._stdin is not None:
            self._closers.insert(0, text.detach)  # leave the caller's stream open
        self._keep = text  # stdin: released (and its fd closed) with this reader
        return text

    def _open(self) -> Iterator[tuple[str, dict[str, Any]]]:
        if self.format == "jsonl":
            return self._open_jsonl()
        if self.format == "csv":
            return self._open_csv()
        return self._open_parquet()

    def _check_columns(self, columns: Sequence[str], *, complete: bool, scope: str) -> None:
        """Raise InputError for a named field that is not among ``columns``."""
        wanted = [
            (self.flags["key_field"], self.key_field),
            (self.flags["msg_id_field"], self.msg_id_field),
        ]
        wanted += [(self.flags["order_by"], c) for c in self.order_by]
        have = set(columns)
        for flag, name in wanted:
            if name is None or name in have:
                continue
            close = [c for c in columns if c.lower() == name.lower()]
            close = close or difflib.get_close_matches(name, list(columns), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            what = "column" if complete else "field"
            raise InputError(
                f"{flag} {name!r} is not a {what} of {self.name}.{hint} {scope}: "
                f"{_columns_text(columns)}. Fix {flag}."
            )

    # JSON lines --------------------------------------------------------------------------
    def _jsonl_rows(self, text: IO[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        lineno = 0
        while True:
            try:
                line = text.readline()
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{self.name} after line {lineno} is not UTF-8 text ({exc}); JSON lines "
                    "must be UTF-8"
                ) from None
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                hint = ""
                if lineno == 1 and self.path != "-" and "," in line and "{" not in line:
                    hint = " (it looks like CSV: pass --format csv)"
                raise InputError(
                    f"{self.name} line {lineno} is not valid JSON ({exc}){hint}; every line must "
                    "be one JSON object. Fix or remove the line."
                ) from None
            if not isinstance(obj, dict):
                hint = ""
                if isinstance(obj, list):
                    hint = (
                        "; for a file holding one JSON array, convert it to JSON lines with "
                        "`jq -c '.[]' FILE > FILE.jsonl`"
                    )
                raise InputError(
                    f"{self.name} line {lineno} holds a JSON {type(obj).__name__}, not an "
                    f"object; every line must be one JSON object{hint}"
                )
            yield f"line {lineno}", obj

    def _open_jsonl(self) -> Iterator[tuple[str, dict[str, Any]]]:
        rows = self._jsonl_rows(self._text())
        seen: dict[str, None] = {}
        need = [f for f in (self.key_field, self.msg_id_field) if f is not None]
        if self.order_by:
            loaded = list(rows)
            for _, row in loaded:
                seen.update(dict.fromkeys(row))
            self.columns = list(seen)
            if loaded:
                self._check_columns(self.columns, complete=False, scope="Fields in the file")
            return iter(sorted_rows(loaded, self.order_by, set()))
        head: list[tuple[str, dict[str, Any]]] = []
        missing = set(need)
        for item in rows:
            head.append(item)
            seen.update(dict.fromkeys(item[1]))
            missing.difference_update(item[1].keys())
            if not missing or len(head) >= PROBE_ROWS:
                break
        self.columns = list(seen)
        if missing and head:
            scope = (
                "Fields in the file"
                if len(head) < PROBE_ROWS
                else f"Fields of its first {PROBE_ROWS} records"
            )
            self._check_columns(self.columns, complete=False, scope=scope)
        return _chain(head, rows)

    # CSV -------------------------------------------------------------------------------
    def _open_csv(self) -> Iterator[tuple[str, dict[str, Any]]]:
        text = self._text()
        reader = csv.reader(text)
        try:
            header = next(reader, None)
        except (csv.Error, UnicodeDecodeError) as exc:
            raise InputError(f"{self.name} is not a readable CSV file: {exc}") from None
        if header is None:
            self.columns = []
            return iter(())
        self.columns = header
        dupes = sorted({c for c in header if header.count(c) > 1})
        if dupes:
            raise InputError(
                f"{self.name}: the CSV header repeats column(s) {', '.join(map(repr, dupes))}; "
                "give every column a unique name"
            )
        self._check_columns(header, complete=True, scope="Its header has")
        rows = self._csv_rows(reader, header)
        if self.order_by:
            loaded = list(rows)
            return iter(
                sorted_rows(
                    loaded, self.order_by, numeric_columns([r for _, r in loaded], self.order_by)
                )
            )
        return rows

    def _csv_rows(self, reader: Any, header: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        width = len(header)
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except (csv.Error, UnicodeDecodeError) as exc:
                raise InputError(
                    f"{self.name} line {reader.line_num}: malformed CSV ({exc}); fix the line"
                ) from None
            if not fields:
                continue  # blank line
            if len(fields) != width:
                raise InputError(
                    f"{self.name} line {reader.line_num} has {len(fields)} fields but the header "
                    f"has {width}; fix the line (quote values that contain commas)"
                )
            yield f"line {reader.line_num}", dict(zip(header, fields, strict=True))

    # Parquet ---------------------------------------------------------------------------
    def _open_parquet(self) -> Iterator[tuple[str, dict[str, Any]]]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError(
                "reading Parquet needs pyarrow, which is not installed; "
                "`pip install 'airflow-nats-ordered[spark]'` (or `pip install pyarrow`), "
                "or convert the file to JSON lines or CSV"
            ) from None
        source: Any
        if self.path == "-":
            source = pq.ParquetFile(io.BytesIO(self._binary().read()))
        else:
            try:
                source = pq.ParquetFile(self._binary())
            except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
                raise InputError(f"{self.name} is not a readable Parquet file: {exc}") from None
        self._closers.insert(0, source.close)
        self.columns = list(source.schema_arrow.names)
        self._check_columns(self.columns, complete=True, scope="Its schema has")
        self._check_key_types(source.schema_arrow)
        rows = self._parquet_rows(source)
        if self.order_by:
            return iter(sorted_rows(list(rows), self.order_by, set()))
        return rows

    def _check_key_types(self, schema: Any) -> None:
        """Refuse, before anything is published, a key or msg-id column whose type has no
        canonical key text (see :func:`~..core.stream.keys.key_text`)."""
        import pyarrow.types as pat

        for what, name in (("key_field", self.key_field), ("msg_id_field", self.msg_id_field)):
            if name is None:
                continue
            typ = schema.field(name).type
            if pat.is_dictionary(typ):
                typ = typ.value_type
            if not (
                pat.is_string(typ)
                or pat.is_large_string(typ)
                or pat.is_binary(typ)
                or pat.is_large_binary(typ)
                or pat.is_integer(typ)
                or pat.is_null(typ)
                or getattr(pat, "is_string_view", lambda _: False)(typ)
                or getattr(pat, "is_binary_view", lambda _: False)(typ)
            ):
                raise InputError(
                    f"{self.flags[what]} {name!r} is a Parquet {typ} column of {self.name}; "
                    "key text must be the same in every language, so only string, integer "
                    "and UTF-8 binary columns are keys: write the column as a string"
                )

    def _parquet_rows(self, source: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        n = 0
        for batch in source.iter_batches(batch_size=_PARQUET_BATCH):
            for row in batch.to_pylist():
                n += 1
                yield f"row {n}", row

    # -- iterating ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[InputRecord]:
        if self._used:
            raise RuntimeError("a RecordReader can be iterated only once")
        self._used = True
        return self._records()

    def _records(self) -> Iterator[InputRecord]:
        key_field, id_field = self.key_field, self.msg_id_field
        parquet = self.format == "parquet"
        for where, row in self._guarded(self._rows):
            self.rows_read += 1
            key, msg_id = key_and_msg_id(
                row, key_field, id_field, f"{self.name} {where}", self.flags
            )
            if parquet:
                row = json_safe(row)
            try:
                payload = dumps_payload(row)
            except (TypeError, ValueError) as exc:
                raise InputError(f"{self.name} {where} cannot be written as JSON: {exc}") from None
            yield InputRecord(key, payload, msg_id, where)

    def _guarded(
        self, rows: Iterator[tuple[str, dict[str, Any]]]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``rows``, with unexpected read failures (I/O, gzip, Parquet) as InputError."""
        while True:
            try:
                item = next(rows)
            except StopIteration:
                return
            except InputError:
                raise
            except Exception as exc:
                raise InputError(
                    f"reading {self.name} failed after {self.rows_read} records: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            yield item

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for close in closers:
            with contextlib.suppress(Exception):
                close()

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def records_from_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    key_field: str | None,
    msg_id_field: str | None = None,
    order_by: Sequence[str] | str | None = None,
) -> Iterator[InputRecord]:
    """:class:`InputRecord` s from in-memory rows (an XCom value, a callable's result), made
    exactly as from a file: the row as compact JSON (values made JSON-safe), its key and
    msg-id as text, ``where`` = ``"record N"`` (1-based). ``order_by`` sorts stably (and
    so materializes the rows)."""
    if isinstance(rows, Mapping | str | bytes):
        raise InputError(
            f"records must be a list of objects (one per record), got {type(rows).__name__}"
        )
    if isinstance(order_by, str):
        order_by = [c.strip() for c in order_by.split(",")]
    numbered: Iterable[tuple[str, Any]] = ((f"record {i}", r) for i, r in enumerate(rows, 1))
    if order_by:
        checked = []
        for where, row in numbered:
            if not isinstance(row, Mapping):
                raise InputError(f"{where} is a {type(row).__name__}, not an object")
            checked.append((where, dict(row)))
        numbered = sorted_rows(checked, order_by, set())
    for where, row in numbered:
        if not isinstance(row, Mapping):
            raise InputError(f"{where} is a {type(row).__name__}, not an object")
        key, msg_id = key_and_msg_id(row, key_field, msg_id_field, where, PYTHON_NAMES)
        yield InputRecord(key, dumps_payload(json_safe(dict(row))), msg_id, where)


def content_digest(path: str | Path, *, size: int = 10) -> str:
    """A hex digest (BLAKE2b, ``size`` bytes) of the file's bytes as stored (compressed or
    not): the same content gives the same digest wherever the file lives or whatever its
    name, so a rerun of the same input can be recognised. Raises :class:`InputError` if the
    file cannot be read."""
    h = hashlib.blake2b(digest_size=size)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return h.hexdigest()


def _chain(
    head: list[tuple[str, dict[str, Any]]], rest: Iterator[tuple[str, dict[str, Any]]]
) -> Iterator[tuple[str, dict[str, Any]]]:
    yield from head
    head.clear()
    yield from rest


def open_records(
    path: str | Path,
    *,
    key_field: str | None,
    fmt: str | None = None,
    msg_id_field: str | None = None,
    order_by: Sequence[str] | str | None = None,
    stdin: IO[bytes] | None = None,
    python_terms: bool = False,
) -> RecordReader:
    """Open ``path`` (``"-"`` for stdin) and check it can give the records asked for.

    ``fmt`` is ``"jsonl"``, ``"csv"`` or ``"parquet"`` (default: from the extension; stdin
    is JSON lines). ``order_by`` is a list of column names or a ``"COL,COL"`` string.
    Raises :class:`InputError` naming the problem (unreadable file, unknown format, a field
    that is not in the input and the columns that are, a Parquet key column of a type that
    has no canonical key text, pyarrow missing for Parquet). Errors name the fields as CLI
    flags (``--key-field``), or with ``python_terms`` as parameters (``key_field``).
    """
    if isinstance(order_by, str):
        order_by = [c.strip() for c in order_by.split(",")]
    return RecordReader(
        str(path),
        key_field=key_field,
        fmt=fmt,
        msg_id_field=msg_id_field,
        order_by=order_by or (),
        stdin=stdin,
        python_terms=python_terms,
    )
