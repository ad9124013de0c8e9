"""Which node each rank runs on: node-scoped tiers are written and cleaned per node.

A node's ranks share its node-local tiers; the lowest of them leads: it holds the node tier's
lease and applies retention there. The layout is agreed once, at construction, in the caller's
thread: with an initialised process group, one ``all_gather_object`` of each rank's node name (the
``node`` option, else ``TIERIO_NODE``, else the host name and torchrun's GROUP_RANK), which also
carries rank 0's run id.
Without a process group: ranks sit on nodes in blocks of ``ranks_per_node`` (default torchrun's
``LOCAL_WORLD_SIZE``), else every rank on one node.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from tierio.errors import ConfigError

from tierio.ckpt.steps.lease import check_run_id, new_run_id


@dataclass(frozen=True)
class NodeLayout:
    """This rank's node: its name and the ranks on it (ascending)."""

    name: str
    ranks: tuple[int, ...]

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True)
class Job:
    """What the ranks agreed on at construction."""

    run_id: str | None  # None: a non-zero rank that could not learn its run's id (it cannot write)
    node: NodeLayout


def node_name(given: str | None) -> str:
    """This rank's node: ``given``, else TIERIO_NODE, else the host name (with torchrun's GROUP_RANK,
    the agent's node index, appended: one agent per node)."""
    group = os.environ.get("GROUP_RANK")
    name = given or os.environ.get("TIERIO_NODE") or (socket.gethostname() + (f"-{group}" if group else ""))
    if not name or len(name) > 255:
        raise ConfigError(f"node name {name!r} must be 1-255 characters")
    return name


def _in_blocks(rank: int, world_size: int, given: str | None, per_node: int | None) -> NodeLayout:
    if per_node is None:
        try:
            per = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        except ValueError:
            per = 0
    else:
        per = per_node
        if per < 1 or world_size % per:
            raise ConfigError(f"ranks_per_node={per_node} must divide the world size {world_size}")
    if 0 < per < world_size and world_size % per == 0:
        first = rank - rank % per
        return NodeLayout(given or f"node{rank // per}", tuple(range(first, first + per)))
    return NodeLayout(node_name(given), tuple(range(world_size)))


def agree_job(run_id: str | None, rank: int, world_size: int, group: Any, from_group: bool,
              node: str | None, need_nodes: bool, per_node: int | None = None) -> Job:
    """The run id (the given one, or rank 0's) and this rank's node layout, in at most one
    collective over the process group the ranks came from (in the caller's thread)."""
    if run_id is not None:
        run_id = check_run_id(run_id)
    mine = run_id or (new_run_id() if rank == 0 else None)
    joined = False
    if world_size > 1 and from_group and (run_id is None or need_nodes):
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()
    if not joined:
        if world_size > 1 and run_id is None:
            # Ranks that cannot talk still need one run id; without the launcher's, the other ranks
            # have none and are refused at their first write (TierLeases), never guess one.
            mine = launcher_run_id() or mine
        layout = _in_blocks(rank, world_size, node, per_node) if need_nodes else NodeLayout(node_name(node), tuple(range(world_size)))
        return Job(mine, layout)
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (mine if rank == 0 else None, node_name(node) if need_nodes else ""), group=group)
    run = run_id if run_id is not None else check_run_id(gathered[0][0])
    here = gathered[rank][1]
    return Job(run, NodeLayout(here or node_name(node), tuple(r for r, (_, n) in enumerate(gathered) if n == here)))


def launcher_run_id() -> str | None:
    """One id for every rank of this launch, from the launcher: torchrun's run id and restart
    count, or Slurm's job, step and restart count (a restarted or requeued job is a new run)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID"):
        raw = f"{env['TORCHELASTIC_RUN_ID']}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    elif env.get("SLURM_JOB_ID"):
        raw = f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}-r{env.get('SLURM_RESTART_COUNT', '0')}"
    else:
        return None
    return check_run_id("".join(c if c.isalnum() or c in "_.-" else "_" for c in raw)[:128])


def gather(value: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's ``value`` (one all_gather_object over ``group``, in the caller's thread; alone,
    ``group`` None and ``world_size`` 1, just this one)."""
    if group is None and world_size == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return out


def group_joined(group: Any, from_group: bool) -> Any:
    """The process group to agree over, or None (ranks given by hand, or no group initialised)."""
    if not from_group:
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return group if group is not None else dist.group.WORLD
