"""The UI plugin Airflow loads: a FastAPI app under :data:`URL_PREFIX` and an entry in the
UI's navigation (``Browse`` > ``NATS pipelines``) that shows its page inside Airflow.

Airflow imports plugins in every component (scheduler, triggerer, workers); the FastAPI app,
and with it Airflow's API security and the core, is built on the first request the
api-server passes to it, so those components load none of it.
"""

from __future__ import annotations

import threading
from typing import Any

from airflow.plugins_manager import AirflowPlugin

#: where the api-server mounts the app (the page is ``<base url>/nats-ordered/``)
URL_PREFIX = "/nats-ordered"


class _LazyApp:
    """An ASGI app that builds :func:`.app.create_app` on its first call."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    from airflow_nats_ordered.plugins.app import create_app

                    self._app = create_app()
        await self._app(scope, receive, send)


class NatsOrderedViewPlugin(AirflowPlugin):
    """``nats_ordered``: per ``nats`` connection, the streams, groups (owner, fencing token,
    committed position and exact lag per partition), members, dead letters, run ledgers and
    global-order readers and producers; rebalance, reset and dead-letter replay for users
    who may edit connections."""

    name = "nats_ordered"
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": URL_PREFIX, "name": "NATS pipelines"}]
    external_views = [
        {
            "name": "NATS pipelines",
            "href": f"{URL_PREFIX}/",
            "url_route": "nats-ordered",
            "category": "browse",
            "destination": "nav",
        }
    ]
