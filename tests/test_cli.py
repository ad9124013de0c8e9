"""Behaviour every tierio command shares."""

from __future__ import annotations

import subprocess
import sys


def test_output_piped_into_head_ends_quietly():
    """A reader that stops early (`| head`) must not get a traceback from tierio."""
    # `true` exits at once, so the pipe is closed before tierio (a second to start) writes a byte.
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m tierio.cli.main plan --json | true"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 141 and "Traceback" not in p.stderr, p.stderr
