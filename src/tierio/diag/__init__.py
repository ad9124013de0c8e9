"""Diagnosis: step and data-wait timers, and the storage doctor's rules. See docs/diagnose.md."""

from tierio.diag.rules import Finding
from tierio.diag.timers import StepTimer, WaitTimer

__all__ = ["Finding", "StepTimer", "WaitTimer"]
