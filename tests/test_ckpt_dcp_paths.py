"""DCP the way its users call it: ``TierioWriter(path)`` / ``TierioReader(path)`` as FileSystemWriter and
FileSystemReader take a path, ``checkpoint_id`` as a path or a step, and a writer that builds, owns and
closes its CheckpointManager, on one process and on two real gloo ranks."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp

from rank_exit import end_rank
from tierio.ckpt import CheckpointManager, list_checkpoints, verify
from tierio.ckpt.dcp import TierioReader, TierioWriter, place_of
from tierio.errors import ConfigError

W = torch.arange(60, dtype=torch.float32).reshape(10, 6)


def state(scale: float = 1.0) -> dict:
    return {"model": {"w": W * scale, "b": torch.ones(3, dtype=torch.bfloat16)}, "step": int(scale)}


def empty() -> dict:
    return {"model": {"w": torch.zeros(10, 6), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP warns that it runs without a process group
        yield


def test_checkpoint_ids_name_a_step_a_tier_or_a_step_in_a_tier():
    assert place_of(100) == (None, 100)
    assert place_of("step_000000100") == (None, 100)
    assert place_of("/ckpt/run1") == ("/ckpt/run1", None)
    assert place_of("/ckpt/run1/step_000000007/") == ("/ckpt/run1", 7)
    assert place_of("s3://bucket/run/step_000000003") == ("s3://bucket/run", 3)
    with pytest.raises(ConfigError, match="neither a step number nor a path"):
        place_of(3.5)


def test_a_writer_given_paths_builds_promotes_and_closes_its_manager(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with TierioWriter([str(a), b]) as writer:
        dcp.save(state(1), storage_writer=writer, checkpoint_id=10, no_dist=True)
        dcp.save(state(2), storage_writer=writer, checkpoint_id=str(a / "step_000000020"), no_dist=True)
        owned = writer.manager
    with pytest.raises(ConfigError, match="closed"):  # closed with the writer, after promoting both steps
        owned.save(30, state())
    assert [c.step for c in list_checkpoints(b)] == [10, 20] and verify(b, 20).ok
    got = empty()
    dcp.load(got, storage_reader=TierioReader(), checkpoint_id=str(b / "step_000000010"), no_dist=True)
    assert torch.equal(got["model"]["w"], W) and got["step"] == 1
    got = empty()
    dcp.load(got, storage_reader=TierioReader(str(a)), no_dist=True)  # the latest step
    assert torch.equal(got["model"]["w"], W * 2) and got["step"] == 2


def test_a_checkpoint_id_path_alone_names_the_tier(tmp_path):
    writer = TierioWriter(step=5)
    dcp.save(state(3), storage_writer=writer, checkpoint_id=str(tmp_path / "run"), no_dist=True)
    writer.close()
    with CheckpointManager([tmp_path / "run"]) as mgr:
        assert mgr.steps() == [5] and torch.equal(mgr.restore()["model"]["w"], W * 3)


def test_what_a_writer_or_reader_cannot_take_is_a_config_error_that_says_what_it_takes(tmp_path):
    for bad in (42, [str(tmp_path), 3.5], {"dir": str(tmp_path)}):
        with pytest.raises(ConfigError, match="takes a CheckpointManager, a path or URL"):
            TierioWriter(bad)
        with pytest.raises(ConfigError, match="takes a CheckpointManager, a path or URL"):
            TierioReader(bad)
    with pytest.raises(BaseException, match="TierioWriter has no tiers"):
        dcp.save(state(), storage_writer=TierioWriter(), checkpoint_id=1, no_dist=True)
    with CheckpointManager([tmp_path / "mine"]) as mgr:
        with pytest.raises(ConfigError, match="uses that manager's options"):
            TierioWriter(mgr, memory_budget_bytes="1GiB")
        with pytest.raises(BaseException, match="outside this writer's tiers"):
            dcp.save(state(), storage_writer=TierioWriter(mgr), checkpoint_id=str(tmp_path / "other" / "step_000000001"),
                     no_dist=True)
        assert mgr.steps() == []
    assert not (tmp_path / "other").exists()


def _two_ranks(rank: int, root: str, init: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sd = {"w": distribute_tensor(W.clone(), mesh, [Shard(0)]), "n": 7}
        with TierioWriter([f"{root}/node", f"{root}/shared"]) as writer:  # each rank builds its manager on the world
            dcp.save(sd, storage_writer=writer, checkpoint_id=4)
            assert writer.manager.world_size == 2
        got = {"w": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]), "n": 0}
        dcp.load(got, storage_reader=TierioReader(), checkpoint_id=f"{root}/shared/step_000000004")
        assert torch.equal(got["w"].full_tensor(), W) and got["n"] == 7
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank()  # the mesh keeps the group's gloo threads: no teardown at the interpreter's exit


def test_two_gloo_ranks_save_and_load_through_paths(tmp_path):
    root = str(tmp_path)
    tmp.start_processes(_two_ranks, args=(root, f"file://{root}/pg"), nprocs=2, start_method="spawn")
    assert sorted(n for n in os.listdir(tmp_path / "shared" / "step_000000004") if n.endswith(".safetensors")) == \
        ["rank_00000.safetensors", "rank_00001.safetensors"]  # each rank wrote its own shard
    with CheckpointManager([tmp_path / "shared"]) as mgr:  # an ordinary tierio checkpoint, restored whole on 1 rank
        assert torch.equal(mgr.restore(4)["w"], W)
