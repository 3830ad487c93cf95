"""The how-to pages (docs/howto/) show the code the system tests run (issue 16 item 10).

Each page quotes regions of the example DAGs in tests/system/nats_ordered/ (between
``# [START name]`` and ``# [END name]``, as Airflow's provider docs do) after a
``<!-- example: <file> <name> -->`` line; the quote must equal the region, so the two cannot
drift. Every code block of a page is such a quote, every marked region is quoted, every
operator, sensor and trigger of the provider has a page naming each of its parameters, and
the links of the new pages (how-tos, connection.md, CHANGELOG.md) lead somewhere.
"""

from __future__ import annotations

import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest
from locations import ROOT
from test_docs_commands import test_each_documented_command_and_flag_exists as check_command

from airflow_nats_ordered import get_provider_info

HOWTO = ROOT / "docs" / "howto"
EXAMPLES = ROOT / "tests" / "system" / "nats_ordered"
PAGES = sorted(p for p in HOWTO.glob("*.md") if p.name != "index.md")

_QUOTE = re.compile(r"^<!-- example: (\S+) (\S+) -->\n```python\n(.*?)^```$", re.M | re.S)
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
_CLASS = re.compile(r"^<!-- class: (\S+) -->$", re.M)
_MARK = re.compile(r"^\s*# \[(START|END) (\w+)\]\s*$")


def region(path: Path, name: str) -> str:
    """The dedented lines between ``# [START name]`` and ``# [END name]`` of ``path``."""
    lines = path.read_text().splitlines()
    starts = [i for i, ln in enumerate(lines) if _MARK.match(ln) and f"[START {name}]" in ln]
    ends = [i for i, ln in enumerate(lines) if _MARK.match(ln) and f"[END {name}]" in ln]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], (
        f"{path.name}: exactly one [START {name}] before one [END {name}] expected"
    )
    return textwrap.dedent("\n".join(lines[starts[0] + 1 : ends[0]])).strip("\n") + "\n"


def markers() -> set[tuple[str, str]]:
    out = set()
    for path in EXAMPLES.glob("example_*.py"):
        for line in path.read_text().splitlines():
            m = _MARK.match(line)
            if m and m.group(1) == "START":
                out.add((path.relative_to(ROOT).as_posix(), m.group(2)))
    return out


QUOTES = [
    (page.name, m.group(1), m.group(2), m.group(3))
    for page in PAGES
    for m in _QUOTE.finditer(page.read_text())
]


def test_there_is_a_page_per_example_and_quotes_at_all() -> None:
    assert len(PAGES) >= 9 and len(QUOTES) >= 10


@pytest.mark.parametrize(("page", "path", "name", "code"), QUOTES, ids=[q[2] for q in QUOTES])
def test_each_quote_is_the_marked_region_of_its_example(page, path, name, code) -> None:
    assert code == region(ROOT / path, name), (
        f"docs/howto/{page} quotes {path} [{name}] differently: copy the region again"
    )


def test_every_code_block_of_a_howto_page_is_a_checked_quote() -> None:
    for page in PAGES:
        text = page.read_text()
        blocks = [m.group(2) for m in _BLOCK.finditer(text) if m.group(1) != "bash"]
        quoted = [m.group(3) for m in _QUOTE.finditer(text)]
        assert blocks == quoted, f"docs/howto/{page.name} has a code block no example holds"


def test_every_marked_region_is_quoted_and_every_example_is_listed() -> None:
    quoted = {(path, name) for _, path, name, _ in QUOTES}
    assert markers() - quoted == set(), "marked regions no how-to page quotes"
    index = (HOWTO / "index.md").read_text()
    for path in EXAMPLES.glob("example_*.py"):
        assert path.name in index, f"docs/howto/index.md does not list {path.name}"


def _provider_classes() -> set[str]:
    """Every operator, sensor and trigger class the provider ships."""
    from airflow.sdk import BaseOperator
    from airflow.triggers.base import BaseTrigger

    info = get_provider_info()
    modules = [
        m
        for kind in ("operators", "sensors", "triggers")
        for entry in info.get(kind, [])
        for m in entry["python-modules"]
    ]
    modules.append("airflow_nats_ordered.operators.spark")  # not in the provider info
    out = set()
    for name in modules:
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and obj.__module__ == name
                and issubclass(obj, BaseOperator | BaseTrigger)
                and not attr.startswith("_")
            ):
                out.add(f"{name}.{attr}")
    return out


def test_every_operator_sensor_and_trigger_has_a_page() -> None:
    documented = {m.group(1) for page in PAGES for m in _CLASS.finditer(page.read_text())}
    assert _provider_classes() - documented == set()


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_each_page_names_every_parameter_of_its_class(page: Path) -> None:
    text = page.read_text()
    (dotted,) = _CLASS.findall(text)
    module, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    params = [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    missing = [p for p in params if f"`{p}`" not in text]
    assert not missing, f"docs/howto/{page.name} does not describe {missing} of {name}"


# --- links and commands of the new pages ------------------------------------------------

LINKED = [*PAGES, HOWTO / "index.md", ROOT / "docs" / "connection.md", ROOT / "CHANGELOG.md"]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a markdown file."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", LINKED, ids=[p.name for p in LINKED])
def test_links_of_the_new_pages_lead_somewhere(page: Path) -> None:
    for target in _LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(path), f"{page.name}: link to {target}: no such heading"


INLINE = [
    (f"{page.name}:{n}", m.group(1))
    for page in LINKED
    for n, line in enumerate(page.read_text().splitlines(), 1)
    for m in re.finditer(r"`(nats-ordered [^`]+)`", line)
]


@pytest.mark.parametrize(("where", "cmd"), INLINE, ids=[w for w, _ in INLINE])
def test_nats_ordered_commands_named_on_the_new_pages_exist(where: str, cmd: str) -> None:
    check_command(where, cmd, complete=False)
