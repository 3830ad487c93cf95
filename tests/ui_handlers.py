"""A worker handler for the UI view's tests: a record ``{"poison": true}`` fails every time
(the worker's poison policy dead-letters it), every other record is handled."""

from __future__ import annotations

import json


def fail_poison(msg) -> None:
    if json.loads(msg.data).get("poison"):
        raise ValueError(f"poison record {msg.key!r} (a test's)")
