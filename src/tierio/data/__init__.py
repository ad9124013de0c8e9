"""Training data: Megatron-compatible token datasets, packing, shards, streaming and loaders."""

from tierio.data.builder import BuildStats, build_indexed, inspect_indexed, iter_input, merge_indexed
from tierio.data.export import export_dataset
from tierio.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from tierio.data.loader import LoaderSettings, StatefulLoader, build_loader, loader_settings, pinned_memory_estimate
from tierio.data.packing import (
    PackedDataset, PackPlan, PackStats, block_diagonal_mask, collate_packed, load_plan, plan_packing, save_plan,
)
from tierio.data.shards import Manifest, ShardWriter, load_manifest, write_packed_shards
from tierio.data.streaming import StreamingDataset, packed_transform
from tierio.data.window import TokenWindowDataset, collate_windows

__all__ = [
    "BuildStats", "build_indexed", "inspect_indexed", "iter_input", "merge_indexed",
    "IndexedDataset", "IndexedDatasetWriter", "optimal_dtype",
    "LoaderSettings", "StatefulLoader", "build_loader", "loader_settings", "pinned_memory_estimate",
    "PackedDataset", "PackPlan", "PackStats", "block_diagonal_mask", "collate_packed", "load_plan", "plan_packing",
    "save_plan",
    "Manifest", "ShardWriter", "export_dataset", "load_manifest", "write_packed_shards",
    "StreamingDataset", "packed_transform",
    "TokenWindowDataset", "collate_windows",
]
