"""CheckpointManager: async handles, staging reuse, background failures, tiers, retention."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from tierio.ckpt import (
    CheckpointManager,
    KeepAll,
    KeepEvery,
    KeepLast,
    KeepWithin,
    Tier,
    gc,
    gc_plan,
    list_checkpoints,
    parse_retention,
    promote,
)
from tierio.errors import ConfigError, StorageError


def make_state(step: int, n: int = 64 * 1024) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "h": torch.randn(n // 4, generator=g).bfloat16(), "step": step}


def same_state(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["h"], b["h"])


def test_save_returns_after_staging_and_reuses_its_buffer(tmp_path):
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        handles = []
        for step in range(1, 6):
            state = make_state(step)
            h = mgr.save(step, state)
            assert h.staged.done() and h.blocking_seconds > 0
            state["w"].zero_()  # the snapshot was taken: changing the state now must not matter
            handles.append(h)
        for h in handles:
            h.wait()
            assert h.persisted.result() == h.step and h.promoted.done()
        st = mgr.stats()
        assert st["staging_allocations"] == 1  # one buffer, reused by every save
        assert len(st["saves"]) == 5 and all(s["persist_seconds"] > 0 for s in st["saves"])
        assert st["tiers"][0]["bytes_written"] == sum(h.bytes for h in handles)
        assert mgr.steps() == [1, 2, 3, 4, 5] and mgr.latest() == 5
        for step in (5, 2):
            assert same_state(mgr.restore(step), make_state(step))
        assert mgr.restored_step == 2


def test_double_buffer_keeps_two_persists_in_flight(tmp_path):
    with CheckpointManager([tmp_path / "t0"], double_buffer=True) as mgr:
        for step in range(1, 5):
            mgr.save(step, make_state(step))
        mgr.wait()
        assert mgr.stats()["staging_allocations"] <= 2
        assert same_state(mgr.restore(), make_state(4))


def test_memory_budget_is_enforced(tmp_path):
    with CheckpointManager([tmp_path / "t0"], memory_budget_bytes="64KiB") as mgr:
        with pytest.raises(ConfigError, match="memory_budget"):
            mgr.save(1, make_state(1))
        mgr.save(2, make_state(2, n=1024)).wait()
        assert mgr.steps() == [2]


def test_old_option_names_still_work_with_a_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match="memory_budget"):
        mgr = CheckpointManager([tmp_path / "t0"], memory_budget="64KiB", inline_records=0)
    with mgr:
        assert mgr.options.memory_budget_bytes == 64 * 1024 and mgr.options.inline_record_bytes == 0


def test_promotion_runs_behind_the_persist(tmp_path):
    state = make_state(1, n=512 * 1024)  # 2.25 MiB at 1 MB/s: promotion is still running when save returns
    with CheckpointManager([tmp_path / "fast", tmp_path / "slow"], promote_bandwidth="1MB") as mgr:
        h = mgr.save(1, state)
        assert h.staged.done() and not h.promoted.done()
        h.persisted.result(timeout=60)
        assert [c.step for c in list_checkpoints(tmp_path / "fast")] == [1]
        h.wait(timeout=60)
        assert [c.step for c in list_checkpoints(tmp_path / "slow")] == [1]
        st = mgr.stats()["tiers"]
        assert st[1]["bytes_written"] == st[0]["bytes_written"] > 0


def test_held_promotion_starts_on_release_and_never_blocks_close(tmp_path):
    """A preemption's emergency save holds promotion: a step persisted meanwhile stays on the fast
    tier until release; a manager closed while holding promotes it on the way out."""
    with CheckpointManager([tmp_path / "fast", tmp_path / "slow"]) as mgr:
        mgr.hold_promotion()
        h = mgr.save(1, make_state(1, n=512))
        h.persisted.result(timeout=60)
        time.sleep(0.2)  # time for a promotion that was wrongly started to show
        assert not h.promoted.done() and list_checkpoints(tmp_path / "slow") == []
        mgr.hold_promotion(False)
        h.wait(timeout=60)
        assert [c.step for c in list_checkpoints(tmp_path / "slow")] == [1]
        mgr.hold_promotion()
        h2 = mgr.save(2, make_state(2, n=512))
        h2.persisted.result(timeout=60)
    assert h2.promoted.result(timeout=0) == 2  # close() released the hold and waited for it
    assert [c.step for c in list_checkpoints(tmp_path / "slow")] == [1, 2]


def test_background_failure_is_raised_by_the_next_call_and_not_lost(tmp_path):
    root = tmp_path / "t0"
    with CheckpointManager([root]) as mgr:
        mgr.save(1, make_state(1)).wait()
        (root / "step_000000002").write_text("a file where the step directory should go")
        h = mgr.save(2, make_state(2))
        with pytest.raises(StorageError):
            h.persisted.result(timeout=30)
        with pytest.raises(StorageError):
            mgr.save(3, make_state(3))  # the failure of step 2 surfaces here
        h4 = mgr.save(4, make_state(4))  # raised once: the manager is usable again
        h4.wait()
        assert mgr.steps() == [1, 4]
        (root / "step_000000002").unlink()
        (root / "step_000000005").write_text("x")
        mgr.save(5, make_state(5))
        with pytest.raises(StorageError):
            mgr.wait()
    assert [c.step for c in list_checkpoints(root)] == [1, 4]


def test_close_raises_background_failure(tmp_path):
    root = tmp_path / "t0"
    mgr = CheckpointManager([root])
    (root / "step_000000001").write_text("x")
    mgr.save(1, make_state(1))
    with pytest.raises(StorageError):
        mgr.close()
    with pytest.raises(ConfigError, match="closed"):
        mgr.save(2, make_state(2))


def test_committed_steps_are_immutable(tmp_path):
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        mgr.save(1, make_state(1)).wait()
        with pytest.raises(ConfigError, match="immutable"):
            mgr.save(1, make_state(2))


def test_missing_fast_copy_falls_back_and_latest_bad_step_falls_back_to_older(tmp_path):
    tiers = [tmp_path / "a", tmp_path / "b"]
    with CheckpointManager(tiers) as mgr:
        mgr.save(1, make_state(1)).wait()
        mgr.save(2, make_state(2)).wait()
    (tmp_path / "a" / "step_000000002" / "rank_00000.safetensors").unlink()
    with CheckpointManager(tiers) as mgr:
        with pytest.warns(UserWarning, match="a/step_000000002"):
            assert same_state(mgr.restore(), make_state(2))
        (tmp_path / "b" / "step_000000002" / "rank_00000.safetensors").unlink()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert same_state(mgr.restore(), make_state(1))
        assert any("falling back to an older step" in str(w.message) for w in caught)
        assert mgr.restored_step == 1


def test_retention_per_tier(tmp_path):
    tiers = [Tier(tmp_path / "nvme", KeepLast(2)), Tier(tmp_path / "shared", KeepEvery(2) | KeepLast(1)), Tier(tmp_path / "archive", KeepAll())]
    with CheckpointManager(tiers, min_keep=3) as mgr:
        for step in range(1, 8):
            mgr.save(step, make_state(step, n=1024)).wait()
        mgr.gc()
        held = [[c.step for c in list_checkpoints(tmp_path / t)] for t in ("nvme", "shared", "archive")]
        assert held == [[6, 7], [2, 4, 6, 7], [1, 2, 3, 4, 5, 6, 7]]
        assert mgr.steps() == list(range(1, 8))
    assert not (tmp_path / "nvme" / "step_000000001").exists()  # no husk left behind


def test_min_keep_overrides_policies_with_a_warning(tmp_path):
    with CheckpointManager([Tier(tmp_path / "t0", KeepLast(1))], min_keep=3) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 6):
                mgr.save(step, make_state(step, n=256)).wait()
        assert mgr.steps() == [3, 4, 5]
        assert any("fewer than 3 valid checkpoints" in str(w.message) for w in caught)


def test_gc_plan_never_drops_the_only_copy_a_slower_tier_still_needs():
    now = 1000.0
    t0 = {1: now, 2: now, 3: now, 4: now}
    t1 = {1: now, 2: now}  # steps 3 and 4 not promoted yet
    plan = gc_plan([t0, t1], [KeepLast(1), KeepAll()], min_keep=1, now=now)
    assert plan.delete == [(0, 1), (0, 2)]  # 3 stays on tier 0 until tier 1 has it
    plan = gc_plan([t0, t1], [KeepLast(1), KeepLast(1)], min_keep=1, now=now)
    assert plan.delete == [(0, 1), (1, 1), (0, 2)]  # tier 1 would still take step 3: tier 0 keeps it
    plan = gc_plan([t0], [KeepLast(1)], min_keep=1, protected={2}, now=now)
    assert plan.delete == [(0, 1), (0, 3)]
    plan = gc_plan([{1: 0.0, 2: 900.0, 3: 990.0}], [KeepWithin(50)], min_keep=1, now=now)
    assert plan.delete == [(0, 1), (0, 2)]
    assert str(parse_retention("last:3+every:1000")) == "last:3+every:1000"
    assert parse_retention("within:2h").keep([], now) == set()
    with pytest.raises(ConfigError):
        parse_retention("sometimes")


def test_module_level_promote_and_gc(tmp_path):
    with CheckpointManager([tmp_path / "a"], min_keep=1) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, make_state(step, n=512)).wait()
    stats = promote(tmp_path / "a", tmp_path / "b", 20)
    assert stats.bytes > 0 and [c.step for c in list_checkpoints(tmp_path / "b")] == [20]
    assert gc(tmp_path / "a", "last:1", min_keep=1, dry_run=True) == [10, 20]
    assert [c.step for c in list_checkpoints(tmp_path / "a")] == [10, 20, 30]
    assert gc(tmp_path / "a", "last:1", min_keep=2) == [10]
    with CheckpointManager([tmp_path / "b"]) as mgr:
        assert same_state(mgr.restore(), make_state(20, n=512))
