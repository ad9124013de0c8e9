"""Who am I in the job: rank and world size, from arguments or from torch.distributed."""

from __future__ import annotations

from typing import Any

from tierio.errors import ConfigError


def rank_world(rank: int | None = None, world_size: int | None = None, group: Any = None) -> tuple[int, int]:
    """(rank, world size): the arguments where given, else the initialised process group's, else (0, 1)."""
    if rank is None or world_size is None:
        try:
            import torch.distributed as dist

            joined = dist.is_available() and dist.is_initialized()
        except ImportError:  # pragma: no cover - torch is a dependency
            joined = False
        if joined:
            rank = dist.get_rank(group) if rank is None else rank
            world_size = dist.get_world_size(group) if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size
