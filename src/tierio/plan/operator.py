"""The questions an operator asks on day one, as pure functions: which filesystem for this many GPUs,
what idle GPUs cost, how long recovery takes from each tier, how much NVMe a node needs, and what
packing, a DataLoader fix and faster serving restarts are worth. See docs/sizing.md for the arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

from tierio.errors import ConfigError

HOURS_PER_DAY = 24.0
DAYS_PER_YEAR = 365.0
NFS_MAX_GPUS = 32          # the chapter's rule: NFS below 32 GPUs ...
MIDSIZE_MAX_GPUS = 256     # ... Weka or Lustre to 256 ...
LARGE_OSTS = 100           # ... above that Lustre with 100+ OSTs, or a custom parallel filesystem


@dataclass(frozen=True)
class FsChoice:
    fs: str            # what the plan uses ("auto" resolved)
    by_scale: str      # what the GPU count alone points at
    reason: str
    fits: bool         # False when a given --fs is below what the scale needs


def choose_filesystem(gpus: int, fs: str = "auto") -> FsChoice:
    """The chapter's decision rule: NFS (< 32 GPUs) → Weka or Lustre (32–256) → Lustre with 100+ OSTs (> 256)."""
    if gpus < 1:
        raise ConfigError(f"GPU count must be at least 1, got {gpus!r}")
    if gpus < NFS_MAX_GPUS:
        scale, why = "nfs", f"{gpus:,} GPUs < {NFS_MAX_GPUS}: one NFS server keeps up"
    elif gpus <= MIDSIZE_MAX_GPUS:
        scale, why = "weka or lustre", (f"{NFS_MAX_GPUS} ≤ {gpus:,} GPUs ≤ {MIDSIZE_MAX_GPUS}: a parallel "
                                        "filesystem; one NFS server would serialize every reader and checkpoint")
    else:
        scale, why = "lustre", (f"{gpus:,} GPUs > {MIDSIZE_MAX_GPUS}: Lustre with {LARGE_OSTS}+ OSTs (or a custom "
                                "parallel filesystem)")
    choice = fs.lower()
    if choice == "auto":
        return FsChoice(scale.split(" or ")[-1], scale, why, True)
    fits = not (choice.startswith("nfs") and gpus >= NFS_MAX_GPUS)
    reason = why if fits else f"{why}; NFS at {gpus:,} GPUs leaves GPUs idle 15–20% of the time"
    return FsChoice(choice, scale, reason, fits)


@dataclass(frozen=True)
class GpuTimeCost:
    """GPU time freed or lost: a share of every GPU-hour the cluster runs."""

    gpus: int
    share: float           # of the cluster's GPU time
    gpu_hour_cost: float
    gpu_hours_per_day: float
    per_hour: float
    per_day: float
    per_year: float


def gpu_time_cost(gpus: int, share: float, gpu_hour_cost: float) -> GpuTimeCost:
    """$ = GPUs × share × $/GPU-hour, per hour; × 24 per day; × 365 per year."""
    if not 0 <= share <= 1 or gpu_hour_cost < 0 or gpus < 1:
        raise ConfigError(f"share must lie in [0, 1] (got {share!r}), price ≥ 0 and GPUs ≥ 1")
    per_hour = gpus * share * gpu_hour_cost
    return GpuTimeCost(gpus, share, gpu_hour_cost, gpus * share * HOURS_PER_DAY, per_hour,
                       per_hour * HOURS_PER_DAY, per_hour * HOURS_PER_DAY * DAYS_PER_YEAR)


def freed_share(useful_before: float, useful_after: float) -> float:
    """Share of GPU time freed when the useful fraction of it rises: 1 − before / after
    (the same useful work takes before/after of the time it took)."""
    if not 0 < useful_after <= 1 or not 0 <= useful_before <= 1:
        raise ConfigError("useful fractions must lie in (0, 1]")
    return max(0.0, 1 - useful_before / useful_after)


@dataclass(frozen=True)
class Recovery:
    tier: str
    bytes: float          # what one reader of this tier moves (a node's part, or the whole checkpoint)
    bandwidth: float
    restart_s: float
    seconds: float        # bytes / bandwidth + restart
    meets_target: bool
    note: str = ""


def recovery_time(tier: str, nbytes: float, bandwidth: float, restart_s: float, target_s: float,
                  note: str = "") -> Recovery:
    """Time to restore from one tier: bytes / bandwidth + restart, against the recovery target."""
    if bandwidth <= 0 or nbytes < 0:
        raise ConfigError(f"recovery from {tier}: bandwidth must be more than zero and bytes zero or more")
    seconds = nbytes / bandwidth + restart_s
    return Recovery(tier, nbytes, bandwidth, restart_s, seconds, seconds <= target_s, note)


@dataclass(frozen=True)
class NvmeNeed:
    dataset_cache: float
    checkpoint_per_node: float
    kept_steps: int
    checkpoint_staging: float     # per-node checkpoint × kept steps
    kv_spill: float
    total: float
    per_node: float               # the NVMe a node has
    fits: bool


def nvme_capacity(dataset_cache: float, checkpoint_per_node: float, kept_steps: int, kv_spill: float,
                  per_node: float) -> NvmeNeed:
    """A node's NVMe = dataset cache + its checkpoint part × kept steps + KV spill (the three uses share it)."""
    if kept_steps < 1 or min(dataset_cache, checkpoint_per_node, kv_spill) < 0 or per_node <= 0:
        raise ConfigError("kept steps must be at least 1, sizes zero or more, and the node's NVMe more than zero")
    staging = checkpoint_per_node * kept_steps
    total = dataset_cache + staging + kv_spill
    return NvmeNeed(dataset_cache, checkpoint_per_node, kept_steps, staging, kv_spill, total, per_node,
                    total <= per_node)


@dataclass(frozen=True)
class RestartSavings:
    restarts_per_day: float
    nodes: int
    gpus_per_node: int
    slow_s: float
    fast_s: float
    node_hours_per_day: float     # restarts × nodes × (slow − fast) / 3600
    gpu_hours_per_day: float      # × GPUs per node: every GPU of a restarting node waits
    per_day: float


def restart_savings(restarts_per_day: float, nodes: int, gpus_per_node: int, slow_s: float, fast_s: float,
                    gpu_hour_cost: float) -> RestartSavings:
    """Serving restarts: restarts × nodes × load time saved, in node-hours, then × GPUs per node × $/GPU-hour."""
    if restarts_per_day < 0 or nodes < 1 or gpus_per_node < 1:
        raise ConfigError("restarts must be zero or more, nodes and GPUs per node at least 1")
    node_hours = restarts_per_day * nodes * max(0.0, slow_s - fast_s) / 3600
    gpu_hours = node_hours * gpus_per_node
    return RestartSavings(restarts_per_day, nodes, gpus_per_node, slow_s, fast_s, node_hours, gpu_hours,
                          gpu_hours * gpu_hour_cost)
