"""A real ``airflow api-server`` for tests of the REST API and of pages: its own Airflow home
and metadata DB (:func:`airflow_processes.private_home`), Airflow's simple auth manager with
known users, and a client that logs in as one of them.

Users (name -> role): ``admin`` (admin), ``op`` (op: may edit connections), ``viewer``
(viewer: reads only); every password is :data:`PASSWORD`.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_processes import AIRFLOW, airflow_env, private_home

from airflow_nats_ordered.embedded.process import free_port

PASSWORD = "not-a-real-password"
USERS = {"admin": "admin", "op": "op", "viewer": "viewer"}


class ApiServer:
    """``airflow api-server`` on a free port of 127.0.0.1; a context manager (start, stop)."""

    def __init__(self, tmp_path: Path, env: Mapping[str, str] | None = None) -> None:
        home, self.db = private_home(tmp_path / "airflow-api")
        self.home = Path(home["AIRFLOW_HOME"])
        passwords = self.home / "passwords.json"
        passwords.write_text(json.dumps({name: PASSWORD for name in USERS}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **home,
            "AIRFLOW__CORE__AUTH_MANAGER": (
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
            ),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
                f"{u}:{r}" for u, r in USERS.items()
            ),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__API__BASE_URL": self.url,
            **(env or {}),
        }
        self.log_path = tmp_path / "api-server.log"
        self.proc: subprocess.Popen | None = None
        self._tokens: dict[str, str] = {}

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 240) -> ApiServer:
        """Start it and wait until it answers (a fresh clone's first start compiles Airflow)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [AIRFLOW, "api-server", "--host", "127.0.0.1", "--port", str(self.port)],
                env=airflow_env(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"api-server exited:\n{self.log()[-3000:]}"
            try:
                status, _ = self.request("GET", "/api/v2/monitor/health", user=None)
                if status == 200:
                    return self
            except OSError:
                pass
            assert time.monotonic() < deadline, (
                f"api-server not up within {timeout:.0f} s:\n{self.log()[-3000:]}"
            )
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def token(self, user: str = "admin") -> str:
        """A JWT for ``user`` from the simple auth manager's ``POST /auth/token``."""
        if user not in self._tokens:
            status, body = self.request(
                "POST", "/auth/token", {"username": user, "password": PASSWORD}, user=None
            )
            assert status in (200, 201), f"login as {user}: {status} {body}"
            self._tokens[user] = body["access_token"]
        return self._tokens[user]

    def request(
        self, method: str, path: str, body: Any = None, *, user: str | None = "admin"
    ) -> tuple[int, Any]:
        """``(status, parsed JSON or text)`` of one request, as ``user`` (None: no token)."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if user is not None:
            headers["Authorization"] = f"Bearer {self.token(user)}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, raw = r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read().decode()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw
