"""The view's FastAPI app (mounted by :mod:`.view` under ``/nats-ordered``): the page and the
JSON it reads, per Airflow connection of type ``nats``.

Security is Airflow's own: every route needs a signed-in user (Airflow's JWT, as the
``Authorization: Bearer`` header or the ``_token`` cookie the UI's login sets, so the page
shown inside Airflow reads the JSON with the user's own session; none: 401). Reading needs
the auth manager's permission to view the plugin's page, :data:`RESOURCE` (its
``is_authorized_custom_view("GET", "NATS pipelines")``: Airflow's viewers with the simple
auth manager; a FAB role with that resource), not to read connections: the page shows what
the pipelines hold, never a connection's fields. A DAG run's drain sensors (``/api/dagrun``, read
from the metadata DB by :mod:`.dagrun`) also need Airflow's permission to read that DAG's
task instances. The actions (rebalance, reset, dead-letter
replay) need its permission to edit connections (``"PUT"``), a ``confirm`` field equal to
the group's name, and leave a line in Airflow's audit log (the ``log`` table, shown under
Browse > Audit Log; event ``nats_ordered.<action>``) and on this module's logger, naming the
user, the action and its target.

The data is the core's, through :mod:`airflow_nats_ordered.core.admin.overview`: the group
status is exactly what ``nats-ordered status --json`` prints, the group list what ``group
list --json`` prints. One NATS connection per request, made from the Airflow connection by
:meth:`NatsHook.options_of` (the connection's secrets stay in the api-server)."""

from __future__ import annotations

import contextlib
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Annotated, Any, Literal, TypeVar

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import (
    GetUserDep,
    requires_access_connection,
    requires_access_dag,
)
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from airflow_nats_ordered.core.admin.dead_letters import (
    DeadLetterNotFoundError,
    dead_letter_place,
    read_dead_letters,
    replay_dead_letters,
)
from airflow_nats_ordered.core.admin.membership import GroupNotFoundError
from airflow_nats_ordered.core.admin.overview import (
    drain_wait_status,
    group_list,
    group_status,
    producer_list,
    run_list,
    stream_list,
)
from airflow_nats_ordered.core.admin.rebalance import rebalance_group
from airflow_nats_ordered.core.admin.reset import reset_group
from airflow_nats_ordered.core.connection.connect import connect
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.core.errors import (
    ConfigError,
    ConnectError,
    NatsOrderedError,
    PermissionDenied,
    StreamNotFoundError,
    denial_in,
)
from airflow_nats_ordered.hooks.nats import NatsHook, _credentials_field
from airflow_nats_ordered.plugins.dagrun import drain_sensors

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the resource name the auth manager authorizes reads by (``is_authorized_custom_view``)
RESOURCE = "NATS pipelines"
#: at most this many dead letters in one list
DEAD_LETTER_LIMIT = 200


async def _nats(connection_id: str) -> Any:
    """A connected nats-py client for Airflow connection ``connection_id`` (type ``nats``)."""
    from airflow.exceptions import AirflowNotFoundException
    from airflow.models.connection import Connection

    try:  # a metadata DB or secrets backend read: in a worker thread, not on the loop
        conn = await run_in_threadpool(Connection.get_connection_from_secrets, connection_id)
    except AirflowNotFoundException:
        raise HTTPException(404, f"no Airflow connection {connection_id!r}") from None
    if conn.conn_type != NatsHook.conn_type:
        raise HTTPException(
            400, f"connection {connection_id!r} is of type {conn.conn_type!r}, not 'nats'"
        )
    try:
        options = NatsHook.options_of(connection_id, conn)
    except ConfigError as exc:
        raise HTTPException(400, str(exc)) from None
    nc = await connect(options)
    _OPTIONS[nc] = options
    return nc


#: a client of the view -> the options of the Airflow connection it was made from
_OPTIONS: weakref.WeakKeyDictionary[Any, ConnectionOptions] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def _connected(connection_id: str) -> AsyncIterator[Any]:
    """A fresh client for the connection, closed on exit; unreachable servers as 502."""
    try:
        nc = await _nats(connection_id)
    except ConnectError as exc:
        raise HTTPException(502, str(exc)) from None
    try:
        yield nc
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def _refused(denied: PermissionDenied, connection_id: str | None, nc: Any) -> HTTPException:
    """A refused permission as 403, naming the Airflow connection and the field that gave
    its user, and the role the view needs (the operator's of every stream of the account)."""
    options = _OPTIONS.get(nc) if nc is not None else None
    if connection_id is not None and options is not None:
        denied = denied.in_terms(
            f"the user of Airflow connection {connection_id!r} ({_credentials_field(options)})",
            "the pipelines view reads and acts on every stream and group of the account, as "
            "the operator role without a group: grant that user what `nats-ordered "
            "permissions --role operator --stream STREAM` prints (no --group), or set the "
            "connection's credentials to a user that has it (docs/security.md, 'The "
            "pipelines view')",
        )
    return HTTPException(403, str(denied))


def _as_http(exc: Exception, connection_id: str | None = None, nc: Any = None) -> HTTPException:
    """The core's error as an HTTP error in its words (a refused permission: 403 naming
    ``connection_id``'s user); anything else is raised again."""
    if isinstance(exc, HTTPException):
        return exc
    denied = denial_in(exc)
    if denied is not None:
        return _refused(denied, connection_id, nc)
    if isinstance(exc, GroupNotFoundError | StreamNotFoundError | DeadLetterNotFoundError):
        return HTTPException(404, str(exc))
    if isinstance(exc, ConfigError):
        return HTTPException(400, str(exc))
    if isinstance(exc, NatsOrderedError):
        return HTTPException(409, str(exc))
    raise exc


async def _with_nats(connection_id: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    """``await fn(nc)`` on a fresh client; the core's errors as HTTP errors (:func:`_as_http`)."""
    async with _connected(connection_id) as nc:
        try:
            return await fn(nc)
        except Exception as exc:
            raise _as_http(exc, connection_id, nc) from None


class Confirmed(BaseModel):
    """An action's body: ``confirm`` must repeat the group's name."""

    confirm: str = Field(description="the group's name, typed again")


class RebalanceBody(Confirmed):
    cordon: list[str] = Field(default_factory=list, description="members to take all from")


class ResetBody(Confirmed):
    to: Literal["earliest", "latest"] = Field(description="where every partition resumes")


class ReplayBody(Confirmed):
    seqs: list[int] = Field(default_factory=list, description="dead letters (default: all)")
    purge: bool = Field(False, description="delete each from the dead-letter stream once sent")


def _check_confirm(body: Confirmed, group: str) -> None:
    if body.confirm != group:
        raise HTTPException(
            400, f"confirm must be the group's name ({group!r}) to act on it; got {body.confirm!r}"
        )


async def _audit(user: Any, action: str, target: dict[str, Any], outcome: dict[str, Any]) -> None:
    """One line in Airflow's audit log (event ``nats_ordered.<action>``) and on the logger."""
    name = user.get_name() if user is not None else "anonymous"
    extra = {**target, **outcome}
    log.warning(
        "NATS pipelines view: user %s ran %s on %s: %s",
        name,
        action,
        json.dumps(target, sort_keys=True),
        json.dumps(outcome, sort_keys=True, default=str),
    )
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    def write() -> None:
        with create_session() as session:
            session.add(
                Log(
                    event=f"nats_ordered.{action}",
                    owner=name,
                    owner_display_name=name,
                    extra=json.dumps(extra, sort_keys=True, default=str),
                )
            )

    try:  # a metadata DB write: in a worker thread, not on the loop
        await run_in_threadpool(write)
    except Exception:  # the logger line above stands; the action is done
        log.exception("NATS pipelines view: could not write the audit log row of %s", action)


def _page(name: str) -> str:
    return (resources.files(__package__) / "static" / name).read_text(encoding="utf-8")


def create_app() -> FastAPI:
    """The app the plugin mounts (see the module)."""

    async def may_read(user: GetUserDep) -> None:
        if not get_auth_manager().is_authorized_custom_view(
            method="GET", resource_name=RESOURCE, user=user
        ):
            raise HTTPException(403, "Forbidden")

    read = [Depends(may_read)]
    # a DAG run's sensors: the view's permission and Airflow's own to read the DAG's task
    # instances (dag_id from the query), as GET /api/v2/dags/{dag_id}/dagRuns/.../taskInstances
    read_dag_run = [
        *read,
        Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE)),
    ]
    edit = [Depends(requires_access_connection(method="PUT"))]

    app = FastAPI(
        title="NATS ordered pipelines",
        description="The airflow-nats-ordered provider's view of its pipelines.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.get("/", response_class=HTMLResponse, dependencies=read)
    async def page() -> HTMLResponse:
        return HTMLResponse(_page("view.html"), headers={"Cache-Control": "no-store"})

    @app.get("/view.js", dependencies=read)
    async def script() -> Response:
        return Response(
            _page("view.js"),
            media_type="text/javascript",
            headers={"Cache-Control": "no-store"},
        )

    @app.get("/api/connections", dependencies=read)
    async def connections() -> dict[str, Any]:
        """The Airflow connections of type ``nats`` stored in the metadata DB."""
        from airflow.models.connection import Connection
        from airflow.utils.session import create_session
        from sqlalchemy import select

        def read() -> list[str]:
            with create_session() as session:
                return list(
                    session.scalars(
                        select(Connection.conn_id)
                        .where(Connection.conn_type == NatsHook.conn_type)
                        .order_by(Connection.conn_id)
                    ).all()
                )

        ids = await run_in_threadpool(read)  # a metadata DB read: not on the loop
        return {"connections": [{"connection_id": c} for c in ids]}

    @app.get("/api/connections/{connection_id}/overview", dependencies=read)
    async def overview(connection_id: str) -> dict[str, Any]:
        """Streams (layout epochs, run ledgers, global producers) and groups (``group list
        --json``) of the connection's server."""

        async def fn(nc: Any) -> dict[str, Any]:
            streams = await stream_list(nc)
            for s in streams:
                if "error" not in s:
                    s["runs"] = await run_list(nc, s["stream"])
                    s["producers"] = await producer_list(nc, s["stream"])
            return {
                "connection_id": connection_id,
                "streams": streams,
                **await group_list(nc, skip_vanished=True),
            }

        return await _with_nats(connection_id, fn)

    @app.get("/api/connections/{connection_id}/streams/{stream}/groups/{group}", dependencies=read)
    async def status(connection_id: str, stream: str, group: str) -> dict[str, Any]:
        """The group's status: exactly ``nats-ordered status --json``."""
        return await _with_nats(connection_id, lambda nc: group_status(nc, stream, group))

    @app.get(
        "/api/connections/{connection_id}/streams/{stream}/groups/{group}/dead-letters",
        dependencies=read,
    )
    async def dead_letters(
        connection_id: str,
        stream: str,
        group: str,
        limit: Annotated[int, Query(ge=1, le=DEAD_LETTER_LIMIT)] = 50,
    ) -> dict[str, Any]:
        """The group's dead letters (``dead-letters list --json``), at most ``limit``."""

        async def fn(nc: Any) -> dict[str, Any]:
            place = await dead_letter_place(nc, stream, group)
            letters = await read_dead_letters(nc, place, limit=limit)
            return {
                "stream": place.stream,
                "group": group,
                "dead_letters": [x.to_dict() for x in letters],
            }

        return await _with_nats(connection_id, fn)

    @app.get(
        "/api/connections/{connection_id}/streams/{stream}/groups/{group}/dead-letters/{seq}",
        dependencies=read,
    )
    async def dead_letter(connection_id: str, stream: str, group: str, seq: int) -> dict[str, Any]:
        """One dead letter with its headers and payload (``dead-letters show --json``)."""

        async def fn(nc: Any) -> dict[str, Any]:
            place = await dead_letter_place(nc, stream, group)
            (letter,) = await read_dead_letters(nc, place, seqs=[seq])
            return letter.to_dict(payload=True)

        return await _with_nats(connection_id, fn)

    @app.get("/api/dagrun", dependencies=read_dag_run)
    async def dag_run(
        dag_id: str,
        run_id: str,
        session: SessionDep,
        conn: Annotated[str | None, Query(description="for sensors naming none")] = None,
    ) -> dict[str, Any]:
        """What the DAG run's drain sensors wait on: per NatsGroupDrainSensor task instance
        its state, stream, group and marks (:mod:`.dagrun`) and, for each mark, the group's
        committed position and exact lag against it now (``wait`` :func:`drain_wait_status`;
        ``error`` instead when NATS cannot say). The NATS connection is the sensor's when
        Airflow holds it (a deferred sensor's trigger, a templated ``nats_conn_id``), else
        ``conn``, else ``nats_default`` (the sensor's default)."""
        # the metadata DB read in a worker thread, as Airflow runs its own sync routes
        sensors = await run_in_threadpool(drain_sensors, session, dag_id, run_id)
        if sensors is None:
            raise HTTPException(404, f"no DAG run {run_id!r} of DAG {dag_id!r}")
        waiting: dict[str, list[dict[str, Any]]] = {}  # connection id -> its sensors to ask
        for s in sensors:
            s["connection_id"] = s["nats_conn_id"] or conn or NatsHook.default_conn_name
            s["wait"] = None
            if s["stream"] and s["group"] and s["marks"] is not None:
                waiting.setdefault(s["connection_id"], []).append(s)
        for connection_id, asked in waiting.items():  # one client per connection
            try:
                async with _connected(connection_id) as nc:
                    for s in asked:
                        try:
                            s["wait"] = await drain_wait_status(
                                nc, s["stream"], s["group"], s["marks"]
                            )
                        except Exception as exc:
                            http = _as_http(exc, connection_id, nc)
                            s["error"] = f"{http.status_code}: {http.detail}"
            except HTTPException as exc:  # the connection itself: every sensor on it
                for s in asked:
                    s.setdefault("error", f"{exc.status_code}: {exc.detail}")
        return {"dag_id": dag_id, "run_id": run_id, "sensors": sensors}

    base = "/api/connections/{connection_id}/streams/{stream}/groups/{group}/actions"

    @app.post(f"{base}/rebalance", dependencies=edit)
    async def rebalance(
        connection_id: str, stream: str, group: str, body: RebalanceBody, user: GetUserDep
    ) -> dict[str, Any]:
        """Ask the group's leader for a new assignment (``group rebalance``)."""
        _check_confirm(body, group)

        async def fn(nc: Any) -> dict[str, Any]:
            done = await rebalance_group(nc, stream, group, cordon=body.cordon, timeout=30)
            return done.to_dict()

        return await _act(user, "rebalance", connection_id, stream, group, body, fn)

    @app.post(f"{base}/reset", dependencies=edit)
    async def reset(
        connection_id: str, stream: str, group: str, body: ResetBody, user: GetUserDep
    ) -> dict[str, Any]:
        """Move every partition's committed position to the earliest or latest (``group
        reset --to-earliest/--to-latest``; fenced: running members hand over)."""
        _check_confirm(body, group)

        async def fn(nc: Any) -> dict[str, Any]:
            done = await reset_group(nc, stream, group, to=body.to, confirm=True)
            return done.to_dict()

        return await _act(user, "reset", connection_id, stream, group, body, fn)

    @app.post(f"{base}/replay-dead-letters", dependencies=edit)
    async def replay(
        connection_id: str, stream: str, group: str, body: ReplayBody, user: GetUserDep
    ) -> dict[str, Any]:
        """Publish the group's dead letters (or those at ``seqs``) again to their partitions
        (``dead-letters replay``)."""
        _check_confirm(body, group)

        async def fn(nc: Any) -> dict[str, Any]:
            place = await dead_letter_place(nc, stream, group)
            letters = await read_dead_letters(
                nc, place, seqs=body.seqs or None, limit=None if body.seqs else DEAD_LETTER_LIMIT
            )
            result = await replay_dead_letters(nc, place, stream, letters, purge=body.purge)
            return {
                "stream": stream,
                "group": group,
                "replays": [r.to_dict() for r in result.replays],
            }

        return await _act(user, "replay_dead_letters", connection_id, stream, group, body, fn)

    return app


async def _act(
    user: Any,
    action: str,
    connection_id: str,
    stream: str,
    group: str,
    body: BaseModel,
    fn: Callable[[Any], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """Run an action and audit it, whether it succeeded or failed."""
    target = {
        "connection_id": connection_id,
        "stream": stream,
        "group": group,
        **{k: v for k, v in body.model_dump().items() if k != "confirm"},
    }
    try:
        out = await _with_nats(connection_id, fn)
    except HTTPException as exc:
        await _audit(user, action, target, {"outcome": "failed", "error": exc.detail})
        raise
    await _audit(user, action, target, {"outcome": "done", "result": out})
    return out
