"""The ``nats`` connection form offers every extra the hook reads and the docs list (issue 16
item 7), so they cannot drift apart again: before, ``name``, ``max_reconnect_attempts`` and
``reconnect_time_wait`` were documented and read, but a UI user had no field for them.
Also: the operators render their JSON-ish template fields as JSON, and ``get_conn()``
returns what its docstring says."""

from __future__ import annotations

import json
import re

import pytest
from locations import ROOT

from airflow_nats_ordered.hooks import nats as hook_module
from airflow_nats_ordered.hooks.nats import NatsHook, options_from_connection

DOCS = ROOT / "docs" / "airflow.md"
PREFIX = "extra__nats__"


def _form() -> dict:
    """The form's widgets as Airflow's UI gets them (through the providers manager)."""
    from airflow.providers_manager import ProvidersManager

    widgets = ProvidersManager().connection_form_widgets
    return {k.removeprefix(PREFIX): w for k, w in widgets.items() if k.startswith(PREFIX)}


def _hook_extras() -> set[str]:
    """Every extra ``options_from_connection`` accepts (passed through, content, renamed)."""
    groups = ("OPTION_FIELDS", "CONTENT_FIELDS", "RENAMED_FIELDS")
    return {name for group in groups for name in getattr(hook_module, group, ())}


def _documented_extras() -> set[str]:
    section = DOCS.read_text().split("## The `nats` connection", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| extra ")]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row)}


def test_form_offers_exactly_the_extras_the_hook_reads_and_the_docs_list() -> None:
    form = set(_form())
    assert form - _hook_extras() == set(), "form fields the hook refuses"
    assert _hook_extras() - form == set(), "extras the hook reads but the form lacks"
    assert _documented_extras() == form, "docs/airflow.md's connection table vs the form"


def test_every_form_field_has_help_text_the_ui_shows() -> None:
    # what GET /ui/connections/hook_meta gives the UI's form: each extra's description is
    # the help text under its widget (issue 30: none had one)
    from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService

    (meta,) = [m for m in HookMetaService.hook_meta_data() if m.connection_type == "nats"]
    fields = meta.extra_fields or {}
    assert set(fields) == set(_form())
    missing = [n for n, f in fields.items() if len(f.get("description") or "") < 20]
    assert missing == [], "form fields without a description"
    for name, field in fields.items():
        hidden = field["schema"].get("format") == "password"
        assert ("Hidden" in field["description"]) == hidden, name
        if field["value"] is not None:  # a field with a default says which
            shown = "checked" if field["value"] is True else str(field["value"])
            assert f"Default: {shown}" in field["description"] or (
                f"Default {shown}" in field["description"]
            ), name


def test_a_connection_saved_from_the_form_gives_the_documented_defaults() -> None:
    # what the UI stores when a user fills in Host and leaves every extra at its default
    extra = {name: widget.field["value"] for name, widget in _form().items()}
    options = options_from_connection(
        "nats_form", host="nats-1:4222", port=None, login=None, password=None, extra=extra
    )
    assert (options.name, options.max_reconnect_attempts, options.reconnect_time_wait) == (
        "nats-ordered",
        120,
        0.5,
    )
    assert options.connect_timeout == 5 and options.tls_verify is True
    # and values typed in the new fields reach the client's settings
    extra |= {"name": "etl-7", "max_reconnect_attempts": -1, "reconnect_time_wait": 2}
    options = options_from_connection(
        "nats_form", host="nats-1", port=None, login=None, password=None, extra=extra
    )
    kwargs = options.nats_connect_kwargs()
    assert (kwargs["name"], kwargs["max_reconnect_attempts"], kwargs["reconnect_time_wait"]) == (
        "etl-7",
        -1,
        2.0,
    )


def test_a_bad_reconnect_value_names_the_connection_and_the_extra() -> None:
    with pytest.raises(Exception, match=r"nats_form.*extra 'max_reconnect_attempts'"):
        options_from_connection(
            "nats_form",
            host="nats-1",
            port=None,
            login=None,
            password=None,
            extra={"max_reconnect_attempts": -5},
        )


def _renderable() -> list[tuple[type, dict[str, str]]]:
    from airflow_nats_ordered.operators.group import NatsRebalanceOperator, NatsResetGroupOperator
    from airflow_nats_ordered.operators.publish import NatsPublishOperator
    from airflow_nats_ordered.operators.spark import NatsSparkPublishOperator
    from airflow_nats_ordered.sensors.drain import NatsGroupDrainSensor

    return [
        (NatsPublishOperator, {"records": "json", "op_kwargs": "json"}),
        (NatsRebalanceOperator, {"cordon": "json", "weights": "json"}),
        (NatsResetGroupOperator, {"to": "json", "partitions": "json"}),
        (NatsGroupDrainSensor, {"high_water_marks": "json"}),
        (NatsSparkPublishOperator, {"conf": "json", "application_args": "json"}),
    ]


@pytest.mark.parametrize(
    "cls,expected", _renderable(), ids=lambda v: getattr(v, "__name__", "renderers")
)
def test_json_template_fields_render_as_json(cls: type, expected: dict[str, str]) -> None:
    renderers = cls.template_fields_renderers  # type: ignore[attr-defined]
    assert {k: renderers.get(k) for k in expected} == expected
    assert set(renderers) <= set(cls.template_fields), "a renderer for a field never rendered"  # type: ignore[attr-defined]


def test_get_conn_returns_the_validated_connection_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_nats_ordered.core.connection.options import ConnectionOptions

    extra = {"servers": "nats://h:4222", "token": "t0k-secret", "name": "x"}
    monkeypatch.setenv(
        "AIRFLOW_CONN_NATS_GET_CONN", json.dumps({"conn_type": "nats", "extra": extra})
    )
    options = NatsHook("nats_get_conn").get_conn()
    assert isinstance(options, ConnectionOptions)
    assert options.servers == ("nats://h:4222",) and options.name == "x"
    assert options.auth_method == "token" and "t0k-secret" not in repr(options)
    assert NatsHook.get_conn.__doc__ and "ConnectionOptions" in NatsHook.get_conn.__doc__
