"""A full disk (a real 64 MiB tmpfs): a clear DiskFullError, earlier checkpoints intact, manager usable."""

from __future__ import annotations

import warnings

import pytest
import torch

from tierio.ckpt import CheckpointManager, KeepLast, Tier, list_checkpoints, verify
from tierio.errors import DiskFullError


def state_for(step: int, mib: int = 26) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib << 18, generator=g), "step": step}


def test_full_disk_fails_the_save_cleanly(small_tmpfs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = CheckpointManager([small_tmpfs], double_buffer=True, min_keep=1)
        mgr.save(1, state_for(1)).wait()
        mgr.save(2, state_for(2)).wait()
        assert any("full" in str(w.message) for w in caught)  # the 80% watermark warning
    with pytest.raises(DiskFullError, match="free space"):
        mgr.save(3, state_for(3))  # no room: refused up front
    # Two saves back to back: the second one's space check may pass while the first is still being
    # written, so it can also fail half way through its write. Either way: a clear DiskFullError.
    with pytest.raises(DiskFullError):
        mgr.save(4, state_for(4, mib=8))
        mgr.save(5, state_for(5, mib=8))
        mgr.wait()
    mgr.wait()
    steps = [c.step for c in list_checkpoints(small_tmpfs)]
    assert steps[:2] == [1, 2] and set(steps) <= {1, 2, 4}
    for s in steps:
        assert verify(small_tmpfs, s).ok
    for s in (1, 2):
        assert torch.equal(mgr.restore(s)["w"], state_for(s)["w"])
    mgr.close()
    # Nothing half-written is left taking space; with retention the same manager shape keeps going.
    with CheckpointManager([Tier(small_tmpfs, KeepLast(1))], min_keep=1) as mgr:
        mgr.gc()
        mgr.save(6, state_for(6)).wait()
        assert mgr.steps() == [6]
        assert torch.equal(mgr.restore()["w"], state_for(6)["w"])
