"""The provider's UI view (``airflow_nats_ordered.plugins``) as a person uses it: a real
``airflow api-server`` (simple auth manager: admin, op, viewer), a real nats-server with a
provisioned stream, published records and two running workers (one record dead-lettered),
and the page opened in headless Chromium with the user's Airflow session cookie.

What the page shows per partition (owner, fencing token, committed position, last
sequence, exact lag) is compared with ``nats-ordered status --json`` for the same group;
requests without a token are refused; a viewer cannot run an action, an op can with the
group's name as confirmation, and the action is in Airflow's audit log. Screenshots are
kept under the test's tmp_path (the path is printed)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from airflow_api import ApiServer
from chromium import Browser, chromium_path
from locations import TESTS

from airflow_nats_ordered.cli import main as cli
from airflow_nats_ordered.core.publish.runs import publish_run

CONN = "nats_view"
GROUP = "billing"
PARTITIONS = 3
RECORDS = 60
RUN = "orders_dag.publish.2026-11-27T00:00:00+00:00"


@dataclass(frozen=True)
class _Rec:
    key: str
    payload: bytes
    where: str
    msg_id: str | None = None


def _status(url: str, stream: str, capsys: pytest.CaptureFixture[str]) -> dict | None:
    code = cli(["status", "--stream", stream, "--group", GROUP, "--json", "--server", url])
    out = capsys.readouterr()
    if code != 0:
        return None  # no group state yet: the workers are starting
    return json.loads(out.out)


def _worker(url: str, stream: str, member: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "airflow_nats_ordered.cli",
                "worker",
                "--stream",
                stream,
                "--group",
                GROUP,
                "--handler",
                "ui_handlers:fail_poison",
                "--member-id",
                member,
                "--max-retries",
                "0",
                "--lease-ttl",
                "3",
                "--server",
                url,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _raw(api: ApiServer, method: str, path: str, body: object = None, headers=None):
    """``(status, text)`` of a request with exactly ``headers`` (no token unless given)."""
    data = json.dumps(body).encode() if body is not None else None
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(api.url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _page_partitions(browser: Browser) -> list[dict]:
    """The partitions table as the page shows it: one dict per row, the cells' text."""
    return browser.evaluate(
        """[...document.querySelectorAll('#partitions tr[data-partition]')].map(tr => {
             const o = {};
             tr.querySelectorAll('td[data-field]').forEach(td => {
               if (td.dataset.field) o[td.dataset.field] = td.innerText.trim();
             });
             return o;
           })"""
    )


def _as_shown(p: dict) -> dict:
    """A partition of ``status --json`` as the page writes it."""
    return {
        "partition": str(p["partition"]),
        "owner": p["owner"] if p["owner"] is not None else "-",
        "fencing_token": str(p["fencing_token"]),
        "committed": str(p["committed"]),
        "last": str(p["last"]),
        "lag": str(p["lag"]),
        "blocked": p["blocked"] if p["blocked"] else "no",
    }


def _open_group(browser: Browser, api: ApiServer, stream: str) -> None:
    browser.open(f"{api.url}/nats-ordered/?conn={CONN}&stream={stream}&group={GROUP}")
    browser.wait_for(
        f"document.body.dataset.state === 'ready' && "
        f"document.body.dataset.group === '{stream}/{GROUP}'",
        what="the group's view",
    )


def test_ui_view_shows_what_status_says_and_guards_its_actions(
    shared_nats_server, unique_name, tmp_path, capsys
):
    chromium_path()  # fails (not skips) without chromium, before minutes of set-up
    url = shared_nats_server.url
    stream = unique_name
    provision = ["provision", "--stream", stream, "--partitions", str(PARTITIONS)]
    assert cli([*provision, "--server", url]) == 0
    # published as a named run, as NatsPublishOperator does (its producer id names the DAG run)
    records = [
        _Rec(f"k{i % 9}", json.dumps({"i": i, "poison": i == 17}).encode(), f"row {i}")
        for i in range(RECORDS)
    ]

    async def publish() -> None:
        nc = await nats.connect(url)
        try:
            result = await publish_run(nc, stream, records, producer_id=RUN)
            assert result.record.status == "complete", result.record
        finally:
            await nc.close()

    asyncio.run(publish())
    capsys.readouterr()
    workers = [_worker(url, stream, m, tmp_path / f"{m}.log") for m in ("vm-1", "vm-2")]
    try:
        # both members own partitions, everything handled, the poison record dead-lettered
        deadline = time.monotonic() + 180
        while True:
            st = _status(url, stream, capsys)
            if (
                st
                and st["total_lag"] == 0
                and len(st["members"]) == 2
                and all(p["owner"] for p in st["partitions"])
                and st["dead_letters"]["messages"] == 1
            ):
                break
            assert all(w.poll() is None for w in workers), "a worker exited"
            assert time.monotonic() < deadline, f"the group did not settle: {st}"
            time.sleep(0.5)

        # a connection from an environment variable (as `make demo` has) works as well
        env_conn = json.dumps({"conn_type": "nats", "extra": {"servers": url}})
        with ApiServer(tmp_path, env={"AIRFLOW_CONN_NATS_ENV": env_conn}) as api:
            host, port = url.removeprefix("nats://").rsplit(":", 1)
            status, body = api.request(
                "POST",
                "/api/v2/connections",
                {"connection_id": CONN, "conn_type": "nats", "host": host, "port": int(port)},
            )
            assert status == 201, body

            # Airflow lists the plugin, loaded from the installed provider
            status, plugins = api.request("GET", "/api/v2/plugins")
            assert status == 200, plugins
            ours = [p for p in plugins["plugins"] if p["name"] == "nats_ordered"]
            assert ours, plugins
            assert ours[0]["fastapi_apps"][0]["url_prefix"] == "/nats-ordered"
            assert ours[0]["external_views"][0]["href"] == "/nats-ordered/"

            # no token: refused, page and JSON alike
            base = f"/nats-ordered/api/connections/{CONN}"
            for path in ("/nats-ordered/", "/nats-ordered/api/connections", f"{base}/overview"):
                status, text = _raw(api, "GET", path)
                assert status == 401, (path, status, text)
            status, text = _raw(
                api,
                "POST",
                f"{base}/streams/{stream}/groups/{GROUP}/actions/rebalance",
                {"confirm": GROUP},
            )
            assert status == 401, text

            with Browser(tmp_path) as browser:
                # a viewer sees the group as status --json does
                browser.set_cookie(api.url, "_token", api.token("viewer"))
                _open_group(browser, api, stream)
                shown = _page_partitions(browser)
                st = _status(url, stream, capsys)
                assert st is not None
                assert shown == [_as_shown(p) for p in st["partitions"]]
                text = browser.text()
                for m in ("vm-1", "vm-2"):
                    assert browser.evaluate(
                        f"!!document.querySelector('#members tr[data-member=\"{m}\"]')"
                    ), text
                assert browser.evaluate(
                    f"!!document.querySelector('#streams tr[data-stream=\"{stream}\"]')"
                ), text
                # the run ledger names the DAG run that published
                run = browser.evaluate(
                    f"[...document.querySelectorAll('#streams tr[data-run=\"{RUN}\"] td')]"
                    ".map(td => td.innerText)"
                )
                assert run and run[0] == RUN and run[1] == "complete", run
                # dead letters: listed, and one shown with its reason
                seq = browser.wait_for(
                    "document.querySelector('#dead-letters tr[data-dead-letter]')"
                    "?.dataset.deadLetter",
                    what="the dead letter's row",
                )
                browser.evaluate(
                    f'document.querySelector(\'#dead-letters tr[data-dead-letter="{seq}"] '
                    "button').click()"
                )
                shown_letter = browser.wait_for(
                    f"document.getElementById('dead-letter').dataset.seq === '{seq}' && "
                    "document.getElementById('dead-letter').textContent",
                    what="the dead letter shown",
                )
                assert "poison record" in shown_letter
                shot = browser.screenshot(tmp_path / "ui-view.png")
                with capsys.disabled():  # shown whatever pytest captures
                    print(f"\nscreenshot: {shot}")

                # inside Airflow's UI (Browse > NATS pipelines): the page in its frame reads
                # the JSON with the session cookie of the user signed in to Airflow
                browser.open(f"{api.url}/plugin/nats-ordered")
                framed = (
                    "(() => { const f = document.querySelector('iframe');"
                    " const d = f && f.contentDocument;"
                    " return !!(d && d.body && d.body.dataset.state === 'ready'"
                    f" && d.querySelector('#groups tr[data-group=\"{stream}/{GROUP}\"]')); }})()"
                )
                browser.wait_for(framed, what="the view inside Airflow's UI")
                assert browser.evaluate(
                    "document.querySelector('iframe').getAttribute('src')"
                ).endswith("/nats-ordered/")
                frame = "document.querySelector('iframe').contentDocument"
                browser.evaluate(
                    f"{frame}.querySelector('button[data-open=\"{stream}/{GROUP}\"]').click()"
                )
                browser.wait_for(
                    f"{frame}.body.dataset.group === '{stream}/{GROUP}' && "
                    f"{frame}.body.dataset.state === 'ready'",
                    what="the group opened inside Airflow's UI",
                )
                shot = browser.screenshot(tmp_path / "ui-view-in-airflow.png")
                with capsys.disabled():  # shown whatever pytest captures
                    print(f"\nscreenshot: {shot}")
                _open_group(browser, api, stream)

                # a viewer may not act, confirmed or not
                browser.evaluate(f"document.getElementById('confirm').value = '{GROUP}'")
                browser.evaluate("document.getElementById('act-rebalance').click()")
                refused = browser.wait_for(
                    "document.getElementById('action-result').dataset.state === 'refused' && "
                    "document.getElementById('action-result').textContent",
                    what="the viewer's rebalance refused",
                )
                assert "403" in refused, refused
                status, text = _raw(
                    api,
                    "POST",
                    f"{base}/streams/{stream}/groups/{GROUP}/actions/rebalance",
                    {"confirm": GROUP},
                    {"Authorization": f"Bearer {api.token('viewer')}"},
                )
                assert status == 403, text

                # an op: a wrong confirmation is refused, the right one rebalances
                browser.clear_cookies()
                browser.set_cookie(api.url, "_token", api.token("op"))
                _open_group(browser, api, stream)
                browser.evaluate("document.getElementById('confirm').value = 'not-the-group'")
                browser.evaluate("document.getElementById('act-rebalance').click()")
                refused = browser.wait_for(
                    "document.getElementById('action-result').dataset.state === 'refused' && "
                    "document.getElementById('action-result').textContent",
                    what="the op's unconfirmed rebalance refused",
                )
                assert "400" in refused and "confirm" in refused, refused
                browser.evaluate(f"document.getElementById('confirm').value = '{GROUP}'")
                browser.evaluate("document.getElementById('act-rebalance').click()")
                done = browser.wait_for(
                    "document.getElementById('action-result').dataset.state === 'done' && "
                    "document.getElementById('action-result').textContent",
                    timeout=120,
                    what="the op's rebalance done",
                )
                assert "generation" in done, done
                browser.wait_for("document.body.dataset.state === 'ready'")
                browser.screenshot(tmp_path / "ui-view-after-rebalance.png")

            # the same status through the environment's connection, over the JSON API
            status, env_status = api.request(
                "GET",
                f"/nats-ordered/api/connections/nats_env/streams/{stream}/groups/{GROUP}",
                user="viewer",
            )
            assert status == 200, env_status
            st = _status(url, stream, capsys)
            assert st is not None
            assert env_status["partitions"] == st["partitions"]

            def members(out: dict) -> list:  # a heartbeat's age changes by the second
                age = "heartbeat_age"
                return [{k: v for k, v in m.items() if k != age} for m in out["members"]]

            assert members(env_status) == members(st)
            # an unknown connection is named
            status, body = api.request(
                "GET", "/nats-ordered/api/connections/no_such/overview", user="viewer"
            )
            assert status == 404 and "no_such" in body["detail"], body

            # an op replays the dead letter (the handler fails it again: dead-lettered again)
            # and resets the group to latest (nothing to skip: the group is drained)
            actions = f"{base}/streams/{stream}/groups/{GROUP}/actions"
            status, body = api.request(
                "POST", f"{actions}/replay-dead-letters", {"confirm": GROUP}, user="op"
            )
            assert status == 200, body
            assert [r["outcome"] for r in body["replays"]] == ["stored"], body
            status, body = api.request(
                "POST", f"{actions}/reset", {"confirm": GROUP, "to": "latest"}, user="op"
            )
            assert status == 200, body
            status, body = api.request(
                "POST", f"{actions}/reset", {"confirm": GROUP, "to": "latest"}, user="viewer"
            )
            assert status == 403, body
            status, logs = api.request(
                "GET", "/api/v2/eventLogs?event_pattern=nats_ordered.&order_by=id"
            )
            assert status == 200, logs
            assert sorted({(e["event"], e["owner"]) for e in logs["event_logs"]}) == [
                ("nats_ordered.rebalance", "op"),
                ("nats_ordered.replay_dead_letters", "op"),
                ("nats_ordered.reset", "op"),
            ], logs

            # the audit log: Airflow's (Browse > Audit Log) and the api-server's log line
            status, logs = api.request("GET", "/api/v2/eventLogs?event=nats_ordered.rebalance")
            assert status == 200, logs
            entries = logs["event_logs"]
            assert [e["owner"] for e in entries] == ["op"], entries
            extra = json.loads(entries[0]["extra"])
            assert (extra["stream"], extra["group"], extra["outcome"]) == (stream, GROUP, "done")
            assert "confirm" not in extra
            assert "user op ran rebalance on" in api.log()
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()
