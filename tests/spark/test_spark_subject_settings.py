"""The sink's ``inboxPrefix``, ``jsDomain`` and ``jsApiPrefix`` options (issue 31 item 4):
they map to the connection's settings over the driver's ``NATS_*`` variables, are pinned for
the data source like every other non-secret setting, and a bad value is an error naming
the Spark option (a bad variable names the variable)."""

from __future__ import annotations

import pytest

from airflow_nats_ordered.core.errors import ConfigError

pytest.importorskip("pyspark")

from airflow_nats_ordered.spark import SinkOptions  # noqa: E402

BASE = {"stream": "FLIGHTS", "keyColumn": "tailnum", "producerId": "run-1"}


def test_options_map_to_the_connection_over_the_environment() -> None:
    env = {"NATS_INBOX_PREFIX": "_ENV", "NATS_JS_API_PREFIX": "JS.hub.API"}
    sink = SinkOptions.from_spark({**BASE, "jsDomain": "leaf"}, env=env)
    conn = sink.connection_options()
    # jsDomain replaces the variable's API prefix; the inbox prefix comes from the variable
    assert (conn.inbox_prefix, conn.js_domain, conn.api_prefix) == ("_ENV", "leaf", "$JS.leaf.API")
    pinned = sink.pinned_connection()
    assert (pinned["inboxPrefix"], pinned["jsDomain"]) == ("_ENV", "leaf")
    assert "jsApiPrefix" not in pinned
    # what write_ordered hands the data source gives the same connection back
    again = SinkOptions.from_spark({**BASE, **pinned}, env={})
    assert again.connection_options() == conn
    lower = SinkOptions.from_spark({**BASE, "inboxprefix": "_LOW", "JSAPIPREFIX": "JS.x"}, env={})
    assert (lower.connection_options().inbox_prefix, lower.connection_options().api_prefix) == (
        "_LOW",
        "JS.x",
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"inboxPrefix": "_MY INBOX"}, "option inboxPrefix: '_MY INBOX' is not a subject prefix"),
        ({"jsDomain": "leaf.1"}, "option jsDomain: 'leaf.1' is not a JetStream domain name"),
        ({"jsApiPrefix": "JS.>"}, "option jsApiPrefix: 'JS.>' is not a subject prefix"),
        (
            {"jsDomain": "leaf", "jsApiPrefix": "JS.x.API"},
            "jsDomain and jsApiPrefix are both set; give only one of them",
        ),
    ],
)
def test_a_bad_option_is_named(options: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        SinkOptions.from_spark({**BASE, **options}, env={})
    assert expected in str(err.value)


def test_a_bad_variable_of_the_driver_is_named() -> None:
    with pytest.raises(ConfigError, match="from environment variable NATS_JS_DOMAIN"):
        SinkOptions.from_spark(BASE, env={"NATS_JS_DOMAIN": "a b"})
