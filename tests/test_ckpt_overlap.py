"""Zero-stall snapshots (overlap=True): saves restore bit-exact with the optimizer's pre-hook
waiting for the copy; a tensor changed in place before the update is always an error (the step
is never committed: torch bumps the version counter only after its kernel wrote, so the copy
thread cannot prove the change came after it); an overlapped step commits only after its
verdict, and kill -9 while a copy is in flight leaves the previous step restorable."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tierio.ckpt import CheckpointManager
from tierio.ckpt.saving.overlap import SYNC_BYTES, Overlap, Snapshot, copy_behind
from tierio.ckpt.saving.stage import Stager
from tierio.errors import ConfigError, SnapshotChangedError, StorageError
from tierio.format.shard import manifest_key, plan_shard, shard_key
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


def test_a_change_after_the_copy_and_before_the_update_is_an_error(tmp_path):
    """Even a copy seen done before the change does not save the step: from the copy thread a
    change that raced it looks the same (the counter moves after the kernel wrote)."""
    w = big(2)
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        h = mgr.save(1, {"w": w, "step": 1})
        h.staged.result()  # the copy is taken
        w.add_(1.0)  # the promise broken
        with pytest.raises(SnapshotChangedError, match="step 1: tensor 'w' changed in place after save") as err:
            mgr.before_update()
        assert err.value.names == ["w"] and "not committed" in str(err.value)
        assert isinstance(h.persisted.exception(), SnapshotChangedError)
        mgr.wait()  # reported once, by before_update(): not raised again
        assert mgr.steps() == []
        assert not (tmp_path / "t0" / shard_key(1, 0)).exists()  # the written shard was removed


def test_a_change_right_after_save_never_mixes_states(tmp_path):
    """Through the manager: the change lands while the 16 MiB copy runs or after it; either way the
    step is not committed and the previous one stays latest (before the verdict, a copy that ended
    mid-kernel could pass the copy thread's own check and commit a mixed state)."""
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        w = big(3)
        mgr.save(1, {"w": w, "step": 1}).wait()
        mgr.before_update()
        first = w.clone()
        w.add_(1.0)  # the next update, done properly
        mgr.save(2, {"w": w, "step": 2})
        w.add_(1.0)  # the promise broken: no before_update() first
        with pytest.raises(SnapshotChangedError) as err:
            mgr.before_update()
        assert err.value.names == ["w"] and "step 2" in str(err.value)
        mgr.wait()  # the error was reported once, by before_update(): not raised again
        assert mgr.steps() == [1]
        assert torch.equal(mgr.restore()["w"], first)
        mgr.save(3, {"w": w, "step": 3}).wait()  # the manager goes on saving
        assert mgr.latest() == 3


def test_an_overlapped_step_commits_after_its_verdict(tmp_path):
    """The shard is written behind, but the manifest waits for the caller's thread: here the
    handle's wait() gives the verdict."""
    w = big(7)
    with CheckpointManager([tmp_path / "t0"], overlap=True) as mgr:
        h = mgr.save(1, {"w": w, "step": 1})
        shard = tmp_path / "t0" / shard_key(1, 0)
        deadline = time.monotonic() + 120
        while not shard.exists():  # written under a temp name and renamed: whole once it shows
            assert time.monotonic() < deadline, "the shard was never written"
            time.sleep(0.01)
        assert not (tmp_path / "t0" / manifest_key(1)).exists() and not h.persisted.done()
        h.wait()  # the verdict (nothing changed), then the commit
        assert mgr.steps() == [1] and torch.equal(mgr.restore(1)["w"], w)


def test_a_process_that_ends_before_the_verdict_exits_and_commits_nothing(tmp_path):
    code = ("import sys, torch\n"
            "from tierio.ckpt import CheckpointManager\n"
            "mgr = CheckpointManager([sys.argv[1]], overlap=True)\n"
            "mgr.save(1, {'w': torch.ones(1 << 20), 'step': 1}).staged.result()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t0")], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        assert mgr.steps() == []


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
        waited = ov.judge()
        assert not waited.failed and set(waited.seconds) == {1} and snap.verdict.result() is None
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
        h.staged.exception()  # the copy is over (its own check may have failed it): the next save judges it
        with pytest.raises(SnapshotChangedError, match="step 2"):
            mgr.save(3, {"w": w, "step": 3})
        assert isinstance(h.persisted.exception(), SnapshotChangedError)
        mgr.save(3, {"w": w, "step": 3}).wait()
        mgr.before_update()  # nothing left to report
        mgr.wait()
        assert mgr.steps() == [1, 3]


def failing_rank_worker(rank: int, root: str, init: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        with CheckpointManager([root], overlap=True, commit_timeout=5) as mgr:
            w = big(10 + rank)
            mgr.save(1, {"w": w, "step": 1}).wait()
            mgr.before_update()
            mgr.save(2, {"w": w, "step": 2})
            if rank == 1:
                w.add_(1.0)  # only rank 1 breaks the promise
                with pytest.raises(SnapshotChangedError):
                    mgr.before_update()
                mgr.wait()
            else:
                mgr.before_update()
                with pytest.raises(StorageError, match="rank 1 of 2 to write their shard of step 2"):
                    mgr.wait()
            assert mgr.steps() == [1]
    finally:
        dist.destroy_process_group()


def test_a_failed_verdict_on_one_rank_fails_the_step_everywhere(tmp_path):
    import torch.multiprocessing as tmp

    tmp.start_processes(failing_rank_worker, args=(str(tmp_path / "t0"), f"file://{tmp_path}/pg"), nprocs=2,
                        start_method="spawn", join=True)
