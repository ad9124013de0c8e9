"""Serving-side sizing: weight-load time by storage path, KV-cache capacity by tier, fetch latency."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierio.errors import ConfigError
from tierio.kv.rule import FetchRule, fetch_rule

# Effective bandwidth of each path a serving node loads weights through (bytes/s).
# Single figures from the typical ranges: NFS server 5–10 GB/s, first load onto local NVMe
# 15–30 GB/s (bound by the network it is pulled over), warm local NVMe through a CPU bounce
# buffer 50–112 GB/s, GPUDirect Storage at the NVMe aggregate (8 drives × 14 GB/s), NVLink peer copy.
LOAD_PATHS: dict[str, tuple[float, str]] = {
    "nfs": (7.5e9, "NFS server (5–10 GB/s)"),
    "nvme-cold": (15e9, "first load onto local NVMe (15–30 GB/s)"),
    "nvme-warm": (50e9, "warm local NVMe via CPU bounce buffer (50–112 GB/s)"),
    "gds": (112e9, "local NVMe with GPUDirect Storage (8 × 14 GB/s)"),
    "nvlink": (600e9, "NVLink copy from a warm peer GPU"),
}


@dataclass(frozen=True)
class LoadTime:
    path: str
    bandwidth: float
    seconds: float   # weight bytes / bandwidth
    note: str = ""


def weight_load_times(weight_bytes: float, paths: dict[str, tuple[float, str]] | None = None) -> list[LoadTime]:
    """Time to read ``weight_bytes`` through each path: bytes / effective bandwidth."""
    if weight_bytes <= 0:
        raise ConfigError(f"weight size must be more than zero, got {weight_bytes!r}")
    out = []
    for name, (bw, note) in (paths or LOAD_PATHS).items():
        if bw <= 0:
            raise ConfigError(f"bandwidth of load path {name!r} must be more than zero")
        out.append(LoadTime(name, bw, weight_bytes / bw, note))
    return out


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """KV-cache bytes per token = 2 (K and V) × layers × KV heads × head dim × bytes per element."""
    for name, v in (("layers", layers), ("KV heads", kv_heads), ("head dim", head_dim), ("KV dtype bytes", dtype_bytes)):
        if not v > 0:
            raise ConfigError(f"{name} must be more than zero, got {v!r}")
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_budget(hbm_per_gpu: float, gpus: int, weight_bytes: float, overhead_bytes: float) -> float:
    """HBM left for KV cache on a serving group = GPUs × HBM per GPU − weights − activations/overhead."""
    if hbm_per_gpu <= 0 or gpus < 1:
        raise ConfigError("HBM per GPU must be more than zero and the group at least one GPU")
    left = hbm_per_gpu * gpus - weight_bytes - overhead_bytes
    if left <= 0:
        raise ConfigError(
            f"no HBM left for KV cache: {gpus} × {hbm_per_gpu / 1e9:g} GB HBM minus {weight_bytes / 1e9:g} GB "
            f"weights minus {overhead_bytes / 1e9:g} GB overhead is {left / 1e9:g} GB: use more GPUs per replica "
            "(--tp), a smaller weight dtype, or give --kv-budget")
    return left


def replica_gpus(hbm_per_gpu: float, weight_bytes: float, overhead_bytes: float, limit: int = 64) -> int:
    """Smallest power-of-two GPU count whose HBM holds the weights and overhead with room left for KV."""
    if hbm_per_gpu <= 0:
        raise ConfigError("HBM per GPU must be more than zero")
    gpus = 1
    while gpus * hbm_per_gpu <= weight_bytes + overhead_bytes:
        gpus *= 2
        if gpus > limit:
            raise ConfigError(f"{weight_bytes / 1e9:g} GB of weights do not fit in {limit} GPUs of "
                              f"{hbm_per_gpu / 1e9:g} GB: check --hbm-per-gpu and --serve-dtype")
    return gpus


def users_per_budget(budget_bytes: float, bytes_per_user: float) -> int:
    """Whole users whose KV cache fits: floor(budget / (context × KV bytes per token))."""
    if bytes_per_user <= 0:
        raise ConfigError("KV bytes per user must be more than zero")
    return int(math.floor(budget_bytes / bytes_per_user + 1e-9))


def resume_seconds(bytes_per_user: float, tier_bw: float) -> float:
    """Time to bring one user's whole KV cache back from a tier: KV bytes per user / tier bandwidth."""
    if tier_bw <= 0:
        raise ConfigError("tier bandwidth must be more than zero")
    return bytes_per_user / tier_bw


# The fetch rule lives with the KV router, which applies it to every lookup; sizing re-exports it.
__all__ = [
    "LOAD_PATHS", "FetchRule", "LoadTime", "fetch_rule", "kv_budget", "kv_bytes_per_token", "replica_gpus",
    "resume_seconds", "users_per_budget", "weight_load_times",
]
