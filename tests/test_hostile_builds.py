"""Dataset builds that fail half way: a full disk, a crash between the two renames, a killed
builder. The previous .bin/.idx pair survives whole, or the new one appears whole; stale temps of
dead builders are removed, those of live ones are not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierio.data.builder import build_indexed
from tierio.data.indexed import IndexedDataset, IndexedDatasetWriter
from tierio.errors import DiskFullError
from tierio.io import publish


def _pair(prefix: Path) -> dict[str, bytes]:
    return {s: Path(f"{prefix}.{s}").read_bytes() for s in ("bin", "idx")}


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def _tokens(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    try:
        return [ds.document(j).tolist() for j in range(ds.num_documents)]
    finally:
        ds.close()


def test_rebuild_on_a_full_disk_keeps_the_old_pair(small_tmpfs):
    prefix = small_tmpfs / "corpus"
    old = [[i % 50, (i * 7) % 50, 3] for i in range(2000)]
    build_indexed(old, prefix, vocab_size=1000)
    before = _pair(prefix)
    # the new dataset: 300k one-token documents, a 600 KB .bin and a 6 MB .idx
    n = 300_000
    st = os.statvfs(small_tmpfs)
    with open(small_tmpfs / "filler", "wb") as f:  # leave room for the new .bin, not for its .idx
        f.write(b"\0" * (st.f_bavail * st.f_frsize - 2 * n - (1 << 20)))
    with pytest.raises(DiskFullError):
        build_indexed((np.array([i % 1000]) for i in range(n)), prefix, vocab_size=1000)
    assert _pair(prefix) == before
    assert _tokens(prefix) == old
    assert _leftovers(small_tmpfs) == []  # no temp of the failed build either


@pytest.mark.parametrize("renames_before_crash", [0, 1, 2])
def test_a_crash_at_any_rename_leaves_the_old_pair_or_the_new_one(tmp_path, monkeypatch, renames_before_crash):
    """Renames in order: the journal into place, then the .bin, then the .idx."""
    prefix = tmp_path / "corpus"
    old, new = [[1, 2, 3]] * 10, [[7, 8]] * 25
    build_indexed(old, prefix, vocab_size=100)
    real_replace = os.replace
    calls = []

    def crash_after(src, dst, **dir_fds):  # the process "dies" after `renames_before_crash` renames
        if len(calls) == renames_before_crash:
            raise KeyboardInterrupt("killed")
        calls.append(dst)
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "replace", crash_after)
    with pytest.raises(KeyboardInterrupt):
        build_indexed(new, prefix, vocab_size=100)
    monkeypatch.setattr(os, "replace", real_replace)
    journal = publish.journal_path(Path(f"{prefix}.idx")).exists()
    assert journal == (renames_before_crash > 0)
    # the next reader sees one whole pair: the old one if the journal never landed, else the new one
    assert _tokens(prefix) == (new if journal else old)
    build_indexed(new, prefix, vocab_size=100)  # and the next build leaves nothing behind
    assert _leftovers(tmp_path) == []


def test_a_hostile_journal_is_refused(tmp_path):
    prefix = tmp_path / "corpus"
    build_indexed([[1, 2, 3]] * 4, prefix, vocab_size=100)
    publish.journal_path(Path(f"{prefix}.idx")).write_text(
        '{"format": "tierio-publish", "version": 1, "files": [["../../etc/passwd", "corpus.idx"]]}'
    )
    from tierio.errors import FormatError

    with pytest.raises(FormatError, match="journal"):
        IndexedDataset(prefix)
    assert Path(f"{prefix}.idx").exists() and Path(f"{prefix}.bin").exists()  # nothing was renamed


@pytest.mark.timeout(300)
def test_stale_temps_of_a_killed_builder_are_removed_and_a_live_builders_are_not(tmp_path):
    prefix = tmp_path / "corpus"
    script = (
        "import sys, time, numpy as np\n"
        "from tierio.data.indexed import IndexedDatasetWriter\n"
        f"w = IndexedDatasetWriter({str(prefix)!r}, dtype=np.uint16)\n"
        "w.add_document(np.arange(1000, dtype=np.uint16))\n"
        "w._f.flush()\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        temps = [p for p in tmp_path.iterdir() if p.name.startswith(".corpus.bin.tmp-")]
        assert len(temps) == 1
        live = IndexedDatasetWriter(prefix, dtype=np.uint16)  # starts while the other builder lives
        live.abort()
        assert temps[0].exists()  # a live writer's temp is left alone
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert temps[0].exists()  # kill -9 leaves it behind ...
    build_indexed([[1, 2], [3]], prefix, vocab_size=100)
    assert _leftovers(tmp_path) == []  # ... and the next build removes it
    assert _tokens(prefix) == [[1, 2], [3]]
