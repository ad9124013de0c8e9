"""Zero-stall snapshots (overlap=True): saves restore bit-exact with the optimizer's pre-hook
waiting for the copy, a tensor changed in place before the update is caught (an error, or a
warning once the copy was already taken: never a silently mixed checkpoint), and kill -9 while a
copy is in flight leaves the previous step restorable."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import warnings

import pytest
import torch

from tierio.ckpt import CheckpointManager
from tierio.ckpt.overlap import SYNC_BYTES, Overlap, Snapshot, copy_behind
from tierio.ckpt.saving import Stager
from tierio.errors import ConfigError, SnapshotChangedError
from tierio.format.shard import plan_shard
from tierio.io.buffers import BufferPool


def big(seed: int, n: int = 4 << 20) -> torch.Tensor:
    """16 MiB of fp32: copied behind save() (above SYNC_BYTES), long enough to still be copying."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_overlapped_saves_restore_bit_exact_with_an_attached_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 256), torch.randn(32, 4)
    expected = {}
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        hook = mgr.attach(opt)
        for step in range(1, 5):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # the pre-hook waits for the previous save's copy before AdamW changes anything
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            mgr.save(step, state)
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        hook.remove()
        mgr.wait()
        saves = mgr.stats()["saves"]
        assert all("update_wait_seconds" in s for s in saves[:-1])  # each update waited for the last copy
        for step, want in expected.items():
            got = mgr.restore(step)
            assert got["step"] == step
            for k, v in want.items():
                assert torch.equal(got["model"][k], v), (step, k)
        assert mgr.verify(4).ok


def test_a_change_before_the_copy_is_an_error():
    """The copy thread's check, driven directly: the tensor moved between save() and its copy."""
    t = big(1, 1 << 16)
    layout = plan_shard({"w": t}, {})
    pool = BufferPool(None, max_buffers=1)
    buf = pool.acquire(layout.total_bytes)
    try:
        snap = Snapshot(7, {"w": t}, {"w": t._version})
        t.mul_(2)
        with pytest.raises(SnapshotChangedError, match="step 7: tensor 'w' changed in place") as err:
            copy_behind(Stager(), layout, snap, buf, None)
        assert err.value.names == ["w"]
        untouched = Snapshot(8, {"w": t}, {"w": t._version})
        copy_behind(Stager(), layout, untouched, buf, None)  # no change: no error
    finally:
        pool.release(buf)
        pool.close()


def test_a_change_after_the_copy_is_a_warning_and_the_checkpoint_is_whole(tmp_path):
    w = big(2)
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        h = mgr.save(1, {"w": w, "step": 1})
        h.staged.result()  # the copy is taken
        before = w.clone()
        w.add_(1.0)  # the promise broken, but after the copy
        with pytest.warns(UserWarning, match="step 1: tensor 'w' changed in place before the update"):
            mgr.before_update()
        mgr.wait()
        assert torch.equal(mgr.restore(1)["w"], before)


def test_a_change_right_after_save_never_mixes_states(tmp_path):
    """Through the manager: the change lands while the 16 MiB copy runs (an error: the step is not
    written, the previous one stays latest) or, on a machine fast enough to finish the copy first,
    after it (a warning: the step holds the values save() was given)."""
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        w = big(3)
        mgr.save(1, {"w": w, "step": 1}).wait()
        mgr.before_update()
        first = w.clone()
        w.add_(1.0)  # the next update, done properly
        second = w.clone()
        mgr.save(2, {"w": w, "step": 2})
        w.add_(1.0)  # the promise broken: no before_update() first
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                mgr.before_update()
                failed = False
            except SnapshotChangedError as exc:
                failed = True
                assert exc.names == ["w"] and "not written" in str(exc)
        mgr.wait()  # the error was reported once, by before_update(): not raised again
        if failed:
            assert mgr.steps() == [1]
            assert torch.equal(mgr.restore()["w"], first)
        else:
            assert any("changed in place" in str(c.message) for c in caught)
            assert torch.equal(mgr.restore(2)["w"], second)
        mgr.save(3, {"w": w, "step": 3}).wait()  # the manager goes on saving
        assert mgr.latest() == 3


def test_small_and_python_state_is_captured_in_save(tmp_path):
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        counter = torch.zeros(4)
        assert counter.numel() * counter.element_size() <= SYNC_BYTES
        meta = {"lr": 0.1, "names": ["a"]}
        w = big(4)
        mgr.save(1, {"w": w, "counter": counter, "meta": meta})
        counter.add_(5)  # small tensors and Python values were copied before save() returned
        meta["lr"] = 0.5
        meta["names"].append("b")
        mgr.before_update()
        mgr.wait()
        got = mgr.restore(1)
        assert torch.equal(got["counter"], torch.zeros(4)) and got["meta"] == {"lr": 0.1, "names": ["a"]}


def test_attach_needs_overlap_and_before_update_without_it_does_nothing(tmp_path):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        with pytest.raises(ConfigError, match="overlap=True"):
            mgr.attach(opt)
        mgr.before_update()


def test_overlap_direct_start_and_wait():
    """Overlap on its own: the header and small tensors are staged at once, the large one behind."""
    pool = BufferPool(None, max_buffers=1)
    ov = Overlap(Stager())
    tensors = {"small": torch.arange(16, dtype=torch.float32), "large": big(5, 1 << 16)}
    layout = plan_shard(tensors, {})
    buf = pool.acquire(layout.total_bytes)
    try:
        snap = ov.start(1, layout, tensors, buf)
        assert set(snap.tensors) == {"large"}
        waited = ov.before_update()
        assert not waited.failed and set(waited.seconds) == {1}
        staged = buf.tensor()[: layout.total_bytes]
        off = layout.header.data_offset
        for name, t in tensors.items():
            e = layout.header.tensors[name]
            assert bytes(staged[off + e.begin: off + e.end].numpy()) == t.numpy().tobytes()
    finally:
        ov.close()
        pool.release(buf)
        pool.close()


# -- kill -9 while a copy is in flight -------------------------------------------------------------

def saver(root: str, ready, copying) -> None:
    """Child: a committed step 1, then overlapped saves whose copies are in flight when it is killed."""
    mgr = CheckpointManager([root], overlap=True)
    mgr.save(1, {"w": big(1), "step": 1}).wait()
    ready.set()
    step = 2
    while True:
        mgr.save(step, {"w": big(step), "step": step})
        copying.set()
        mgr.before_update()
        step += 1


@pytest.mark.parametrize("trial", range(3))
def test_kill_dash_nine_mid_overlap_leaves_the_previous_step(tmp_path, trial):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tierio.ckpt"])
    ready, copying = ctx.Event(), ctx.Event()
    p = ctx.Process(target=saver, args=(str(tmp_path), ready, copying))
    p.start()
    assert ready.wait(120), "saver did not start"
    assert copying.wait(120)
    if trial:  # later in the loop: a persist of an earlier overlapped step may be running too
        copying.clear()
        assert copying.wait(120)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    with CheckpointManager([str(tmp_path)]) as mgr:
        steps = mgr.steps()
        assert steps and steps[0] == 1
        for step in steps:
            got = mgr.restore(step)
            assert got["step"] == step and torch.equal(got["w"], big(step))
        assert mgr.verify(steps[-1]).ok


def test_bench_overlap_figure_runs(tmp_path):
    from tierio.bench import overlap
    from tierio.bench.ckpt import make_state

    state = make_state(4 << 20, 8)
    got = overlap.measure(state, tmp_path, 1, memcpy_s=0.001)
    assert set(got) >= {"stall_s", "save_blocking_s", "update_wait_s", "forward_backward_s", "ratio"}
    assert got["ratio"] > 0 and len(got["all_stall_s"]) == 1


def test_without_an_update_hook_the_next_save_reports_the_change_once(tmp_path):
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        w = big(6)
        mgr.save(1, {"w": w, "step": 1}).wait()
        h = mgr.save(2, {"w": w, "step": 2})
        w.add_(1.0)  # the promise broken, and no before_update() follows
        failed = h.persisted.exception() is not None
        if failed:
            assert isinstance(h.persisted.exception(), SnapshotChangedError)
            with pytest.raises(SnapshotChangedError):
                mgr.save(3, {"w": w, "step": 3})
        mgr.save(3, {"w": w, "step": 3}).wait()
        mgr.before_update()  # nothing left to report
        mgr.wait()
        assert mgr.steps() == ([1, 3] if failed else [1, 2, 3])
