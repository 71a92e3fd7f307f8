"""Is an m27 service (or nats-server) healthy? For container health checks and probes.

    health.py [HOST:PORT]   grpc.health.v1 Check of the whole server (service ""): exit 0
                            when it answers SERVING, which m27 services do once NATS is
                            connected, the topology exists and they registered (ready)
    health.py --live [HOST:PORT]
                            the same for service "m27.live": SERVING while the process
                            runs and its server answers, ready or not (liveness: a
                            scheduler standby is alive but never ready until it acts)
    health.py http://...    exit 0 when the URL answers 200 (nats-server's /healthz)

The address defaults to $M27_GRPC_ADDRESS, the one the service was given with --grpc.
With $M27_API_TLS_CA set the check speaks TLS as every m27 client does ([api] tls_ca,
client_cert, client_key as M27_API_* variables), checking the certificate against
$M27_HEALTH_TLS_NAME when set (a server bound to its pod IP has a certificate that names
its service); without it, gRPC local credentials, which reach loopback only. A health
check needs no token. Kubernetes' own `grpc:` probe cannot do TLS by default, hence this.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LIVE_SERVICE = "m27.live"  # m27.common.grpc_server.LIVE_SERVICE (no m27 import: a probe)
TIMEOUT_S = float(os.environ.get("M27_HEALTH_TIMEOUT", "4"))


def _credentials() -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    ca = os.environ.get("M27_API_TLS_CA", "")
    if not ca:
        return grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP), []
    cert = os.environ.get("M27_API_CLIENT_CERT", "")
    key = os.environ.get("M27_API_CLIENT_KEY", "")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None)
    name = os.environ.get("M27_HEALTH_TLS_NAME", "")
    return credentials, [("grpc.ssl_target_name_override", name)] if name else []


def check_grpc(address: str, service: str = "") -> str:
    """"" when the server at `address` is SERVING, else what it is or why not."""
    credentials, options = _credentials()
    with grpc.secure_channel(address, credentials, options=options) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            call = cast("grpc.Call", exc)  # what a blocking call raises is its Call too
            return f"{call.code().name}: {call.details()}"
    status = int(answer.status)
    if status != health_pb2.HealthCheckResponse.SERVING:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    return ""


def check_http(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(exc)
    return "" if status == 200 else f"HTTP {status}"


def main(argv: list[str]) -> int:
    live = "--live" in argv[1:]
    args = [a for a in argv[1:] if a != "--live"]
    target = args[0] if args else os.environ.get("M27_GRPC_ADDRESS", "")
    if not target:
        print("health: give HOST:PORT or a URL (or set M27_GRPC_ADDRESS)", file=sys.stderr)
        return 2
    try:
        problem = (check_http(target) if target.startswith(("http://", "https://"))
                   else check_grpc(target, LIVE_SERVICE if live else ""))
    except OSError as exc:  # a TLS file that cannot be read
        problem = str(exc)
    if problem:
        print(f"health: {target}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
