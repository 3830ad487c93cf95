"""docker-compose.yml cannot be started here (no Docker engine), so keep it honest: every
image is pinned, every command and flag parses with the real parser (nats-ordered, airflow,
Spark's Master and Worker), every file and folder it or the Dockerfile names exists, every
port agrees with the config or flag that opens it, every variable is one that the project,
Airflow or the image reads, the secret env files are generated (never committed), and the
three nats-server configs boot on the real binary as a cluster that takes the compose's own
R3 provision and runs the compose's worker-pool command until it is healthy."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
import yaml
from locations import ROOT
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from airflow_nats_ordered.cli import build_parser
from airflow_nats_ordered.cli import main as cli_main
from airflow_nats_ordered.core.connection.options import ConnectionOptions
from airflow_nats_ordered.embedded.process import find_nats_server, free_port

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NATS_NODES = sorted(n for n, s in SERVICES.items() if s.get("image", "").startswith("nats:"))
#: variables read by a third-party image or by Python itself, per service image
IMAGE_ENV = {"postgres:": {"POSTGRES_USER", "POSTGRES_DB", "POSTGRES_PASSWORD"}}
PYTHON_ENV = {"PYTHONPATH"}


# ------------------------------------------------------------------ reading the files
def _built(svc: dict[str, Any]) -> bool:
    return "build" in svc


def _env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (svc.get("environment") or {}).items()}


def _env_files(svc: dict[str, Any]) -> list[Path]:
    files = svc.get("env_file") or []
    return [ROOT / (f if isinstance(f, str) else f["path"]) for f in files]


def _example_env(path: Path) -> dict[str, str]:
    """``NAME=value`` lines of the committed ``<path>.example``."""
    lines = Path(f"{path}.example").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.strip() and not ln.startswith("#"))


def _all_env(svc: dict[str, Any]) -> dict[str, str]:
    """The service's variables: its env files (as their examples) then its environment."""
    env: dict[str, str] = {}
    for f in _env_files(svc):
        env.update(_example_env(f))
    env.update(_env(svc))
    return env


def _dockerfile_copies() -> dict[PurePosixPath, Path]:
    """Container path -> project path of every ``COPY`` (relative to its ``WORKDIR``)."""
    copies, workdir = {}, PurePosixPath("/")
    for line in DOCKERFILE.splitlines():
        words = line.split()
        if words[:1] == ["WORKDIR"]:
            workdir = workdir / words[1]
        elif words[:1] == ["COPY"]:
            args = [w for w in words[1:] if not w.startswith("--")]
            *sources, dest = args
            for src in sources:
                target = workdir / dest
                copies[target if len(sources) == 1 and not dest.endswith("/") else target / src] = (
                    ROOT / src
                )
    return copies


def _bind_mounts(svc: dict[str, Any]) -> dict[PurePosixPath, Path]:
    mounts = {}
    for vol in svc.get("volumes", []):
        src, dest = vol.split(":")[:2]
        if src.startswith((".", "/")):
            mounts[PurePosixPath(dest)] = ROOT / src
    return mounts


def _named_mounts(svc: dict[str, Any]) -> list[PurePosixPath]:
    return [
        PurePosixPath(v.split(":")[1])
        for v in svc.get("volumes", [])
        if not v.startswith((".", "/"))
    ]


def _project_path(svc: dict[str, Any], container_path: str) -> Path:
    """The project file a container path of ``svc`` comes from (bind mount or COPY)."""
    path = PurePosixPath(container_path)
    sources = {**_bind_mounts(svc), **(_dockerfile_copies() if _built(svc) else {})}
    for dest, src in sources.items():
        if path == dest or dest in path.parents:
            return src / path.relative_to(dest)
    raise AssertionError(f"{container_path} is neither copied into the image nor mounted")


def _on_named_volume(svc: dict[str, Any], container_path: str) -> bool:
    path = PurePosixPath(container_path)
    return any(path == m or m in path.parents for m in _named_mounts(svc))


def _nats_config(node: str) -> tuple[Path, str]:
    cmd = SERVICES[node]["command"]
    path = _project_path(SERVICES[node], cmd[cmd.index("--config") + 1])
    return path, path.read_text()


def _nats_addresses(text: str) -> dict[str, str]:
    """``client``, ``http`` and ``cluster`` listen addresses (``host:port``) of a config."""
    found = {
        "client": re.search(r"^listen: (\S+)$", text, re.M),
        "http": re.search(r"^http: (\S+)$", text, re.M),
        "cluster": re.search(r"^cluster \{[^}]*?^\s+listen: (\S+)$", text, re.M | re.S),
    }
    missing = [k for k, m in found.items() if m is None]
    assert not missing, f"nats config has no {missing} listen address"
    return {k: m.group(1) for k, m in found.items() if m}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _flag(cmd: list[str], name: str, default: Any = None) -> Any:
    return cmd[cmd.index(name) + 1] if name in cmd else default


def _exact_flags(parser: argparse.ArgumentParser, words: list[str]) -> set[str]:
    """The option strings of the (sub)command ``words`` names: argparse would also accept an
    abbreviation, which a command in a deployment file should not rely on."""
    for word in words:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if word.startswith("-") or sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    return set(parser._option_string_actions)


@functools.cache
def _airflow_parser() -> Any:
    from airflow.cli.cli_parser import get_parser

    return get_parser()


def _listening_ports(name: str) -> set[int]:
    """The container ports service ``name`` opens, read from its config file or flags."""
    svc = SERVICES[name]
    cmd = svc.get("command", [])
    if name in NATS_NODES:
        return {_port(a) for a in _nats_addresses(_nats_config(name)[1]).values()}
    if svc.get("image", "").startswith("postgres:"):
        return {5432}  # the image's default; PGPORT is not set
    if cmd[:1] == ["nats-ordered"]:
        args = build_parser().parse_args(cmd[1:])
        return {args.metrics_port} if getattr(args, "metrics_port", None) else set()
    if cmd[:2] == ["airflow", "api-server"]:
        return {_airflow_parser().parse_args(cmd[1:]).port}
    if cmd[:2] == ["airflow", "scheduler"]:
        from airflow.configuration import conf

        env = _all_env(svc)
        assert env.get("AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK") == "True"
        default = conf.getint("scheduler", "scheduler_health_check_server_port")
        return {int(env.get("AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT", default))}
    if cmd[:1] == ["spark-class"] and cmd[1].endswith(".Master"):
        return {int(_flag(cmd, "--port", 7077)), int(_flag(cmd, "--webui-port", 8080))}
    if cmd[:1] == ["spark-class"] and cmd[1].endswith(".Worker"):
        return {int(_flag(cmd, "--webui-port", 8081))}
    return set()


def _nats_conn_options(value: str) -> ConnectionOptions:
    """The ``nats_default`` connection given as AIRFLOW_CONN_NATS_DEFAULT, read by the hook."""
    from airflow_nats_ordered.hooks.nats import NatsHook

    old = os.environ.get("AIRFLOW_CONN_NATS_DEFAULT")
    os.environ["AIRFLOW_CONN_NATS_DEFAULT"] = value
    try:
        return NatsHook("nats_default").get_options()
    finally:
        if old is None:
            del os.environ["AIRFLOW_CONN_NATS_DEFAULT"]
        else:
            os.environ["AIRFLOW_CONN_NATS_DEFAULT"] = old


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_for(what: str, check: Any, timeout: float, log: Any = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout:.0f}s\n{log()}")


# ------------------------------------------------------------------ static checks
def test_every_image_is_pinned_and_the_project_image_matches_the_project():
    for name, svc in SERVICES.items():
        image = svc["image"]
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+(\.\d+)?[\w.-]*", image), (
            f"service {name}: image {image} is not pinned to a version"
        )
    project_images = {svc["image"] for svc in SERVICES.values() if _built(svc)}
    assert project_images == {f"nats-ordered:{PYPROJECT['project']['version']}"}, (
        "every service built from the project must tag the one image with pyproject's version"
    )
    # the cluster runs the release line the configs are tested on below
    binary = subprocess.run(
        [str(find_nats_server()), "--version"], capture_output=True, text=True, check=True
    ).stdout
    tested = re.search(r"v(\d+\.\d+)\.\d+", binary)
    assert tested is not None, binary
    for node in NATS_NODES:
        assert SERVICES[node]["image"].startswith(f"nats:{tested.group(1)}."), (
            f"{node} runs {SERVICES[node]['image']} but the configs are tested on {binary}"
        )
    base = re.search(r"^FROM python:(\d+)\.(\d+)\.(\d+)-slim-bookworm$", DOCKERFILE, re.M)
    assert base is not None, "the Dockerfile's base must be a pinned python:X.Y.Z-slim-bookworm"
    python = Version(".".join(base.groups()))
    assert python in SpecifierSet(PYPROJECT["project"]["requires-python"])
    airflow_version = re.search(r"^ARG AIRFLOW_VERSION=(\S+)$", DOCKERFILE, re.M)
    assert airflow_version is not None
    airflow_spec = next(
        d
        for d in PYPROJECT["project"]["optional-dependencies"]["airflow"]
        if d.startswith("apache-airflow>")
    )
    assert Version(airflow_version.group(1)) in SpecifierSet(
        airflow_spec.split("#")[0].removeprefix("apache-airflow").strip()
    ), f"the image's Airflow {airflow_version.group(1)} is outside pyproject's {airflow_spec}"


def test_every_command_and_flag_parses_with_the_real_parser():
    airflow = _airflow_parser()
    # Spark's own argument parsers, through the spark-class the image runs (both at once)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    helps = {
        cls: subprocess.Popen(
            ["spark-class", cls, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PATH=path),
        )
        for cls in {
            c[1]
            for c in (s.get("command", [""]) for s in SERVICES.values())
            if c[0] == "spark-class"
        }
    }
    spark_usage = {}
    for cls, proc in helps.items():
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Usage:" in err, f"spark-class {cls}: {err[-2000:]}"
        spark_usage[cls] = err
    scripts = set(PYPROJECT["project"]["scripts"])
    for name, svc in SERVICES.items():
        commands = [svc.get("command")]
        check = (svc.get("healthcheck") or {}).get("test", [])
        if check[:1] == ["CMD"] and check[1] == "airflow":
            commands.append(check[1:])
        for cmd in filter(None, commands):
            if not _built(svc):
                continue
            if cmd[0] in scripts or cmd[0] == "airflow":
                parser = airflow if cmd[0] == "airflow" else build_parser()
                try:
                    parser.parse_args(cmd[1:])
                except SystemExit as exc:
                    pytest.fail(f"service {name}: `{' '.join(cmd)}` does not parse ({exc.code})")
                flags = _exact_flags(parser, cmd[1:])
                for arg in cmd[1:]:
                    if arg.startswith("--"):
                        assert arg in flags, f"service {name}: `{cmd[0]}` has no flag {arg}"
                if cmd[0] in scripts:
                    assert (Path(sys.executable).parent / cmd[0]).exists()
            elif cmd[0] == "spark-class":
                assert cmd[1] in spark_usage, f"service {name}: unknown Spark class {cmd[1]}"
                for arg in cmd[2:]:
                    if arg.startswith("--"):
                        assert f" {arg} " in spark_usage[cmd[1]], f"service {name}: no flag {arg}"
            else:
                pytest.fail(f"service {name} runs {cmd[0]}, which the image does not provide")


def test_the_pool_handler_loads_from_the_image_paths(tmp_path, monkeypatch):
    """The worker pool's --handler imports with the service's PYTHONPATH (mapped to the
    project folder the image copies there) and opens its sink at its volume path."""
    from airflow_nats_ordered.members.handlers import load_handler

    for name, svc in SERVICES.items():
        cmd = svc.get("command", [])
        if cmd[:1] != ["nats-ordered"] or "--handler" not in cmd:
            continue
        for var, value in _env(svc).items():
            if var == "PYTHONPATH":
                for entry in value.split(":"):
                    monkeypatch.syspath_prepend(str(_project_path(svc, entry)))
            elif value.startswith("/") and _on_named_volume(svc, value):
                monkeypatch.setenv(var, str(tmp_path / PurePosixPath(value).name))
        loaded = load_handler(
            _flag(cmd, "--handler"), stream=_flag(cmd, "--stream"), group=_flag(cmd, "--group")
        )
        assert callable(loaded.handler), f"service {name}"
        if loaded.close:
            loaded.close()


def test_the_dags_publish_to_the_stream_and_group_the_services_provision_and_run(monkeypatch):
    """flights_ordered_pipeline reads its settings from the Airflow services' environment:
    they name the stream, partitions, replicas and group the provision and worker-pool use,
    and Spark jobs the image carries."""
    airflow = _all_env(SERVICES["airflow-scheduler"])
    monkeypatch.syspath_prepend(str(ROOT / "dags"))
    for var, value in airflow.items():
        monkeypatch.setenv(var, value)
    from flights.settings import FlightsSettings

    settings = FlightsSettings.from_env()
    provision = SERVICES["provision"]["command"]
    pool = SERVICES["worker-pool"]["command"]
    assert _flag(provision, "--stream") == _flag(pool, "--stream") == settings.stream
    assert int(_flag(provision, "--partitions")) == settings.partitions
    # the DAG's provision task applies its replicas on every run: it must not undo R3
    assert int(_flag(provision, "--replicas")) == settings.replicas
    assert _flag(pool, "--group") == settings.group
    assert settings.sink_db == _env(SERVICES["worker-pool"])["AIRCRAFT_TOTALS_DB"]
    spark_apps = _project_path(SERVICES["airflow-scheduler"], settings.spark_apps)
    assert (spark_apps / "publish_flights.py").is_file()


def test_every_file_and_folder_referenced_exists():
    for dest, src in _dockerfile_copies().items():
        assert src.exists(), f"the Dockerfile copies {src.relative_to(ROOT)} (to {dest})"
    for required in ("dags", "spark_apps", "airflow_nats_ordered"):
        assert any(s == ROOT / required for s in _dockerfile_copies().values()), (
            f"the image must carry {required}/"
        )
    declared = set(COMPOSE.get("volumes", {}))
    for name, svc in SERVICES.items():
        for dest, src in _bind_mounts(svc).items():
            assert src.exists(), f"service {name}: mounts missing {src} on {dest}"
        for vol in svc.get("volumes", []):
            if not vol.startswith((".", "/")):
                assert vol.split(":")[0] in declared, f"service {name}: volume {vol} undeclared"
        for env_file in _env_files(svc):
            assert Path(f"{env_file}.example").is_file(), f"{env_file}.example is missing"
        if not _built(svc):
            continue
        for mount in _named_mounts(svc):
            # created (owned by the image's user) in the image, so the volume starts so
            assert f" {mount}" in DOCKERFILE, f"service {name}: the image lacks {mount}"
        paths = [v for v in _env(svc).values() if v.startswith("/")]
        paths += [a for a in svc["command"] if a.startswith("/")]
        for path in paths:
            # a path into the image comes from the project, or lives on a named volume
            assert _on_named_volume(svc, path) or _project_path(svc, path).exists(), (
                f"service {name}: {path} is neither on a volume nor in the project"
            )
    for node in NATS_NODES:
        cmd = SERVICES[node]["command"]
        path, text = _nats_config(node)
        store = re.search(r"store_dir: (\S+)", text)
        assert store and _on_named_volume(SERVICES[node], store.group(1)), (
            f"{node}: the JetStream store of {path.name} must be on a named volume"
        )
        assert cmd[:1] == ["--config"], f"{node}: the image's entrypoint takes flags only"


def _docker_ignored(rel: str) -> bool:
    """Whether ``.dockerignore`` keeps project path ``rel`` (or a folder above it) out of the
    build context (its patterns: Go's filepath.Match, ``**`` for any folders, no ``!``)."""
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "extend _docker_ignored for '!'"
    parts = PurePosixPath(rel).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        for path in candidates:
            if fnmatch.fnmatchcase(path, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatchcase(path.split("/")[-1], pattern[3:])
            ):
                return True
    return False


def test_the_build_context_holds_every_copy_source_and_no_secret():
    for src in _dockerfile_copies().values():
        rel = src.relative_to(ROOT).as_posix()
        assert not _docker_ignored(rel), f".dockerignore excludes {rel}, which the image copies"
    for svc in SERVICES.values():
        for env_file in _env_files(svc):
            rel = env_file.relative_to(ROOT).as_posix()
            assert _docker_ignored(rel), f".dockerignore must keep the secrets of {rel} out"
    assert _docker_ignored("airflow_nats_ordered/__pycache__/x.pyc")


def test_nats_node_configs_differ_only_in_their_server_name():
    texts = {node: _nats_config(node)[1] for node in NATS_NODES}
    assert len(texts) == 3, "the cluster has three nodes"

    def settings(text: str) -> list[str]:
        lines = (ln.split("#")[0].rstrip() for ln in text.splitlines())
        return [ln for ln in lines if ln and not ln.startswith("server_name:")]

    for node, text in texts.items():
        assert re.search(rf"^server_name: {node}$", text, re.M), f"{node}: wrong server_name"
        assert settings(text) == settings(texts[NATS_NODES[0]]), f"{node} differs"
        routes = set(re.findall(r"nats-route://([\w-]+):(\d+)", text))
        cluster_port = _port(_nats_addresses(text)["cluster"])
        assert routes == {(n, str(cluster_port)) for n in NATS_NODES}, f"{node}: routes {routes}"


def test_ports_urls_and_timeouts_agree_with_what_each_service_opens():
    for name, svc in SERVICES.items():
        opened = _listening_ports(name)
        for mapping in svc.get("ports", []):
            assert int(mapping.split(":")[-1]) in opened, f"service {name} publishes {mapping}"
        check = (svc.get("healthcheck") or {}).get("test", [])
        for url in (a for a in check if a.startswith("http://")):
            parts = urlsplit(url)
            assert parts.hostname == "127.0.0.1" and parts.port in opened, f"{name}: {url}"
    published = [int(m.split(":")[0]) for s in SERVICES.values() for m in s.get("ports", [])]
    assert len(published) == len(set(published)), "two services publish the same host port"

    def reaches(url: str, where: str) -> None:
        parts = urlsplit(url)
        assert parts.hostname in SERVICES, f"{where}: {url} names no service"
        assert parts.port in _listening_ports(parts.hostname), f"{where}: {url}: closed port"

    nats_urls = set()
    for name, svc in SERVICES.items():
        env = _all_env(svc)
        if "AIRFLOW_CONN_NATS_DEFAULT" in env:
            servers = _nats_conn_options(env["AIRFLOW_CONN_NATS_DEFAULT"]).servers
            nats_urls.add(frozenset(servers))
        if "NATS_URL" in env:
            nats_urls.add(
                frozenset(ConnectionOptions.from_env({"NATS_URL": env["NATS_URL"]}).servers)
            )
        if "AIRFLOW__CORE__EXECUTION_API_SERVER_URL" in env:
            reaches(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"], name)
        if "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" in env:
            db = urlsplit(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
            reaches(db.geturl(), name)
            pg = _all_env(SERVICES[db.hostname])
            assert (db.username, db.path) == (pg["POSTGRES_USER"], f"/{pg['POSTGRES_DB']}")
        if "AIRFLOW_CONN_SPARK_DEFAULT" in env:
            from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

            os.environ["AIRFLOW_CONN_SPARK_DEFAULT"] = env["AIRFLOW_CONN_SPARK_DEFAULT"]
            try:
                spark = SparkSubmitHook(conn_id="spark_default")._resolve_connection()
            finally:
                del os.environ["AIRFLOW_CONN_SPARK_DEFAULT"]
            assert spark["deploy_mode"] == "client"
            reaches(spark["master"].replace("spark://", "http://"), name)
        cmd = svc.get("command", [])
        for arg in cmd:
            if arg.startswith("spark://"):
                reaches(arg.replace("spark://", "http://"), name)
        if cmd[:2] == ["nats-ordered", "pool"]:
            grace = re.fullmatch(r"(\d+)s", svc["stop_grace_period"])
            assert grace and int(grace.group(1)) > float(_flag(cmd, "--stop-timeout")), (
                f"{name}: Docker would SIGKILL the pool before its members left gracefully"
            )
    # every client names the same three nodes, on the port they listen on for clients
    assert len(nats_urls) == 1, f"clients name different NATS servers: {nats_urls}"
    (servers,) = nats_urls
    assert {urlsplit(u).hostname for u in servers} == set(NATS_NODES)
    for url in servers:
        client = _port(_nats_addresses(_nats_config(urlsplit(url).hostname)[1])["client"])
        assert urlsplit(url).port == client, url


def test_every_variable_is_read_by_the_project_airflow_or_the_image():
    from airflow.configuration import conf

    code = "\n".join(
        p.read_text()
        for folder in ("airflow_nats_ordered", "dags", "spark_apps")
        for p in (ROOT / folder).rglob("*.py")
    )
    deprecated = {old[:2] for old in conf.deprecated_options.values()}
    for name, svc in SERVICES.items():
        image_env = next((v for k, v in IMAGE_ENV.items() if svc["image"].startswith(k)), set())
        for var in _all_env(svc):
            if var.startswith("AIRFLOW__"):
                section, key = (p.lower() for p in var.removeprefix("AIRFLOW__").split("__", 1))
                known = conf.configuration_description.get(section, {}).get("options", {})
                assert key in known, f"service {name}: Airflow has no option [{section}] {key}"
                assert (section, key) not in deprecated, f"service {name}: {var} is deprecated"
            elif var.startswith("AIRFLOW_CONN_"):
                continue  # parsed by the hooks in the test above
            elif var in image_env or (_built(svc) and var in PYTHON_ENV):
                continue
            else:
                assert re.search(rf"[\"']{var}[\"']", code), (
                    f"service {name}: nothing in the project reads {var}"
                )


def test_make_env_writes_every_secret_once_and_git_never_sees_them(tmp_path):
    from cryptography.fernet import Fernet

    make_env = [sys.executable, str(ROOT / "deploy" / "make_env.py"), "--dir", str(tmp_path)]
    subprocess.run(make_env, check=True, capture_output=True)
    needed = {f.name for svc in SERVICES.values() for f in _env_files(svc)}
    written = {p.name: p for p in tmp_path.iterdir()}
    assert set(written) == needed
    values = {}
    for file_name, path in written.items():
        assert path.stat().st_mode & 0o777 == 0o600
        env = dict(ln.split("=", 1) for ln in path.read_text().splitlines() if "=" in ln)
        example = _example_env(ROOT / "deploy" / file_name)
        assert set(env) == set(example)
        assert not any("{" in v or "change" in v.lower() for v in env.values()), env.keys()
        values.update(env)
    Fernet(values["AIRFLOW__CORE__FERNET_KEY"].encode())  # raises if not a Fernet key
    db = urlsplit(values["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    assert db.password == values["POSTGRES_PASSWORD"]
    assert len({values[k] for k in values if "SECRET" in k or "KEY" in k}) == 3
    before = {p: p.read_text() for p in written.values()}
    again = subprocess.run(make_env, capture_output=True, text=True)
    assert again.returncode == 1 and "already exist" in again.stderr
    assert {p: p.read_text() for p in written.values()} == before, "secrets were overwritten"
    for file_name in needed:
        rel = f"deploy/{file_name}"
        ignored = subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT)
        assert ignored.returncode == 0, f"{rel} holds secrets: git must ignore it"
        tracked = subprocess.run(["git", "ls-files", rel], cwd=ROOT, capture_output=True, text=True)
        assert tracked.stdout == "", f"{rel} is committed"


# ------------------------------------------------------------------ the real cluster
def _local_config(text: str, store: Path, ports: dict[str, dict[str, int]], node: str) -> str:
    """The node's config with only its listen ports, routes and store moved to this machine."""
    addresses = _nats_addresses(text)
    local = text
    for kind, address in addresses.items():
        local = local.replace(address, f"127.0.0.1:{ports[node][kind]}")
    for peer in NATS_NODES:
        local, n = re.subn(
            rf"nats-route://{peer}:\d+", f"nats-route://127.0.0.1:{ports[peer]['cluster']}", local
        )
        assert n == 1, f"{node}: one route to {peer} expected"
    local, n = re.subn(r"store_dir: \S+", f"store_dir: {json.dumps(str(store))}", local)
    assert n == 1
    return local


def _local_conn(ports: dict[str, dict[str, int]]) -> str:
    """AIRFLOW_CONN_NATS_DEFAULT of the compose with its servers moved to the local nodes."""
    value = json.loads(_env(SERVICES["provision"])["AIRFLOW_CONN_NATS_DEFAULT"])
    servers = value["extra"]["servers"].split(",")
    value["extra"]["servers"] = ",".join(
        f"nats://127.0.0.1:{ports[urlsplit(u).hostname]['client']}" for u in servers
    )
    return json.dumps(value)


async def _replicas(url: str, stream: str, group: str) -> dict[str, tuple[int, int]]:
    """Configured replicas and current peers of the stream and the group's KV buckets."""
    from airflow_nats_ordered.core.group.config import GroupConfig

    cfg = GroupConfig(stream=stream, group=group)
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        out = {}
        for name in (stream, f"KV_{cfg.lease_bucket}", f"KV_{cfg.state_bucket}"):
            info = await js.stream_info(name)
            current = [r for r in (info.cluster.replicas or []) if r.current]
            out[name] = (info.config.num_replicas, 1 + len(current))
        return out
    finally:
        await nc.close()


def _free_port_pair() -> int:
    """A port P with P and P+1 free (the pool serves metrics on P, its member on P+1),
    below the kernel's ephemeral range: a port from ``free_port()`` is one the kernel hands
    out, and P+1 is likely the next one it gives another test's process (seen: the member
    could not listen on P+1 three times and the pool stopped)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise AssertionError("no two consecutive free ports in 20000-32000")


def test_nats_configs_boot_a_cluster_that_takes_the_r3_provision_and_a_healthy_pool(
    tmp_path, monkeypatch
):
    """The three config files (ports and store moved), the provision service's exact
    command, then the worker-pool service's exact command with its environment: the pool
    serves a 200 /healthz, the stream and the group's state are R3 with every peer current,
    and SIGTERM ends the pool with 0 within its --stop-timeout."""
    ports = {n: {k: free_port() for k in ("client", "http", "cluster")} for n in NATS_NODES}
    procs = []
    try:
        for node in NATS_NODES:
            cmd = list(SERVICES[node]["command"])
            path, text = _nats_config(node)
            local = tmp_path / path.name
            local.write_text(_local_config(text, tmp_path / f"{node}-data", ports, node))
            cmd[cmd.index("--config") + 1] = str(local)
            log = (tmp_path / f"{node}.log").open("w")
            procs.append(subprocess.Popen([str(find_nats_server()), *cmd], stderr=log))

        def logs() -> str:
            return "\n".join((tmp_path / f"{n}.log").read_text()[-1500:] for n in NATS_NODES)

        for node in NATS_NODES:
            url = f"http://127.0.0.1:{ports[node]['http']}/healthz"  # the compose healthcheck
            _wait_for(f"{node} healthy", lambda url=url: _get(url)[0] == 200, 20, logs)
        jsz_url = f"http://127.0.0.1:{ports[NATS_NODES[0]]['http']}/jsz"
        metas: list[dict[str, Any]] = []

        def meta_of_three() -> bool:
            # /healthz turns 200 before the meta group has heard of every peer: until then
            # its cluster_size is 2 (seen on a loaded machine), so wait for 3 and a leader
            metas.append(json.loads(_get(jsz_url)[1]).get("meta_cluster", {}))
            return metas[-1].get("cluster_size") == 3 and bool(metas[-1].get("leader"))

        _wait_for("a meta group of 3 with a leader", meta_of_three, 60, lambda: metas[-1:])

        conn = _local_conn(ports)
        monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", conn)
        provision = SERVICES["provision"]["command"]
        assert cli_main(provision[1:]) == 0

        pool = SERVICES["worker-pool"]
        cmd = list(pool["command"])
        metrics = _free_port_pair()
        cmd[cmd.index("--metrics-port") + 1] = str(metrics)
        env = {**os.environ, **_env(pool), "AIRFLOW_CONN_NATS_DEFAULT": conn}
        env["PYTHONPATH"] = str(_project_path(pool, env["PYTHONPATH"]))
        env["AIRCRAFT_TOTALS_DB"] = str(tmp_path / PurePosixPath(env["AIRCRAFT_TOTALS_DB"]).name)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        pool_log = (tmp_path / "pool.log").open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=pool_log, stderr=subprocess.STDOUT)
        procs.append(proc)
        healthz = f"http://127.0.0.1:{metrics}/healthz"  # the compose healthcheck's path
        _wait_for(
            "the pool's /healthz is 200",
            lambda: proc.poll() is None and _get(healthz)[0] == 200,
            120,  # a bound on a hang, not a speed: a loaded CI machine missed 30 s
            lambda: (tmp_path / "pool.log").read_text()[-3000:],
        )
        stream, group = _flag(cmd, "--stream"), _flag(cmd, "--group")
        url = json.loads(conn)["extra"]["servers"]
        seen: list[dict[str, tuple[int, int]]] = []

        def all_r3() -> bool:  # the member creates the group's buckets once it runs
            with contextlib.suppress(nats.errors.Error):
                seen.append(asyncio.run(_replicas(url.split(",")[0], stream, group)))
                return all(r == (3, 3) for r in seen[-1].values())
            return False

        _wait_for("stream and group state R3, every peer current", all_r3, 60, lambda: seen[-1:])

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(float(_flag(cmd, "--stop-timeout"))) == 0, (
            tmp_path / "pool.log"
        ).read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
