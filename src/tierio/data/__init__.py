"""Training data: Megatron-compatible token datasets, packing, shards, streaming and loaders."""

import warnings
from typing import Any

from tierio.data.blend import BlendedDataset, SourceUse
from tierio.data.builder import BuildStats, build_indexed, inspect_indexed, iter_input, merge_indexed
from tierio.data.export import export_dataset
from tierio.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from tierio.data.loader import LoaderSettings, StatefulLoader, build_loader, loader_settings, pinned_memory_estimate
from tierio.data.options import LoaderOptions, ShardOptions, StreamingOptions
from tierio.data.packing import (
    PackedDataset, PackPlan, PackStats, block_diagonal_mask, collate_packed, load_plan, plan_packing, save_plan,
)
from tierio.data.shards import ShardManifest, ShardWriter, load_manifest, write_packed_shards
from tierio.data.streaming import StreamingDataset, packed_transform
from tierio.data.window import TokenWindowDataset, collate_windows

__all__ = [
    "BlendedDataset", "SourceUse",
    "BuildStats", "build_indexed", "inspect_indexed", "iter_input", "merge_indexed",
    "IndexedDataset", "IndexedDatasetWriter", "optimal_dtype",
    "LoaderOptions", "LoaderSettings", "StatefulLoader", "build_loader", "loader_settings", "pinned_memory_estimate",
    "PackedDataset", "PackPlan", "PackStats", "block_diagonal_mask", "collate_packed", "load_plan", "plan_packing",
    "save_plan",
    "ShardManifest", "ShardOptions", "ShardWriter", "export_dataset", "load_manifest", "write_packed_shards",
    "StreamingDataset", "StreamingOptions", "packed_transform",
    "TokenWindowDataset", "collate_windows",
]


def __getattr__(name: str) -> Any:
    # ``Manifest`` was renamed: format/ has the checkpoint manifest under that name.
    if name == "Manifest":
        warnings.warn("tierio.data.Manifest is deprecated, use tierio.data.ShardManifest", DeprecationWarning,
                      stacklevel=2)
        return ShardManifest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
