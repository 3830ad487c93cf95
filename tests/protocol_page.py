"""Reading docs/protocol.md the way a foreign implementer would: its golden vectors and its
KV record examples, so tests check the page against the code (not a copy of the page)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"

_BLOCK = r"<!-- {marker}[^>]*-->\s*```json\n(.*?)\n```"


def page_text() -> str:
    return PAGE.read_text(encoding="utf-8")


def golden_vectors() -> dict[str, Any]:
    """The JSON block that follows ``<!-- golden-vectors ... -->`` in the page."""
    m = re.search(_BLOCK.format(marker="golden-vectors"), page_text(), re.S)
    assert m, f"{PAGE} has no '<!-- golden-vectors -->' JSON block"
    return json.loads(m.group(1))


def kv_examples() -> dict[str, Any]:
    """``<!-- kv-example: NAME -->`` JSON blocks of the page, by NAME."""
    found = re.findall(r"<!-- kv-example: (.*?) -->\s*```json\n(.*?)\n```", page_text(), re.S)
    return {name: json.loads(body) for name, body in found}
