"""The orchestrator's shell: wires the API, the event consumers and the engine together.

Decisions live in `m27.pipeline` (parsing) and `runs` (the state machine); `store` keeps
runs in KV with an outbox, `engine` adds the follow-ups (cache), `api` is the gRPC edge.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from m27.common import api_access, subjects
from m27.common import bus as bus_module
from m27.common.api_auth import service_access
from m27.common.service import ServiceRuntime
from m27.orchestrator import cluster_api
from m27.orchestrator.api import SERVICE_NAME, PipelineServicer
from m27.orchestrator.caching import Cache
from m27.orchestrator.engine import Engine
from m27.orchestrator.handlers import EventHandlers
from m27.orchestrator.store import RunStore
from m27.v1 import pipeline_pb2_grpc as pb_grpc


async def serve(rt: ServiceRuntime) -> None:
    bus = await rt.connect()
    engine = Engine(RunStore(bus), Cache(bus))
    servicer = PipelineServicer(engine, rt.config.scheduler.gpu_light_share,
                                api_access.levels(rt.config))
    cluster = cluster_api.ClusterServicer(engine.store,
                                          node_timeout=rt.config.scheduler.node_timeout,
                                          home=rt.home,
                                          agents=service_access(rt.api_keys, rt.config.api,
                                                                user="orchestrator",
                                                                role="node"))
    await rt.serve_grpc([lambda server: pb_grpc.add_PipelineServiceServicer_to_server(
        servicer, server), cluster.register], [SERVICE_NAME, cluster_api.SERVICE_NAME])
    await engine.recover()

    async def on_secrets_request(msg: Msg) -> None:
        await engine.secrets.on_request(engine.store, msg)

    secret_requests = await bus.nc.subscribe(subjects.SECRETS_REQUEST, queue="orchestrator",
                                             cb=on_secrets_request)
    handlers = EventHandlers(engine)
    rt.spawn(bus_module.consume(
        bus.js, stream=subjects.EVENTS_STREAM, durable=subjects.ORCHESTRATOR_TASK_EVENTS,
        filter_subject=subjects.TASK_EVENTS_ALL, handle=handlers.on_task_event,
        stop=rt.stop), "task-events")
    rt.spawn(bus_module.consume(
        bus.js, stream=subjects.EVENTS_STREAM, durable=subjects.ORCHESTRATOR_REPORTS,
        filter_subject=subjects.RUN_REPORT_ALL, handle=handlers.on_report, stop=rt.stop),
        "reports")
    rt.spawn(engine.store.flush_loop(rt.stop), "unpublished outboxes")
    await rt.ready()
    await rt.stop.wait()
    await secret_requests.unsubscribe()
