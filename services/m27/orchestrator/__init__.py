"""The orchestrator: pipeline YAML → DAG → durable runs; the public gRPC API.

Pure core: `pipeline` (parsing and validation), `dag` (graph functions), `runs` (the run
state machine). Shell: `store` (KV with compare-and-set and an outbox), `service` (gRPC and
event consumers).
"""
