"""Storage sizing as pure functions: checkpoint size and write cost, bandwidth, Lustre OSTs,
weight-load time, KV-cache capacity, pinned memory and storage cost. See docs/sizing.md."""

from importlib import import_module
from typing import Any

# Names are imported from their module on first use (PEP 562): the CLI builds its parser from
# tierio.plan.model alone, and `tierio --help` must not load the report, the KV rule and numpy.
_HOME = {
    "bandwidth": ("data_read_bw", "lustre_osts", "pinned_memory", "required_write_bw", "stripe_tax", "token_id_bytes"),
    "checkpoint": ("Parallelism", "checkpoint_size", "interval_seconds", "stall_cost", "write_costs"),
    "cost": ("archive_cost", "ost_hardware_cost"),
    "measured": ("Measured", "load_measured", "parse_measured"),
    "model": ("PRESETS", "ModelShape", "dtype_bytes", "preset"),
    "report": ("PlanInputs", "build_plan", "tables"),
    "serving": ("LOAD_PATHS", "fetch_rule", "kv_budget", "kv_bytes_per_token", "resume_seconds", "users_per_budget",
                "weight_load_times"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tierio.plan' has no attribute {name!r}")
    value = getattr(import_module(f"tierio.plan.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "LOAD_PATHS", "PRESETS", "Measured", "ModelShape", "Parallelism", "PlanInputs", "archive_cost", "build_plan",
    "checkpoint_size", "data_read_bw", "dtype_bytes", "fetch_rule", "interval_seconds", "kv_budget",
    "kv_bytes_per_token", "load_measured", "lustre_osts", "ost_hardware_cost", "parse_measured", "pinned_memory",
    "preset", "required_write_bw", "resume_seconds", "stall_cost", "stripe_tax", "tables", "token_id_bytes",
    "users_per_budget", "weight_load_times", "write_costs",
]
