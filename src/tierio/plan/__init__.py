"""Storage sizing as pure functions: checkpoint size and write cost, bandwidth, Lustre OSTs,
weight-load time, KV-cache capacity, pinned memory and storage cost. See docs/sizing.md."""

from tierio.plan.bandwidth import (
    data_read_bw, lustre_osts, pinned_memory, required_write_bw, stripe_tax, token_id_bytes,
)
from tierio.plan.checkpoint import Parallelism, checkpoint_size, interval_seconds, stall_cost, write_costs
from tierio.plan.cost import archive_cost, ost_hardware_cost
from tierio.plan.measured import Measured, load_measured, parse_measured
from tierio.plan.model import PRESETS, ModelShape, dtype_bytes, preset
from tierio.plan.report import PlanInputs, build_plan, tables
from tierio.plan.serving import (
    LOAD_PATHS, fetch_rule, kv_budget, kv_bytes_per_token, resume_seconds, users_per_budget, weight_load_times,
)

__all__ = [
    "LOAD_PATHS", "PRESETS", "Measured", "ModelShape", "Parallelism", "PlanInputs", "archive_cost", "build_plan",
    "checkpoint_size", "data_read_bw", "dtype_bytes", "fetch_rule", "interval_seconds", "kv_budget",
    "kv_bytes_per_token", "load_measured", "lustre_osts", "ost_hardware_cost", "parse_measured", "pinned_memory",
    "preset", "required_write_bw", "resume_seconds", "stall_cost", "stripe_tax", "tables", "token_id_bytes",
    "users_per_budget", "weight_load_times", "write_costs",
]
