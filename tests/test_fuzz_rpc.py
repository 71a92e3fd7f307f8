"""Every RPC of every service fuzzed on a running system (issue 19, point 5): requests built
from the protobuf descriptors (`tests/fuzzing.py`) — malformed, oversized, Unicode and NUL,
unknown and plausible ids, hostile paths, extreme numbers — sent with the strongest
credentials the method allows, a plain user's, and none. Each call ends within its
deadline with a clear status, never UNKNOWN, INTERNAL or DEADLINE_EXCEEDED, and every
service process is alive and SERVING after each RPC's batch.

`M27_FUZZ_EXAMPLES` sets the examples per RPC (40 here; `bench/fuzz.py` runs 10,000+)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m27.common.api_access import METHOD_ROLES
from m27.common.grpc_server import CLIENT_OPTIONS, MAX_MESSAGE_BYTES
from m27.pipeline import load_pipeline
from m27.pipeline.plan import make_plan
from m27.v1 import pipeline_pb2, scheduler_pb2
from tests import fuzzing
from tests.fuzzing import Target
from tests.support import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLES = int(os.environ.get("M27_FUZZ_EXAMPLES", "40"))
QUICK = "pipeline:\n  - {name: a, command: 'true'}\n"


@settings(max_examples=80, deadline=None)
@given(fuzzing.accepted_pipelines())
def test_the_pipelines_meant_to_be_accepted_parse_and_plan(document: str) -> None:
    """Else the run path would be fuzzed in name only: a share of the submissions must get
    past the parser into planning, placement and a run's events."""
    assert make_plan(load_pipeline(document, workdir="/lab/work")).steps


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One system for the module, with one real run, so some fuzzed ids exist."""
    root = tmp_path_factory.mktemp("fuzz")
    cluster = Cluster(root)
    cluster.start()
    target = Target(cluster)
    target.known = fuzzing.seed_run(target, QUICK, root)
    yield target
    target.close()
    cluster.stop()


def test_every_described_rpc_is_served_has_an_access_rule_and_is_fuzzed(
        target: Target) -> None:
    """A new service or RPC in proto/ is fuzzed without being listed anywhere; this fails
    if one is not served, or not in the access table, or the table names one that is gone."""
    described = {fuzzing.path(m) for m in fuzzing.methods()}
    assert set(target.served) == {s.full_name for s in fuzzing.services()}
    assert described == {m for m in METHOD_ROLES if m.startswith("/m27.")}
    fuzzed = {fuzzing.path(m) for m in METHODS}
    assert fuzzed == described
    assert len(described) >= 23


METHODS = fuzzing.methods()


@pytest.mark.parametrize("method", METHODS, ids=fuzzing.path)
def test_fuzzed_calls_end_with_a_clear_status_and_the_services_stay_healthy(
        target: Target, method: descriptor.MethodDescriptor) -> None:
    seen: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        request = data.draw(fuzzing.requests(method, target.known), label="request")
        credentials = data.draw(st.sampled_from(fuzzing.CREDENTIALS), label="credentials")
        outcome = target.call(method, request, credentials)
        seen[outcome.code] = seen.get(outcome.code, 0) + 1
        problem = outcome.violation() or fuzzing.misrouted(method, credentials, outcome)
        assert problem is None, f"{fuzzing.path(method)} as {credentials}: {problem}\n" \
                                f"request: {fuzzing.described(request)}"

    fuzz()
    target.restore()
    assert fuzzing.unhealthy(target.health()) == {}, (seen, target.cluster.logs())
    assert sum(seen.values()) >= 1


def test_an_oversized_request_is_refused_with_resource_exhausted(target: Target) -> None:
    """One byte past the limit, to one unary RPC of every service: RESOURCE_EXHAUSTED from
    the server (and from a client with m27's options, before sending); all stay SERVING."""
    for service in fuzzing.services():
        method, field = fuzzing.oversizable(service)
        request: Any = fuzzing.message_class(method.input_type)(
            **{field: "a" * (MAX_MESSAGE_BYTES + 1)})
        outcome = target.call(method, request, "privileged")
        assert outcome.code == "RESOURCE_EXHAUSTED", (fuzzing.path(method), outcome)
        process = target.served[service.full_name]
        address = target.cluster.processes[process].grpc_address
        with target.cluster.access.sync_channel(address, options=CLIENT_OPTIONS) as channel:
            outcome = fuzzing.call(channel, method, request)
        assert outcome.code == "RESOURCE_EXHAUSTED", (fuzzing.path(method), outcome)
    assert fuzzing.unhealthy(target.health()) == {}


def test_variables_past_the_bus_limit_are_refused_as_invalid_not_unknown(
        target: Target, tmp_path: Path) -> None:
    """10 MB of variables: within gRPC's 16 MiB, past NATS's 8 MB. Used to end UNKNOWN
    (nats' MaxPayloadError from the publish); now refused before parsing the document."""
    submit = fuzzing.services_by_name()["m27.v1.PipelineService"].methods_by_name[
        "SubmitPipeline"]
    request = pipeline_pb2.SubmitPipelineRequest(
        pipeline_yaml=QUICK, workdir=str(tmp_path),
        vars={f"K{i}": "v" * 1000 for i in range(10_000)})
    outcome = target.call(submit, request, "privileged")
    assert outcome.code == "INVALID_ARGUMENT", outcome
    assert "KiB in all, more than 1024 KiB" in outcome.details
    assert fuzzing.unhealthy(target.health()) == {}


def test_a_refusal_about_a_huge_id_reaches_the_caller(target: Target) -> None:
    """SetNodeMaintenance for a 64 KiB node id used to echo it whole: the caller got
    RESOURCE_EXHAUSTED "Stream removed" (its 16 KiB limit on trailers), not NOT_FOUND."""
    maintenance = fuzzing.services_by_name()["m27.v1.SchedulerService"].methods_by_name[
        "SetNodeMaintenance"]
    for field in ("node_id", "action"):
        request: Any = scheduler_pb2.SetNodeMaintenanceRequest(node_id="node-1",
                                                               action="cordon")
        setattr(request, field, "a" * 70_000)
        outcome = target.call(maintenance, request, "privileged")
        assert outcome.code in {"NOT_FOUND", "INVALID_ARGUMENT"}, outcome
        assert len(outcome.details) < 300
    target.restore()


def test_a_huge_maintenance_reason_is_refused(target: Target) -> None:
    """A 3 MiB reason used to be stored in KV with the mark (found by fuzzing)."""
    maintenance = fuzzing.services_by_name()["m27.v1.SchedulerService"].methods_by_name[
        "SetNodeMaintenance"]
    request: Any = scheduler_pb2.SetNodeMaintenanceRequest(node_id="node-1", action="cordon",
                                                           reason="r" * 3_000_000)
    outcome = target.call(maintenance, request, "privileged")
    assert outcome.code == "INVALID_ARGUMENT", outcome
    assert "at most 1000" in outcome.details
    target.restore()


@pytest.mark.parametrize("method", METHODS, ids=fuzzing.path)
def test_bytes_that_are_not_the_request_message_are_invalid_argument(
        target: Target, method: descriptor.MethodDescriptor) -> None:
    """Used to be UNKNOWN ("Unexpected <class DecodeError>") on every server, from gRPC's
    own parsing before any servicer ran (`m27.common.decoding`)."""
    broken = [b"\x00", b"\x0a\x05ab"]  # field 0; a string cut short
    strings = [f.number for f in method.input_type.fields if f.type == f.TYPE_STRING]
    if strings:  # a string that is not UTF-8
        broken.append(bytes([(strings[0] << 3) | 2, 2, 0xFF, 0xFE]))
    for raw in broken:
        request: Any = [raw] if method.client_streaming else raw
        outcome = target.call(method, request, "privileged")
        assert outcome.code == "INVALID_ARGUMENT", (raw, outcome)
        assert "not a valid protobuf message" in outcome.details
