"""`tierio demo`: a small GPT trains on CPU, checkpoints asynchronously into three tiers, loses its
local disk, restores from the next tier and resumes bit-for-bit."""

from tierio.demo.run import PRESETS, DemoConfig, DemoReport, run_demo

__all__ = ["PRESETS", "DemoConfig", "DemoReport", "run_demo"]
