"""Operate a consumer group from a DAG: rebalance it, reset its positions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from airflow.sdk import BaseOperator, XComArg
from airflow.sdk.exceptions import AirflowSkipException

from airflow_nats_ordered.core.admin.membership import live_members
from airflow_nats_ordered.core.admin.rebalance import partition_rates, rebalance_group
from airflow_nats_ordered.core.admin.reset import reset_group
from airflow_nats_ordered.core.errors import ConfigError
from airflow_nats_ordered.core.group.assignor import Assignment, assign, imbalance
from airflow_nats_ordered.core.group.store import GroupStore
from airflow_nats_ordered.hooks.arguments import refuse_unknown_operator_arguments
from airflow_nats_ordered.hooks.nats import NatsHook
from airflow_nats_ordered.operators.failures import failing_at_once
from airflow_nats_ordered.operators.lineage import is_templated


class NatsRebalanceOperator(BaseOperator):
    """Ask the group's leader for a new assignment now; wait until it has settled.

    ``cordon``: member ids to take partitions away from (before maintenance); it stays in
    force until the next rebalance without them. A list, or an XComArg (e.g. the output of
    a task that picks members from the group's live ones at run time), or a Jinja template
    rendering to a list (``render_template_as_native_obj=True``). An id the group does not
    know (not live, owning nothing, not cordoned already) fails the task naming the live
    members; a known member that is not live (cordoned earlier, stopped) may stay cordoned.
    ``weights``: per-partition load, a
    ``{partition: load}`` mapping or ``"rates"`` (messages/s of the last ``rate_window``
    seconds, measured on the server): a skewed stream is then balanced by load, not by
    count, still moving as little as possible. ``min_gain``: with weights, skip (task state
    *skipped*) when the heaviest member's load would drop by less than this fraction.
    Returns the moves (XCom)."""

    template_fields: Sequence[str] = ("stream", "group", "cordon", "weights", "nats_conn_id")
    template_fields_renderers = {"cordon": "json", "weights": "json"}
    ui_color = "#e8d4f0"

    def __init__(
        self,
        *,
        stream: str,
        group: str,
        cordon: Sequence[str] | XComArg = (),
        weights: Mapping[int, float] | Literal["rates"] | None = None,
        rate_window: float = 3600.0,
        slack: float = 0.0,
        min_gain: float | None = None,
        settle_timeout: float = 120.0,
        nats_conn_id: str = NatsHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_operator_arguments(self, kwargs)
        super().__init__(**kwargs)
        if isinstance(cordon, str) and not is_templated(cordon):
            raise ConfigError(f"cordon must be a list of member ids, not the string {cordon!r}")
        self.stream = stream
        self.group = group
        # an XComArg or a template is resolved when the task runs (checked in execute)
        self.cordon: Any = cordon if isinstance(cordon, str | XComArg) else list(cordon)
        self.weights = weights
        self.rate_window = rate_window
        self.slack = slack
        self.min_gain = min_gain
        self.settle_timeout = settle_timeout
        self.nats_conn_id = nats_conn_id

    def _rendered_cordon(self) -> list[str]:
        """``cordon`` as rendered: a list of member ids (a template rendered without
        ``render_template_as_native_obj`` is a string, refused naming the fix)."""
        cordon = self.cordon
        if isinstance(cordon, str):
            raise ConfigError(
                f"cordon rendered to the string {cordon!r}, not a list of member ids: pass a "
                "list, an XComArg (a task's output), or render the DAG's templates as native "
                "objects (render_template_as_native_obj=True)"
            )
        if cordon is None:
            return []
        ids = list(cordon)
        bad = [m for m in ids if not isinstance(m, str) or not m]
        if bad:
            raise ConfigError(f"cordon must be a list of member ids (strings), got {ids!r}")
        return ids

    def execute(self, context: Any) -> dict[str, Any]:
        with failing_at_once():
            cordon = self._rendered_cordon()

        async def run(nc: Any) -> dict[str, Any]:
            weights: dict[int, float] | None = None
            if self.weights == "rates":
                weights = await partition_rates(nc, self.stream, self.rate_window)
            elif self.weights is not None:
                weights = {int(p): float(w) for p, w in dict(self.weights).items()}
            if weights and self.min_gain is not None and not cordon:
                gain = await self._gain(nc, weights)
                if gain is not None and gain < self.min_gain:
                    raise AirflowSkipException(
                        f"rebalancing group {self.group} by load would lower the heaviest "
                        f"member's load by {gain:.1%}, under min_gain {self.min_gain:.1%}"
                    )
            result = await rebalance_group(
                nc,
                self.stream,
                self.group,
                cordon=cordon,
                weights=weights,
                slack=self.slack,
                timeout=self.settle_timeout,
            )
            return result.to_dict()

        with failing_at_once():  # a bad cordon or weights, a missing stream
            out = NatsHook(self.nats_conn_id).run(run)
        self.log.info(
            "group %s: generation %s, %d partition(s) moved %s, settled in %ss",
            self.group,
            out["generation"],
            len(out["moves"]),
            out["moves"],
            out["settled_in"],
        )
        return out

    async def _gain(self, nc: Any, weights: dict[int, float]) -> float | None:
        """How much the heaviest member's share would fall (the leader's computation,
        done here without changing anything)."""
        store = await GroupStore.attach(nc, self.stream, self.group)
        data, _ = await store.read_assignment()
        if data is None:
            return None
        now = Assignment.from_json(data)
        members = await live_members(nc, self.stream, self.group)
        if not members:
            return None
        planned = assign(now.partitions, members, now, weights=weights, slack=self.slack)
        before, after = imbalance(now, weights, members), imbalance(planned, weights, members)
        return 0.0 if before <= 0 else (before - after) / before


class NatsResetGroupOperator(BaseOperator):
    """Rewind or skip a group's positions (Kafka's ``--reset-offsets``), fenced so running
    members cannot write an old position back.

    ``to``: ``"earliest"``, ``"latest"`` or ``{partition: sequence}`` (the next message
    processed is the first after it). Refuses unless ``confirm=True``. The sink is not
    reset: a fenced sink ignores what it already applied, so reset it too before a replay
    meant to re-apply. Returns the positions before and after (XCom)."""

    template_fields: Sequence[str] = ("stream", "group", "to", "partitions", "nats_conn_id")
    template_fields_renderers = {"to": "json", "partitions": "json"}
    ui_color = "#f0d4d4"

    def __init__(
        self,
        *,
        stream: str,
        group: str,
        to: Literal["earliest", "latest"] | Mapping[int, int],
        partitions: Sequence[int] | None = None,
        confirm: bool = False,
        nats_conn_id: str = NatsHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_operator_arguments(self, kwargs)
        super().__init__(**kwargs)
        if not confirm:
            raise ConfigError(
                f"NatsResetGroupOperator {kwargs.get('task_id')!r} re-processes or skips "
                f"messages of group {group}: pass confirm=True"
            )
        self.stream = stream
        self.group = group
        self.to = to
        self.partitions = partitions
        self.nats_conn_id = nats_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        to = self.to
        if isinstance(to, Mapping):
            to = {int(p): int(s) for p, s in to.items()}

        async def run(nc: Any) -> dict[str, Any]:
            result = await reset_group(
                nc, self.stream, self.group, to=to, partitions=self.partitions, confirm=True
            )
            return result.to_dict()

        with failing_at_once():  # a bad target or partition, a missing stream
            out = NatsHook(self.nats_conn_id).run(run)
        self.log.info("group %s reset: %s", self.group, out["positions"])
        return out
