"""An auth manager for tests of the UI view's DAG permissions: Airflow's simple auth manager,
except that user ``viewer`` may not read DAG :data:`HIDDEN_DAG` (as a FAB role without that
DAG would be). Loaded by a real api-server (``[core] auth_manager``)."""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

HIDDEN_DAG = "hidden_from_viewer"


class HidingAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method: Any, user: Any, **kw: Any) -> bool:
        details = kw.get("details")
        if user.get_name() == "viewer" and details is not None and details.id == HIDDEN_DAG:
            return False
        return super().is_authorized_dag(method=method, user=user, **kw)
