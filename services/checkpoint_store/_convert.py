"""Protobuf ↔ domain for checkpoints: the only module that knows both shapes."""

from __future__ import annotations

from m27.checkpoint_store._model import CheckpointRecord
from m27.v1 import checkpoint_pb2 as pb


def record_to_proto(record: CheckpointRecord) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        task_id=record.task_id, checkpoint_id=record.checkpoint_id, attempt=record.attempt,
        name=record.name, size_bytes=record.size_bytes, sha256=record.sha256,
        created_at=record.created_at, metadata=record.metadata)


def record_from_proto(info: pb.CheckpointInfo) -> CheckpointRecord:
    return CheckpointRecord(
        task_id=info.task_id, checkpoint_id=info.checkpoint_id, attempt=info.attempt,
        name=info.name, size_bytes=info.size_bytes, sha256=info.sha256,
        created_at=info.created_at, metadata=dict(info.metadata))
