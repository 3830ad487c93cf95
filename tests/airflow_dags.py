"""Run DAG files with ``dag.test()`` in the test session's throw-away AIRFLOW_HOME, beside a
worker pool running in a background thread (as a worker deployment would run beside
Airflow). DAG files are written into the dags folder, because ``dag.test()`` serializes
the DAG from its bundle."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import textwrap
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
from airflow_processes import airflow_home, metadata_db

from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.core.worker.pool import WorkerPool


def dags_folder() -> Path:
    folder = airflow_home() / "dags"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def dag_file(source: str, **values: Any) -> Iterator[Any]:
    """Write ``source`` (formatted with ``values``) as a DAG file, import it, yield its
    ``dag``; the file is removed afterwards so the dags folder stays small."""
    metadata_db()
    name = f"t_{uuid.uuid4().hex[:10]}"
    path = dags_folder() / f"{name}.py"
    path.write_text(textwrap.dedent(source).format(dag_id=name, **values))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module.dag
    finally:
        path.unlink(missing_ok=True)


def nats_connection(url: str) -> str:
    """``AIRFLOW_CONN_<ID>`` value for a server URL (JSON form)."""
    return json.dumps({"conn_type": "nats", "extra": {"servers": url}})


def task_states(dag_run: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


class BackgroundPool:
    """A WorkerPool on its own event loop in a thread; ``stop()`` makes every member leave."""

    def __init__(self, url: str, config: WorkerConfig, handler: Any, size: int = 2) -> None:
        self.url, self.config, self.handler, self.size = url, config, handler, size
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with WorkerPool(self.url, self.config, self.handler, size=self.size) as pool:
                await pool.wait_assigned(30)
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by start()/stop()
            self._error = exc
            self._ready.set()

    def start(self) -> BackgroundPool:
        self._thread.start()
        assert self._ready.wait(60), "the worker pool did not start"
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        if self._error is not None:
            raise self._error

    def __enter__(self) -> BackgroundPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def on_server(url: str, fn: Any) -> Any:
    """``await fn(nc)`` on a fresh connection to ``url``, from synchronous test code."""

    async def go() -> Any:
        nc = await nats.connect(url)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(go())
