"""docs/airflow.md states two Airflow behaviours users trip over (issue 16 item 8), and this
test keeps the statements true against the installed Airflow: testing a connection needs
``[core] test_connection = Enabled`` (Airflow's default is Disabled), and pausing a DAG stops
its asset watcher only when the DAG is parsed again (watchers are chosen at parse time, for
DAGs neither paused nor stale)."""

from __future__ import annotations

import inspect

from locations import ROOT

DOCS = (ROOT / "docs" / "airflow.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_docs_say_connection_tests_need_test_connection_enabled() -> None:
    from airflow.configuration import conf

    # Airflow's own default (not this machine's airflow.cfg or environment)
    assert conf.get_default_value("core", "test_connection") == "Disabled"
    docs = _flat(DOCS)
    assert "[core] test_connection = Enabled" in docs
    assert "AIRFLOW__CORE__TEST_CONNECTION=Enabled" in docs
    assert "Testing connections is disabled in Airflow configuration" in docs

    from airflow.cli.commands import connection_command

    source = inspect.getsource(connection_command.connections_test)
    assert '"test_connection"' in source and "Testing connections is disabled" in source


def test_docs_say_pausing_stops_the_watcher_only_at_the_next_parse() -> None:
    from airflow.dag_processing import collection

    # watchers are kept only for assets scheduled by DAGs that are not paused, at parse time
    source = inspect.getsource(collection._find_active_assets)
    assert "is_paused" in source
    docs = _flat(DOCS)
    assert "Pausing a DAG stops its watcher only at the DAG file's next parse" in docs
    assert "min_file_process_interval" in docs and "airflow dags reserialize" in docs
