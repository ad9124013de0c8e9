"""Batches from a plain ``torch.utils.data.DataLoader``'s workers without torch's shared-memory hand-off.

A worker of a plain DataLoader collates ``batch_size`` samples with ``default_collate`` into a
tensor born in shared memory, and the loop receives it by file descriptor: a new connection to
the worker for every batch (about 3 ms a batch on a 2-core VM, against ~0.3 ms to make a batch
of 64 samples of 2 KiB). Two workers were then three times slower than none.

Inside a DataLoader worker, :class:`StreamingDataset` therefore hands out its fixed-size fields
as :class:`Row` (a plain ``ndarray`` subclass: any ``collate_fn`` of the user's sees arrays as
before), and registers a collate function for ``Row`` with ``default_collate`` in that worker
process only (the extension point torch documents, ``default_collate_fn_map``). It stacks the rows
with numpy and wraps the result as :class:`WireTensor`, which pickles as its bytes and unpickles
in the loop as ``torch.from_numpy(array)``: the loop gets the same tensor type as without workers,
copied once through the worker's pipe instead of mapped through a descriptor.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Row(np.ndarray):
    """A sample's field in a DataLoader worker; behaves as its ndarray."""


class WireTensor:
    """A collated batch on its way to the loop: becomes ``torch.from_numpy(array)`` when unpickled."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        import torch

        return torch.from_numpy, (self.array,)


def collate_rows(batch: list[Row], *, collate_fn_map: Any = None) -> WireTensor:
    return WireTensor(np.stack([r.view(np.ndarray) for r in batch]))


_registered = False


def rows_in_worker(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with its fixed-size fields viewed as Row, and Row's collation registered in this
    process (call only in a DataLoader worker)."""
    global _registered
    if not _registered:
        from torch.utils.data._utils.collate import default_collate_fn_map

        default_collate_fn_map[Row] = collate_rows
        _registered = True
    return {k: v.view(Row) if isinstance(v, np.ndarray) and v.ndim > 1 and v.dtype.kind in "biuf" else v
            for k, v in batch.items()}
