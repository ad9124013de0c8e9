"""How a weight load runs: the knobs of :func:`tierio.weights.load` and :func:`load_into`, one
``tierio.options.Options`` record (what the call is about — source, device, dtype, keys — stays
a parameter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tierio.options import Options
from tierio.weights.engine import DEFAULT_CHUNK, DEFAULT_DEPTH, Progress
from tierio.weights.stats import LoadStats


@dataclass(frozen=True)
class LoadOptions(Options):
    """``stats`` receives bytes, seconds and CPU time; ``direct`` reads by O_DIRECT where the
    filesystem allows; ``chunk_bytes`` per request, ``depth`` in flight; ``use_gds`` (None: when
    kvikio works); ``mapped``: CPU tensors as copy-on-write views of local files (None: whole tensors
    mapped, a tensor-parallel rank's slices in private memory, the faster of the two for each); ``progress(done,
    total)`` from the reader threads; ``strict`` (load_into): every target tensor must be in the source;
    ``numa_node``: the staging ring's NUMA node (a number, or ``"auto"`` for the current GPU's), reported
    in ``stats.extra["staging_numa"]``; ``slice_gap_bytes``: a tensor-parallel load reads through holes up
    to this size between the row pieces of a strided slice (None: the measured default of the source's
    kind; 0: exactly the slice)."""

    ALIASES: ClassVar[dict[str, str]] = {"chunk_size": "chunk_bytes"}

    stats: LoadStats | None = None
    direct: bool = True
    chunk_bytes: int | str = DEFAULT_CHUNK
    depth: int = DEFAULT_DEPTH
    use_gds: bool | None = None
    mapped: bool | None = None
    progress: Progress | None = None
    strict: bool = True
    numa_node: int | str | None = None
    slice_gap_bytes: int | str | None = None


__all__ = ["LoadOptions"]
