"""Host memory for loaded weights: file mappings, huge-page arenas (both in io.mapping, shared with
checkpoint restores), and the staging ring.

* FileMapping (the default for CPU loads of local files): a copy-on-write mapping of the file,
  populated by the kernel with ``MADV_POPULATE_READ`` in large windows from several threads.
* Arena (``mapped=False``, and the memory a remote load lands in): a huge-page anonymous mapping
  populated by ``MADV_POPULATE_WRITE`` window by window, right before the window is read.

Tensors are zero-copy views of either; the mapping lives as long as any of its tensors.
"""

from __future__ import annotations

from tierio.io.buffers import BufferPool, shared_pool
from tierio.io.mapping import HUGE, MADV_HUGEPAGE, MADV_POPULATE_READ, MADV_POPULATE_WRITE, Arena, FileMapping

__all__ = ["HUGE", "MADV_HUGEPAGE", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "STAGING_BUDGET", "Arena",
           "FileMapping", "staging_pool"]

STAGING_BUDGET = 512 << 20  # the GPU / load_into staging ring never exceeds this


def staging_pool(numa_node: int | None = None) -> BufferPool:
    """The process-wide staging ring (pinned when CUDA exists), bounded by STAGING_BUDGET; one per NUMA node asked for."""
    return shared_pool("weights-staging", STAGING_BUDGET, numa_node)
