"""The dead-letter triage DAG shows a dead-lettered record's key exactly as it was
published, whichever header form carried it, and names a malformed key instead of failing."""

from __future__ import annotations

import base64
import sys

from locations import ROOT

DAGS = ROOT / "dags"
if str(DAGS) not in sys.path:
    sys.path.insert(0, str(DAGS))

from flights.operations import describe_dead_letter  # noqa: E402


def _payload(headers: dict[str, str]) -> dict:
    return {"subject": "x.dlq.g.0", "stream_seq": 3, "headers": headers, "data": "{}"}


def test_a_dead_letter_shows_its_key_byte_exact_in_either_form():
    encoded = base64.b64encode(" lead\u3000".encode()).decode()
    assert describe_dead_letter(_payload({"Nats-Ordered-Key-B64": encoded}))["key"] == (
        " lead\u3000"
    )
    assert describe_dead_letter(_payload({"Nats-Ordered-Key": "N123"}))["key"] == "N123"
    assert describe_dead_letter(_payload({}))["key"] is None


def test_a_dead_letter_with_a_malformed_key_names_the_problem():
    d = describe_dead_letter(_payload({"Nats-Ordered-Key-B64": "%%%"}))
    assert d["key"].startswith("(malformed key: Nats-Ordered-Key-B64 '%%%' is not valid base64")
