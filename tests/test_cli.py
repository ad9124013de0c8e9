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


def test_byte_progress_draws_on_a_terminal_only():
    import io

    from rich.console import Console

    from tierio.cli.output import byte_progress

    out = io.StringIO()
    with byte_progress("loading", Console(file=out, force_terminal=True, width=100)) as progress:
        progress(512 << 20, 1 << 30)
        progress(1 << 30, 1 << 30)
    assert "loading" in out.getvalue()
    with byte_progress("loading", Console(file=io.StringIO(), force_terminal=False)) as progress:
        assert progress is None
