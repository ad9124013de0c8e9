"""Bandwidth the storage must deliver: checkpoint bursts, Lustre OSTs, training-data reads, pinned memory.

Bytes, seconds, bytes per second throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierio.errors import ConfigError


def _need_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{name.replace('_', ' ')} must be more than zero, got {value!r}")


@dataclass(frozen=True)
class WriteBandwidth:
    """Aggregate write bandwidth a checkpoint needs: ``base`` = bytes / window; ``target`` = base × margin."""

    base: float
    margin: float
    target: float


def required_write_bw(checkpoint_bytes: float, window_s: float, margin: float = 2.0) -> WriteBandwidth:
    """Bandwidth to persist a whole checkpoint within the async window, times a safety margin.

    base = checkpoint bytes / window seconds; target = base × margin (2× covers stragglers,
    rebuilds and other jobs sharing the filesystem).
    """
    _need_positive(checkpoint_size=checkpoint_bytes, async_window=window_s)
    if margin < 1:
        raise ConfigError(f"safety margin must be at least 1 (no margin), got {margin!r}")
    base = checkpoint_bytes / window_s
    return WriteBandwidth(base, margin, base * margin)


@dataclass(frozen=True)
class OstPlan:
    minimum: int        # ceil(target bandwidth / per-OST bandwidth)
    specified: int      # minimum rounded up to a multiple of ``round_to``
    round_to: int
    per_ost_bw: float
    aggregate_bw: float  # specified × per-OST bandwidth


def lustre_osts(target_bw: float, per_ost_bw: float, round_to: int = 16) -> OstPlan:
    """OSTs needed: ceil(target / per-OST bandwidth), rounded up to a multiple of ``round_to``.

    Rounding to a building block (OSS nodes come in groups, and some OSTs are always rebuilding
    or full) gives headroom; ``round_to=1`` gives the bare minimum.
    """
    _need_positive(target_bandwidth=target_bw, per_ost_bandwidth=per_ost_bw)
    if not isinstance(round_to, int) or round_to < 1:
        raise ConfigError(f"OST rounding must be a whole number of at least 1, got {round_to!r}")
    minimum = max(1, math.ceil(target_bw / per_ost_bw - 1e-9))
    specified = -(-minimum // round_to) * round_to
    return OstPlan(minimum, specified, round_to, per_ost_bw, specified * per_ost_bw)


@dataclass(frozen=True)
class StripeTax:
    """What stripe count 1 costs: every byte through one OST instead of all of them."""

    osts: int
    seconds_c1: float       # bytes / per-OST bandwidth
    seconds_full: float     # bytes / (OSTs × per-OST bandwidth)
    bw_c1: float
    bw_full: float
    bw_lost: float          # (OSTs − 1) × per-OST bandwidth
    speedup: float          # = OSTs


def stripe_tax(checkpoint_bytes: float, per_ost_bw: float, osts: int) -> StripeTax:
    """Write time of ``checkpoint_bytes`` striped over 1 OST versus all ``osts`` (``lfs setstripe -c -1``)."""
    _need_positive(checkpoint_size=checkpoint_bytes, per_ost_bandwidth=per_ost_bw, osts=osts)
    c1 = checkpoint_bytes / per_ost_bw
    return StripeTax(osts, c1, c1 / osts, per_ost_bw, per_ost_bw * osts, per_ost_bw * (osts - 1), float(osts))


@dataclass(frozen=True)
class DataRead:
    bytes_per_step: float   # batch tokens × bytes per token
    bandwidth: float        # bytes per step / step seconds


def data_read_bw(batch_tokens: float, bytes_per_token: float, step_s: float) -> DataRead:
    """Training-data read bandwidth: batch tokens × bytes per token / step time.

    Pre-tokenized IDs take 2 bytes (uint16) when the vocabulary has at most 65,536 entries and
    4 bytes (uint32) above that.
    """
    _need_positive(batch_tokens=batch_tokens, bytes_per_token=bytes_per_token, step_time=step_s)
    per_step = batch_tokens * bytes_per_token
    return DataRead(per_step, per_step / step_s)


def token_id_bytes(vocab: int) -> int:
    """Smallest unsigned integer width that holds every token ID: 2 up to 65,536 entries, else 4."""
    return 2 if vocab <= 65_536 else 4


@dataclass(frozen=True)
class PinnedMemory:
    per_gpu: float   # workers × prefetch × batch × seq × bytes
    per_node: float  # per_gpu × GPUs per node


def pinned_memory(workers: int, prefetch: int, micro_batch: int, seq_len: int, bytes_per_token: float,
                  gpus_per_node: int = 8) -> PinnedMemory:
    """Pinned host memory a DataLoader holds: workers × prefetch_factor × batch × seq_len × bytes.

    Each worker keeps ``prefetch`` ready batches; with pin_memory they sit in page-locked RAM.
    ``bytes_per_token`` is what one token occupies in the batch tensors (2 for uint16 IDs; 16 for
    an int64 input plus an int64 target).
    """
    _need_positive(workers=workers, prefetch_factor=prefetch, micro_batch=micro_batch, seq_len=seq_len,
                   bytes_per_token=bytes_per_token, gpus_per_node=gpus_per_node)
    per_gpu = workers * prefetch * micro_batch * seq_len * bytes_per_token
    return PinnedMemory(per_gpu, per_gpu * gpus_per_node)
