"""Running an external tool (``lfs``, ``lctl``, ``iostat``, ``nvidia-smi``) as a ``CommandRunner``.

Whatever asks a tool goes through a runner, so a recorded cluster's outputs can stand in for the
tool where it does not exist. A missing tool, a failure or a timeout becomes a reason, never an
exception: the caller reports it and carries on.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolRun:
    output: str | None
    reason: str = ""   # why there is no output


CommandRunner = Callable[[list[str]], ToolRun]

_HINTS = {"lfs": "Lustre client tools are not installed", "lctl": "Lustre client tools are not installed",
          "iostat": "install the sysstat package", "nvidia-smi": "no NVIDIA driver on this node"}


def run_tool(argv: list[str], timeout: float = 30.0) -> ToolRun:
    """Run an external tool; a missing tool, a failure or a timeout becomes a reason."""
    exe = shutil.which(argv[0])
    if exe is None:
        hint = _HINTS.get(argv[0], "")
        return ToolRun(None, f"{argv[0]} not found{': ' + hint if hint else ''}")
    try:
        proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ToolRun(None, f"{' '.join(argv)} did not finish within {timeout:g} s")
    except OSError as exc:
        return ToolRun(None, f"{argv[0]} could not run ({exc.strerror})")
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        return ToolRun(None, f"{' '.join(argv)} failed: {msg[-1] if msg else 'exit ' + str(proc.returncode)}")
    return ToolRun(proc.stdout)
