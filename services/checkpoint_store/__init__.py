"""checkpoint-store: stores and returns checkpoint blobs per task, over gRPC.

`python -m m27.checkpoint_store` runs the service. Other code uses `CheckpointClient`
(async, domain types) or the generated `m27.v1` stub; nothing here is imported by other
services. Storage sits behind `BlobStore` so a chunked/compressed layout can replace the
plain files later.
"""

from m27.checkpoint_store._blobs import BlobStore, FileBlobStore
from m27.checkpoint_store._errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreError,
    CheckpointTooLarge,
    InvalidCheckpointRequest,
    StorageError,
    StorageFull,
    StorageUnavailable,
)
from m27.checkpoint_store._ids import CheckpointRef, is_valid_checkpoint_id
from m27.checkpoint_store._index import KvRecordIndex, MemoryRecordIndex, RecordIndex
from m27.checkpoint_store._model import CheckpointRecord, Header
from m27.checkpoint_store._store import DEFAULT_MAX_BYTES, CheckpointStore
from m27.checkpoint_store.client import CheckpointClient

__all__ = [
    "DEFAULT_MAX_BYTES",
    "BlobStore",
    "CheckpointClient",
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "CheckpointRecord",
    "CheckpointRef",
    "CheckpointStore",
    "CheckpointStoreError",
    "CheckpointTooLarge",
    "FileBlobStore",
    "Header",
    "InvalidCheckpointRequest",
    "KvRecordIndex",
    "MemoryRecordIndex",
    "RecordIndex",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
    "is_valid_checkpoint_id",
]
