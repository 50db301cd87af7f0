"""Reading a DCP directory without running anything it holds.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``, and its
``DefaultLoadPlanner`` loads every non-tensor item (an optimizer's param_groups, say) with
``torch.load(weights_only=False)``. A checkpoint directory is only as trusted as whoever last
wrote to it, and its manifest holds checksums, not signatures: anyone can recompute them. So here
``.metadata`` goes through an unpickler that admits only what DCP itself writes there (its
metadata dataclasses, ``torch.Size``, dtypes, layouts, memory formats and paths), and non-tensor
items load with ``weights_only=True``, as DCP already loads tensors. Anything else is refused
before it is built: no ``__reduce__`` of a foreign class ever runs.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import (
    FileSystemReader,
    filesystem as dcp_filesystem,
    metadata as dcp_metadata,
)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

_DCP_CLASSES = ("ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
                "BytesStorageMetadata", "StorageMeta", "Metadata", "MetadataIndex",
                "_MEM_FORMAT_ENCODING")
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
       for n in _DCP_CLASSES if hasattr(dcp_metadata, n)},
    # where each item lies in the .distcp files: DCP's own record type
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # storage_meta.checkpoint_id: only a name
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeMetadata(pickle.UnpicklingError):
    """``.metadata`` names something DCP never writes there."""


class UnsafeItem(pickle.UnpicklingError):
    """A non-tensor item in the shards is a pickle that ``weights_only`` refuses."""


def refused_item(error: BaseException) -> str | None:
    """The item an ``UnsafeItem`` named, from DCP's CheckpointException (which collects each
    rank's exception in ``failures``), or None."""
    for failure in getattr(error, "failures", {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UnsafeItem):
            return str(exc)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)  # torch.float32 and the like: values, not callables
        raise UnsafeMetadata(f"{module}.{name}")

    def persistent_load(self, pid):
        raise UnsafeMetadata(f"a persistent id {pid!r}")


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The ``.metadata`` of a DCP directory, unpickled through the allow-list above. Raises
    UnsafeMetadata (naming what it refused), or another UnpicklingError for damaged bytes."""
    with open(Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeMetadata(f"a {type(metadata).__name__} instead of DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read cannot run code."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank files: ironloop has none
            raise FileNotFoundError("no per-rank metadata in an ironloop checkpoint")
        metadata = read_metadata(Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeItem(read_item.dest_index.fqn) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
