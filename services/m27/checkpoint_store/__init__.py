"""checkpoint-store: checkpoints of tasks as content-addressed chunks plus manifests, over gRPC.

`python -m m27.checkpoint_store` runs the service. Other code reaches it through
`m27.client.checkpoints` (`RemoteStore`, sync, a `CheckpointSink` for the training library
and the node-agent; `CheckpointClient`, async) with the contract in
`m27.common.checkpoint_api`; nothing here is imported by other services.
Chunks live in a directory (`ChunkStore`, local disk or NAS/Lustre), manifests in NATS KV
(`KvManifestIndex`); the decisions (manifest validation, retention, mark/sweep) are pure.
"""

from m27.checkpoint_store._chunks import ChunkStore
from m27.checkpoint_store._ids import CheckpointRef, is_valid_checkpoint_id
from m27.checkpoint_store._index import KvManifestIndex, ManifestIndex, MemoryManifestIndex
from m27.checkpoint_store._manifests import decode_manifest
from m27.checkpoint_store._retention import (
    RetentionDecision,
    RetentionPolicy,
    SweepDecision,
    choose_retained,
    mark,
    sweep,
)
from m27.checkpoint_store._store import DEFAULT_MAX_BYTES, CheckpointStore

__all__ = [
    "DEFAULT_MAX_BYTES",
    "CheckpointRef",
    "CheckpointStore",
    "ChunkStore",
    "KvManifestIndex",
    "ManifestIndex",
    "MemoryManifestIndex",
    "RetentionDecision",
    "RetentionPolicy",
    "SweepDecision",
    "choose_retained",
    "decode_manifest",
    "is_valid_checkpoint_id",
    "mark",
    "sweep",
]
