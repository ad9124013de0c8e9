"""Who am I in the job: rank and world size, from arguments or from torch.distributed; which
machine and node I run on."""

from __future__ import annotations

import os
import socket
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


def release_group(group: Any) -> None:
    """Destroy a process group tierio made for itself (``new_group``), when its owner closes. A gloo
    group's threads live as long as anything holds the group, even past ``destroy_process_group()``,
    and their teardown at the interpreter's exit sometimes aborts the process ("terminate called
    without an active exception") after all its work is done."""
    if group is None:
        return
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    except (RuntimeError, ValueError):  # already destroyed, with the default group or by its owner
        pass


def machine() -> str:
    """This machine's boot and process namespace: two processes with the same value see each other's
    pids (and open each other's descriptors through /proc). Empty where that cannot be known."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def node_key() -> str:
    """Which node this process runs on, for sharing node-local memory: ``TIERIO_NODE`` when set (the
    node name checkpoint tiers use too; several values on one machine simulate several nodes), else
    the host name with :func:`machine`."""
    return os.environ.get("TIERIO_NODE") or f"{socket.gethostname()}/{machine()}"
