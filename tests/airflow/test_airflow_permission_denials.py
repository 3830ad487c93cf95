"""A refused permission, as an Airflow user sees it: the refused subject, the connection id
and the field of the connection that gave the user; a task fails at once (no retry can
grant a permission)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from airflow.sdk.exceptions import AirflowFailException
from permission_accounts import PASSWORD, S, provisioned_server

from airflow_nats_ordered.core.errors import PermissionDenied
from airflow_nats_ordered.embedded.servers import NatsServer
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.operators.streams import NatsProvisionStreamOperator


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with provisioned_server(tmp_path_factory.mktemp("af-denials")) as srv:
        yield srv


@pytest.fixture
def worker_conn(server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """An Airflow connection whose Login is the worker of group G (nothing more)."""
    fields = {
        "conn_type": "nats",
        "host": "127.0.0.1",
        "port": server.port,
        "login": "worker_a",
        "password": PASSWORD,
    }
    monkeypatch.setenv("AIRFLOW_CONN_NATS_WORKER_ONLY", json.dumps(fields))
    return "nats_worker_only"


def _check(message: str, subject: str) -> None:
    assert message.startswith(f"permission denied: publish to {subject}"), message
    assert "for the user of Airflow connection 'nats_worker_only' (its Login 'worker_a')" in message
    assert "nats-ordered permissions --role" in message
    assert PASSWORD not in message


def test_hook_names_the_connection_and_its_login(worker_conn: str) -> None:
    async def delete(nc) -> None:  # noqa: ANN001 - a nats-py client
        await nc.jetstream().delete_stream(S)

    with pytest.raises(PermissionDenied) as info:
        NatsHook(worker_conn).run(delete)
    _check(str(info.value), f"$JS.API.STREAM.DELETE.{S}")


def test_hook_in_a_trigger_names_the_connection(worker_conn: str) -> None:
    async def main() -> None:
        async with NatsHook(worker_conn).aconnect() as nc:
            await nc.jetstream().purge_stream(S)

    with pytest.raises(PermissionDenied) as info:
        asyncio.run(main())
    _check(str(info.value), f"$JS.API.STREAM.PURGE.{S}")


def test_operator_fails_at_once_naming_the_connection(worker_conn: str) -> None:
    op = NatsProvisionStreamOperator(
        task_id="provision",
        nats_conn_id=worker_conn,
        stream=S,
        partitions=4,
        max_age=3600,
    )
    with pytest.raises(AirflowFailException) as info:  # not retried: no retry grants it
        op.execute({})
    _check(str(info.value), f"$JS.API.STREAM.UPDATE.{S}")


def test_pipelines_view_answers_403_naming_the_connection(worker_conn: str) -> None:
    """The pipelines view (the api-server's plugin) reads every stream and group of the
    account: as a user without those permissions it answers 403 naming the refused
    permission, the Airflow connection and its Login (not a 409 in the core's terms)."""
    from fastapi import HTTPException

    from airflow_nats_ordered.core.admin.overview import stream_list
    from airflow_nats_ordered.plugins.app import _with_nats

    with pytest.raises(HTTPException) as info:
        asyncio.run(_with_nats(worker_conn, stream_list))
    assert info.value.status_code == 403, info.value
    detail = str(info.value.detail)
    assert detail.startswith("permission denied: publish to $JS.API.STREAM."), detail
    assert "for the user of Airflow connection 'nats_worker_only' (its Login 'worker_a')" in detail
    assert "--role operator --stream STREAM` prints (no --group)" in detail
    assert PASSWORD not in detail
