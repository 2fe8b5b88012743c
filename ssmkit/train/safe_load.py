"""Reading torch.distributed.checkpoint (DCP) state without running code: never unpickle what a
user could hand us.

DCP stores its ``.metadata`` as a pickle and an optimizer's non-tensor entries (lr, betas, ...) as
``torch.save`` blobs. :class:`SafeReader` reads the metadata with an unpickler that accepts only
DCP's own record types, torch dtypes and sizes; :class:`SafePlanner` loads each non-tensor entry
with ``torch.load(weights_only=True)`` first. Anything else is :class:`CheckpointCorrupt`, refused
before it runs. Used as ``dcp.load(state, storage_reader=SafeReader(dir), planner=SafePlanner())``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from .manifest import CheckpointCorrupt

# module -> the names DCP's metadata may refer to (its record types and what they hold)
DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "BytesStorageMetadata",
        "StorageMeta",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its own record types, torch dtypes and sizes, nothing else."""

    def find_class(self, module, name):
        if name in DCP_TYPES.get(module, ()) or (
            module == "torch"
            and (
                name == "Size"
                or isinstance(
                    getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
                )
            )
        ):
            return super().find_class(module, name)
        raise CheckpointCorrupt(
            f"the checkpoint's DCP metadata refers to {module}.{name}, which "
            "is not one of torch.distributed.checkpoint's record types: "
            "refusing to load it"
        )


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, its metadata read with :class:`MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, but a non-tensor entry (an optimizer hyper-parameter) must first load with
    ``torch.load(weights_only=True)``: plain values only, never an arbitrary pickle."""

    def load_bytes(self, read_item, value):
        try:
            torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointCorrupt(
                f"the checkpoint entry {read_item.dest_index.fqn} is not a "
                f"plain value ({type(exc).__name__}): refusing to unpickle it"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)
