"""Every ``nats-ordered`` command the README and docs/ show names a command and flags that exist.

A reader copies these lines; a renamed flag or a command that was never built must fail here,
not on the reader's terminal. Lines in ```bash blocks (with their ``\\`` continuations) and
inline `` `nats-ordered ...` `` code are read; each is checked against the real parser
(:func:`airflow_nats_ordered.cli.build_parser`): the command (and a group's subcommand)
exists, and every ``--flag`` it uses is one of that command's options. Complete lines from
code blocks are also parsed whole (values, required flags), after shell variables are given
sample values. What the commands then do against a server is the CLI tests' business.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest
from locations import ROOT

from airflow_nats_ordered.cli import build_parser

DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "architecture").glob("*.md")),
]

_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"`(nats-ordered [^`]+)`")
_VARS = re.compile(r"\$\{?([A-Z_][A-Z0-9_]*)\}?")


def _block_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each ``nats-ordered`` line in a shell code block."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    in_block, lang, i = False, "", 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line.strip())
        if fence:
            in_block, lang = (not in_block), fence.group(1)
            i += 1
            continue
        if (
            in_block
            and lang in ("bash", "sh", "shell", "console", "")
            and re.match(r"^\s*(\$ )?nats-ordered\s", line)
        ):
            start, parts = i + 1, []
            while True:
                body = _strip_comment(lines[i]).rstrip()
                cont = body.endswith("\\")
                parts.append(body[:-1] if cont else body)
                if not cont:
                    break
                i += 1
            out.append((start, " ".join(parts).strip().removeprefix("$ ")))
        i += 1
    return out


def _strip_comment(line: str) -> str:
    """The line without a shell comment (a ``#`` after a blank, outside quotes)."""
    quote = None
    for j, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (j == 0 or line[j - 1].isspace()):
            return line[:j]
    return line


def _commands() -> list[tuple[str, str, bool]]:
    """(where, command, complete) for every command shown; complete = from a code block."""
    found: list[tuple[str, str, bool]] = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT).as_posix()
        for line, cmd in _block_commands(text):
            found.append((f"{name}:{line}", cmd, True))
        for n, line in enumerate(text.splitlines(), 1):
            for m in _INLINE.finditer(line):
                found.append((f"{name}:{n}", m.group(1), False))
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _words(cmd: str) -> list[str]:
    sample = _VARS.sub(lambda m: f"sample-{m.group(1).lower()}", cmd)
    return shlex.split(sample)


COMMANDS = _commands()


def test_the_docs_show_commands_at_all():
    # a guard on the reader above: if it finds none, the checks below check nothing
    assert sum(1 for _, _, complete in COMMANDS if complete) >= 10
    assert sum(1 for _, _, complete in COMMANDS if not complete) >= 10


@pytest.mark.parametrize(("where", "cmd", "complete"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_each_documented_command_and_flag_exists(where: str, cmd: str, complete: bool):
    words = _words(cmd)[1:]  # without "nats-ordered"
    parser = build_parser()
    commands = _subparsers(parser)
    if words and (words[0].startswith("-") or words[0].isupper()):  # --help; COMMAND --help
        known = {opt for action in parser._actions for opt in action.option_strings}
        flags = [w for w in words if w.startswith("-")]
        assert all(f in known or f == "--help" for f in flags), f"{where}: `{cmd}`"
        return
    assert words and words[0] in commands, (
        f"{where}: `{cmd}` names no command; there are {sorted(commands)}"
    )
    sub = commands[words[0]]
    rest = words[1:]
    nested = _subparsers(sub)
    if nested and rest and not rest[0].startswith("-"):
        assert rest[0] in nested, f"{where}: `{cmd}`: no subcommand {rest[0]!r} in {sorted(nested)}"
        sub, rest = nested[rest[0]], rest[1:]
    known = {opt for action in sub._actions for opt in action.option_strings}
    unknown = [
        w.split("=", 1)[0] for w in rest if w.startswith("-") and w.split("=", 1)[0] not in known
    ]
    assert not unknown, f"{where}: `{cmd}` uses flags that do not exist: {unknown}"
    if complete:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"{where}: `{cmd}` does not parse (exit {exc.code}): {err.getvalue()}")
