"""Fuzzing every RPC (issue 19, point 5): requests built field by field from the protobuf
descriptors of `m27.v1`, so a new RPC or field is fuzzed without anyone listing it, and
the checks a fuzzed call must pass. `tests/test_fuzz_rpc.py` runs a bounded share in CI,
`bench/fuzz.py` the ten thousands."""

from __future__ import annotations

import importlib
import json
import math
import os
import pkgutil
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import grpc
import msgspec
from google.protobuf import descriptor, message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import strategies as st

import m27.v1
from m27.common.api_access import METHOD_ROLES
from m27.common.grpc_server import MAX_MESSAGE_BYTES
from m27.v1 import pipeline_pb2, pipeline_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support import Cluster

Field = descriptor.FieldDescriptor
Code = grpc.StatusCode

#: What a fuzzed call may end with: an answer, or a refusal that names the problem.
#: Never UNKNOWN or INTERNAL (a handler raised), DEADLINE_EXCEEDED (it hung), UNAVAILABLE
#: (the server went away) or UNIMPLEMENTED (every described RPC has a handler).
ALLOWED: Final = frozenset({
    Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS,
    Code.FAILED_PRECONDITION, Code.PERMISSION_DENIED, Code.UNAUTHENTICATED,
    Code.RESOURCE_EXHAUSTED, Code.OUT_OF_RANGE, Code.ABORTED})
#: A stream that asks to follow (or watches) and is still open after this long is
#: answering: it is cancelled, and counted as OPEN.
OPEN_BUDGET_S: Final = 0.5
#: Every call ends (or, following, is open) within this.
CALL_DEADLINE_S: Final = 10.0
OPEN: Final = "OPEN"
#: Credentials a fuzzed call carries: the strongest role its method allows (so the
#: request reaches the handler), a plain user's, or none.
CREDENTIALS: Final = ("privileged", "user", "none")
#: The fuzz channels take answers as large as a server may send, and send whatever the
#: request is, so an oversized one reaches the server (a real client refuses it itself).
CHANNEL_OPTIONS: Final = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                          ("grpc.max_send_message_length", -1)]

HOSTILE: Final = (
    "", " ", "\x00", "a\x00b", "../../etc/passwd", "/etc/passwd", "/", "..", ".", "~",
    "/dev/zero", "/proc/self/environ", "C:\\Windows\\system32", "%2e%2e%2f", "*", ">",
    "$(id)", "`id`", "; rm -rf /", "{{ENV}}", "${HOME}", "\n", "\r\n", "\t", "\ufeff",
    "\u202e", "\U0001f600", "é", "null", "NaN", "-1", "0", "1e309", "9" * 40,
    "a" * 101, "m27.>", "m27.*", "r-20261201-081500-a1b2c3/../../x", "node-1/../..")


def services() -> list[descriptor.ServiceDescriptor]:
    """Every gRPC service of m27, from its generated modules (whatever the files are)."""
    found = []
    for module in pkgutil.iter_modules(m27.v1.__path__):
        if module.name.endswith("_pb2"):
            file = importlib.import_module(f"m27.v1.{module.name}").DESCRIPTOR
            found.extend(file.services_by_name.values())
    return sorted(found, key=lambda s: s.full_name)


def methods() -> list[descriptor.MethodDescriptor]:
    return [m for s in services() for m in s.methods]


def path(method: descriptor.MethodDescriptor) -> str:
    """The RPC's wire name, `/m27.v1.Service/Method`."""
    return f"/{method.containing_service.full_name}/{method.name}"


def message_class(message: descriptor.Descriptor) -> Any:
    """The generated class of `message` (Any: its fields are known only at run time)."""
    return message_factory.GetMessageClass(message)


# ---------------------------------------------------------------- values, field by field

def rarely(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any],
           one_in: int = 16) -> st.SearchStrategy[Any]:
    """`rare` about once in `one_in` draws (huge values, which cost seconds each)."""
    return st.integers(0, one_in - 1).flatmap(lambda r: rare if r == one_in - 1 else common)


def _texts() -> st.SearchStrategy[str]:
    return st.text(st.characters(codec="utf-8"), max_size=40)


def _huge() -> st.SearchStrategy[str]:
    """Long strings: past every field limit m27 has (1 MiB documents, 64 KiB values)."""
    return st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "\x00", "/", "{"]),
                     st.sampled_from([1024, 65 * 1024, 1024 * 1024 + 1, 3 * 1024 * 1024]))


def id_like(known: Sequence[str]) -> st.SearchStrategy[str]:
    """Ids of the forms m27 uses, that exist (`known`) or look as if they might."""
    run_id = st.from_regex(r"\Ar-20[0-9]{6}-[0-9]{6}-[0-9a-f]{6}\Z")
    name = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,20}\Z")
    options = [run_id, st.builds(lambda r, n: f"{r}/{n}", run_id, name), name,
               st.from_regex(r"\Ac-[0-9]{13}-[0-9]{6}\Z"),
               st.from_regex(r"\A[0-9a-f]{64}\Z"), st.sampled_from(["node-1", "node-999"])]
    if known:
        options.insert(0, st.sampled_from(list(known)))
    return st.one_of(options)


def pipelines() -> st.SearchStrategy[str]:
    """Pipeline documents with hostile values in the right places; every command is `true`."""
    scalar = st.one_of(st.sampled_from(HOSTILE), _texts(), st.integers(-2**70, 2**70),
                       st.floats(), st.booleans(), st.none())
    step = st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(["a", "b", "train"]), st.sampled_from(HOSTILE))},
        optional={"command": st.just("true"),
                  "depends_on": st.lists(st.sampled_from(["a", "b", "x", "../a"]), max_size=3),
                  "gpus": scalar, "cpus": scalar, "timeout": scalar, "retries": scalar,
                  "workdir": st.sampled_from(HOSTILE), "inputs": st.lists(
                      st.sampled_from(HOSTILE), max_size=3),
                  "outputs": st.lists(st.sampled_from(HOSTILE), max_size=3),
                  "matrix": st.dictionaries(st.sampled_from(["x", "y", ""]), st.lists(
                      scalar, max_size=4), max_size=2),
                  "env": st.dictionaries(st.sampled_from(["A", "B", "", "\x00"]), scalar,
                                         max_size=2)})
    document = st.fixed_dictionaries({"pipeline": st.lists(step, min_size=1, max_size=4)},
                                     optional={"vars": st.dictionaries(
                                         st.sampled_from(["X", "Y", "bad-name"]), scalar),
                                               "name": scalar, "priority": scalar})
    as_json = document.map(lambda d: json.dumps(d, default=str))
    return st.one_of(as_json, st.just("pipeline:\n  - {name: a, command: 'true'}\n"),
                     st.sampled_from([
                         "pipeline: " + "[" * 3000 + "]" * 3000,
                         "a: &a [x, x]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\n"
                         "d: &d [*c, *c, *c, *c]\npipeline: [*d, *d, *d, *d]\n",
                         "pipeline:\n  - name: t\n    matrix: {a: [" + ",".join(
                             str(i) for i in range(5000)) + "]}\n    command: 'true'\n",
                         "%YAML 1.1\n---\n!!python/object:os.system ['id']\n"]))


def accepted_pipelines() -> st.SearchStrategy[str]:
    """Pipelines m27 should take and run: legal names and dependencies, `true` commands,
    but odd legal values (Unicode and shell metacharacters in variables and environment
    values, small matrices), so fuzzed runs go past the parser into planning, placement
    and their events, not only into refusals."""
    legal = st.one_of(st.sampled_from([h for h in HOSTILE if "\x00" not in h]), st.text(
        st.characters(codec="utf-8", exclude_categories=("Cc", "Cs")), max_size=40)
    ).filter(lambda text: "{{" not in text)  # a placeholder names a variable: not "odd"
    names = st.lists(st.from_regex(r"\A[a-z][a-z0-9_-]{0,15}\Z"), min_size=1, max_size=4,
                     unique=True)
    matrix = st.dictionaries(st.sampled_from(["x", "seed"]), st.lists(
        st.one_of(st.integers(-5, 5), st.from_regex(r"\A[a-z0-9.]{1,6}\Z")), min_size=1,
        max_size=3, unique_by=str), max_size=1)

    def document(names: list[str], env: dict[str, str], variables: dict[str, str],
                 grid: dict[str, list[object]], chain: bool) -> str:
        steps: list[dict[str, object]] = []
        for index, name in enumerate(names):
            step: dict[str, object] = {"name": name, "command": "true", "env": env}
            if chain and index:
                step["depends_on"] = [names[index - 1]]
            if grid and index == 0:
                step["matrix"] = grid
            steps.append(step)
        return json.dumps({"vars": variables, "pipeline": steps}, ensure_ascii=False)

    return st.builds(document, names,
                     st.dictionaries(st.sampled_from(["A", "LAB_NOTE", "x_1"]), legal,
                                     max_size=2),
                     st.dictionaries(st.sampled_from(["X", "note"]), legal, max_size=2),
                     matrix, st.booleans())


def strings(field: Field, known: Sequence[str], depth: int) -> st.SearchStrategy[str]:
    """A string field's values: ids (known and plausible), paths and control characters,
    any Unicode, and (rarely, as a top-level field) sizes past every limit."""
    options: list[st.SearchStrategy[str]] = [
        id_like(known), st.sampled_from(HOSTILE), _texts()]
    if field.name.endswith("_yaml"):
        options[:0] = [accepted_pipelines(), pipelines()]
    if field.name.endswith("_json"):
        options.insert(0, st.recursive(
            st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                      st.sampled_from(HOSTILE)),
            lambda inner: st.one_of(st.lists(inner, max_size=4),
                                    st.dictionaries(st.sampled_from(
                                        ["checkpoint_id", "entries", "task_id", "name",
                                         "chunks", "step", "metadata", "x"]), inner,
                                        max_size=5)),
            max_leaves=20).map(lambda v: json.dumps(v, default=str)))
    if not field.is_repeated and depth == 0:
        return rarely(st.one_of(options), _huge())
    return st.one_of(options)


_INT_RANGES: Final = {
    Field.TYPE_INT32: (-2**31, 2**31 - 1), Field.TYPE_SINT32: (-2**31, 2**31 - 1),
    Field.TYPE_SFIXED32: (-2**31, 2**31 - 1), Field.TYPE_UINT32: (0, 2**32 - 1),
    Field.TYPE_FIXED32: (0, 2**32 - 1), Field.TYPE_INT64: (-2**63, 2**63 - 1),
    Field.TYPE_SINT64: (-2**63, 2**63 - 1), Field.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    Field.TYPE_UINT64: (0, 2**64 - 1), Field.TYPE_FIXED64: (0, 2**64 - 1)}


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({low, high, 0, 1, -1, 2, 7, 2**31 - 1, 2**53 + 1, 2**63 - 1} & set(
        range(low, high + 1)) if high - low < 10 else {
        v for v in (low, high, 0, 1, -1, 2, 7, 2**31 - 1, 2**53 + 1, 2**63 - 1)
        if low <= v <= high})
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def scalar(field: Field, known: Sequence[str], depth: int) -> st.SearchStrategy[Any]:
    """One value of a non-message field."""
    kind = field.type
    if kind == Field.TYPE_STRING:
        return strings(field, known, depth)
    if kind == Field.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.builds(
            lambda n: os.urandom(n), st.sampled_from([0, 1, 4096, 1 << 20])))
    if kind == Field.TYPE_BOOL:
        return st.booleans()
    if kind in (Field.TYPE_DOUBLE, Field.TYPE_FLOAT):
        wide = kind == Field.TYPE_DOUBLE
        return st.one_of(st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf,
                                          1e308 if wide else 3e38, 5e-324 if wide else 0.0]),
                         st.floats(width=64 if wide else 32))
    if kind == Field.TYPE_ENUM:
        assert field.enum_type is not None
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), integers(-2**31, 2**31 - 1))
    low, high = _INT_RANGES[kind]
    return integers(low, high)


def value(field: Field, known: Sequence[str], depth: int) -> st.SearchStrategy[Any]:
    """A field's value: a scalar, a message, a list (empty, short or long) or a map."""
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        key, val = entry.fields_by_name["key"], entry.fields_by_name["value"]
        # and many long entries: 10 MB of them passes gRPC's limit but not NATS's
        return rarely(st.dictionaries(single(key, known, depth + 1),
                                      single(val, known, depth + 1),
                                      max_size=8), st.builds(
            lambda n: {f"K{i}": "v" * 1000 for i in range(n)}, st.sampled_from([2000, 10_000])))
    one = single(field, known, depth)
    if not field.is_repeated:
        return one
    return rarely(st.lists(one, max_size=5), st.builds(
        lambda n, v: [v] * n, st.sampled_from([1000, 100_000]), one))


def single(field: Field, known: Sequence[str], depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None:
        return messages(field.message_type, known, depth + 1)
    return scalar(field, known, depth)


def messages(message: descriptor.Descriptor, known: Sequence[str] = (),
             depth: int = 0) -> st.SearchStrategy[Message]:
    """Requests of type `message`, any subset of fields set (one field of each oneof at
    most), nested messages to a depth of 3."""
    cls = message_class(message)
    if depth > 3:
        return st.just(cls())
    in_oneof = {f.name for o in message.oneofs for f in o.fields}
    free = {f.name: st.none() | value(f, known, depth)
            for f in message.fields if f.name not in in_oneof}

    def member(field: Field | None) -> st.SearchStrategy[dict[str, Any]]:
        if field is None:
            return st.just({})
        return value(field, known, depth).map(lambda v: {field.name: v})

    oneofs = [st.sampled_from([None, *o.fields]).flatmap(member) for o in message.oneofs]

    def build(values: dict[str, Any], chosen: Sequence[dict[str, Any]]) -> Message:
        fields = {k: v for k, v in values.items() if v is not None}
        for part in chosen:
            fields.update(part)
        made: Message = cls(**fields)
        return made

    return st.builds(build, st.fixed_dictionaries(free), st.tuples(*oneofs))


def malformed(message: descriptor.Descriptor) -> st.SearchStrategy[bytes]:
    """Bytes no protobuf library would send as `message`: random, cut short, or a string
    field holding invalid UTF-8 (proto3 strings must be UTF-8)."""
    strings_ = [f.number for f in message.fields if f.type == Field.TYPE_STRING
                and f.number < 16]
    invalid = [bytes([(n << 3) | 2, 2, 0xFF, 0xFE]) for n in strings_]
    options = [st.binary(max_size=200), messages(message).map(
        lambda m: m.SerializeToString()[:-1] + b"\x80")]
    if invalid:
        options.append(st.sampled_from(invalid))
    return st.one_of(options)


def requests(method: descriptor.MethodDescriptor,
             known: Sequence[str] = ()) -> st.SearchStrategy[Any]:
    """What one call of `method` sends: a message, or for a client stream a list of them."""
    one = rarely(messages(method.input_type, known), malformed(method.input_type), 8)
    if method.client_streaming:
        return st.lists(one, max_size=6)
    return one


# ---------------------------------------------------------------- calls and their checks

class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a call ended: a status name (or OPEN), its details, seconds taken, answers read."""

    code: str
    details: str = ""
    seconds: float = 0.0
    answers: int = 0

    def violation(self) -> str | None:
        """Why this outcome breaks the contract, or None."""
        if "metadata size exceeds" in self.details:
            return f"the status message did not fit in the trailers: {self.details[:200]}"
        if self.code == OPEN or self.code in {c.name for c in ALLOWED}:
            if self.seconds > CALL_DEADLINE_S + 2:
                return f"took {self.seconds:.1f} s"
            return None
        return f"{self.code}: {self.details[:300]}"


def follows(method: descriptor.MethodDescriptor, request: Any) -> bool:
    """Whether a server stream may rightly stay open: it was asked to `follow`, or the RPC
    watches (`Watch…`, until what it watches ends)."""
    if not method.server_streaming or isinstance(request, bytes):
        return False
    if "follow" in method.input_type.fields_by_name:
        return bool(request.follow)
    return method.name.startswith("Watch")


def call(channel: grpc.Channel, method: descriptor.MethodDescriptor, request: Any,
         timeout: float = CALL_DEADLINE_S) -> Outcome:
    """Make the call over `channel` and say how it ended."""
    out = message_class(method.output_type)
    def serialize(message: Message | bytes) -> bytes:
        return message if isinstance(message, bytes) else message.SerializeToString()

    parse = out.FromString
    began = time.monotonic()
    answers = 0
    timer: threading.Timer | None = None
    stopped = threading.Event()
    try:
        if method.server_streaming:
            stream = channel.unary_stream(path(method), serialize, parse)(request,
                                                                          timeout=timeout)
            if follows(method, request):
                def stop() -> None:
                    stopped.set()
                    stream.cancel()  # type: ignore[no-untyped-call]
                timer = threading.Timer(OPEN_BUDGET_S, stop)
                timer.start()
            for _ in stream:
                answers += 1
        elif method.client_streaming:
            channel.stream_unary(path(method), serialize, parse)(iter(request), timeout=timeout)
        else:
            channel.unary_unary(path(method), serialize, parse)(request, timeout=timeout)
    except grpc.RpcError as error:
        code: grpc.StatusCode = error.code()
        details: str = error.details() or ""
        if code == Code.CANCELLED and stopped.is_set():
            return Outcome(code=OPEN, seconds=time.monotonic() - began, answers=answers)
        return Outcome(code=code.name, details=details, seconds=time.monotonic() - began,
                       answers=answers)
    finally:
        if timer is not None:
            timer.cancel()
    return Outcome(code="OK", seconds=time.monotonic() - began, answers=answers)


def privileged_role(method: descriptor.MethodDescriptor) -> str:
    """The role whose token takes a call of `method` to its handler: admin where it may."""
    roles = METHOD_ROLES[path(method)]
    return "admin" if "admin" in roles else sorted(roles)[0]


class Target:
    """A running system as the fuzzer sees it: which process serves each service, and a
    channel per (process, credentials)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._channels: dict[tuple[str, str], grpc.Channel] = {}
        self.served = self._discover()
        #: Ids that exist in this system (`seed_run`), drawn among the plausible ones.
        self.known: list[str] = []

    def _discover(self) -> dict[str, str]:
        """service full name → process name, from each server's reflection (a node-agent
        takes node tokens only)."""
        served: dict[str, str] = {}
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        for name, proc in self.cluster.processes.items():
            if not proc.grpc_address:
                continue
            for role in ("admin", "node"):
                stub = reflection_pb2_grpc.ServerReflectionStub(self.channel(name, role))
                try:
                    answers = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
                except grpc.RpcError as error:
                    if error.code() == Code.UNAUTHENTICATED:
                        continue
                    raise
                for answer in answers:
                    for service in answer.list_services_response.service:
                        if service.name.startswith("m27."):
                            served.setdefault(service.name, name)
                break
        return served

    def channel(self, process: str, credentials: str) -> grpc.Channel:
        key = (process, credentials)
        if key not in self._channels:
            address = self.cluster.processes[process].grpc_address
            if credentials == "none":
                made = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            else:
                role = "admin" if credentials == "privileged" else credentials
                access = (self.cluster.access if role == "admin"
                          else self.cluster.access_as(f"fuzz-{role}", role))  # type: ignore[arg-type]
                made = access.sync_channel(address, options=CHANNEL_OPTIONS)
            self._channels[key] = made
        return self._channels[key]

    def call(self, method: descriptor.MethodDescriptor, request: Any,
             credentials: str) -> Outcome:
        process = self.served[method.containing_service.full_name]
        if credentials == "privileged":
            credentials = privileged_role(method)
        return call(self.channel(process, credentials), method, request)

    def health(self) -> dict[str, str]:
        """Each service process: SERVING, or why not (dead, not answering)."""
        found = {}
        for name, proc in self.cluster.processes.items():
            if not alive(proc.pid):
                found[name] = "dead"
                continue
            try:
                answer = health_pb2_grpc.HealthStub(self.channel(name, "none")).Check(
                    health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.RpcError as error:
                found[name] = f"health check: {error.code().name}"
                continue
            found[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        return found

    def restore(self) -> None:
        """Undo what fuzzed admin calls may have done that would starve later checks: every
        node back in service (a fuzzed `SetNodeMaintenance` drains and cordons)."""
        stub = scheduler_pb2_grpc.SchedulerServiceStub(
            self.channel(self.served["m27.v1.SchedulerService"], "admin"))
        for node in self.nodes():
            stub.SetNodeMaintenance(scheduler_pb2.SetNodeMaintenanceRequest(
                node_id=node, action="uncordon"), timeout=CALL_DEADLINE_S)

    def nodes(self) -> list[str]:
        """The node ids of the system's node-agents."""
        return [f"node-{name.rsplit('-', 1)[1]}" for name in self.cluster.processes
                if name.startswith("node-agent-")]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def misrouted(method: descriptor.MethodDescriptor, credentials: str,
              outcome: Outcome) -> str | None:
    """Why the status does not fit the credentials: none must be UNAUTHENTICATED, a user's
    on a method users may not call PERMISSION_DENIED (or UNAUTHENTICATED, from a server
    that takes no user tokens at all: a node-agent) — whatever the request was."""
    if credentials == "none" and outcome.code != "UNAUTHENTICATED":
        return f"no token, yet {outcome.code}"
    if credentials == "user" and "user" not in METHOD_ROLES[path(method)] and \
            outcome.code not in {"PERMISSION_DENIED", "UNAUTHENTICATED"}:
        return f"a user's token on a method users may not call, yet {outcome.code}"
    return None


def oversizable(service: descriptor.ServiceDescriptor) -> tuple[descriptor.MethodDescriptor, str]:
    """A method of `service` with a single request, and a string field of it."""
    for method in service.methods:
        if method.client_streaming:
            continue
        for field in method.input_type.fields:
            if field.type == Field.TYPE_STRING and not field.is_repeated:
                return method, field.name
    raise AssertionError(f"{service.full_name} has no method taking a string")


def seed_run(target: Target, pipeline_yaml: str, workdir: Path) -> list[str]:
    """Submit a run and wait for its end; its ids and the nodes', for the fuzzer to use."""
    stub = pipeline_pb2_grpc.PipelineServiceStub(
        target.channel(target.served["m27.v1.PipelineService"], "admin"))
    run_id = stub.SubmitPipeline(pipeline_pb2.SubmitPipelineRequest(
        pipeline_yaml=pipeline_yaml, workdir=str(workdir)), timeout=30).run_id
    deadline = time.monotonic() + 90
    run = stub.GetRun(pipeline_pb2.GetRunRequest(run_id=run_id), timeout=30)
    while run.ended_at == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        run = stub.GetRun(pipeline_pb2.GetRunRequest(run_id=run_id), timeout=30)
    return [run_id, *(f"{run_id}/{step.name}" for step in run.steps), *target.nodes()]


def services_by_name() -> dict[str, descriptor.ServiceDescriptor]:
    return {s.full_name: s for s in services()}


def alive(pid: int) -> bool:
    """The process runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in {"Z", "X"}
    except OSError:
        return False


def unhealthy(health: Mapping[str, str]) -> dict[str, str]:
    return {name: state for name, state in health.items() if state != "SERVING"}


def described(request: Any, limit: int = 400) -> str:
    """A request, short enough to print: long strings and lists cut."""
    if isinstance(request, bytes):
        text = f"bytes {request[:limit]!r}"
    elif isinstance(request, list):
        text = f"[{', '.join(described(part, limit) for part in request)}]"
    else:
        text = f"{type(request).__name__}({str(request).strip().replace(chr(10), ' ')})"
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"
