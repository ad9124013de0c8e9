"""Cluster checkpoints with real gloo processes: two "nodes" with their own tier 0, DTensor and
FSDP2 state, losing a node's disk, resharding restores on 1, 2, 3 and 8 ranks, DCP both ways."""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from safetensors.torch import load_file, save_file

from rank_exit import end_rank
from tierio.ckpt import CheckpointManager, KeepLast, TensorSlice, Tier, inspect, list_checkpoints, verify
from tierio.errors import ConfigError

SHAPES = {"model/w": (37, 16), "model/v": (8, 30), "model/r": (10, 4), "model/grid": (9, 10)}


def full(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))  # the same in every process
    t = torch.randn(*SHAPES[name], generator=g)
    return t.bfloat16() if name == "model/grid" else t


def tiers(root: str, rank: int, s3: str, prefix: str = "") -> list:
    return [Tier(f"{root}/{prefix}node{rank // 2}", KeepLast(2), scope="node"), Tier(f"{root}/{prefix}shared", KeepLast(3)), s3]


def dtensor_state(meshes, step: int, rank: int, fill=None) -> dict:
    """Shard(0), Shard(1), Replicate and a 2-D (Shard(0), Shard(1)) tensor, a rank's own tensor, a count."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1, mesh2 = meshes
    make = (lambda n: full(n, step)) if fill is None else (lambda n: torch.zeros_like(full(n, 0)))
    return {"model": {"w": distribute_tensor(make("model/w"), mesh1, [Shard(0)]),
                      "v": distribute_tensor(make("model/v"), mesh1, [Shard(1)]),
                      "r": distribute_tensor(make("model/r"), mesh1, [Replicate()]),
                      "grid": distribute_tensor(make("model/grid"), mesh2, [Shard(0), Shard(1)])},
            "mine": torch.full((4,), float(rank * 100 + step)), "step": step}


def fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.Linear(7, 5))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def check(got: dict, expected: dict, names) -> None:
    for name in names:
        t = got[name]
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert torch.equal(t, expected[name]), f"{name} differs"


def flat_globals(state: dict, prefix: str = "", plain: bool = False) -> dict:
    """The DTensors of a nested state by path (with ``plain``, its plain tensors too)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat_globals(v, f"{prefix}{k}/", plain))
        elif hasattr(v, "full_tensor") or (plain and isinstance(v, torch.Tensor)):
            out[f"{prefix}{k}"] = v
    return out


def _save_phase(root: str, s3: str, rank: int, meshes) -> dict:
    """Steps 2 and 3 with DTensor + FSDP2 state; the DCP save of the FSDP2 state; the expected tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import torch.distributed.checkpoint as dcp
    from tierio.ckpt.dcp import TierioWriter

    model, opt = fsdp_model(meshes[0])
    model(torch.ones(3, 12)).sum().backward()  # the same input everywhere: the same gradients
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with CheckpointManager(tiers(root, rank, s3), commit_timeout=60, node=f"node{rank // 2}") as mgr:
        assert mgr.node == f"node{rank // 2}"
        for step in (2, 3):
            h = mgr.save(step, {**dtensor_state(meshes, step, rank), "fsdp": {"model": msd, "optim": osd}})
        h.wait()
    expected = {k: v.full_tensor() for k, v in flat_globals({"fsdp": {"model": msd, "optim": osd}}).items()}
    expected.update({n: full(n, 3) for n in SHAPES})
    with CheckpointManager([Tier(f"{root}/dcp-node{rank // 2}", scope="node"), f"{root}/dcp-shared"],
                           node=f"node{rank // 2}") as dmgr:
        dcp.save({"model": msd, "optim": osd}, storage_writer=TierioWriter(dmgr, step=3))
        dmgr.wait()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in expected.items()}, f"{root}/expected.safetensors")
    dist.barrier()
    return load_file(f"{root}/expected.safetensors")


def _restore_after_losing_node1(root: str, s3: str, rank: int, meshes, expected: dict) -> None:
    if rank == 0:
        shutil.rmtree(f"{root}/node1")  # node 1's local disk is gone
    dist.barrier()
    model, opt = fsdp_model(meshes[0])
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    into = {**dtensor_state(meshes, 0, rank, fill=0), "fsdp": {"model": msd, "optim": osd}}
    with CheckpointManager(tiers(root, rank, s3), node=f"node{rank // 2}") as mgr:
        out = mgr.restore(into=into)
        assert mgr.restored_step == 3 and out["step"] == 3 and torch.equal(out["mine"], torch.full((4,), rank * 100 + 3.0))
        # each rank reads its node's copy; node 1's ranks, whose disk is gone, read the shared tier
        assert mgr.restored_from.endswith("/node0" if rank < 2 else "/shared")
        check(flat_globals(out), expected, [n for n in expected])
        assert mgr.verify(3).ok


def _reshard_on_fewer_ranks(root: str, s3: str, rank: int, expected: dict) -> None:
    """3 and 2 of the 4 processes restore, with other placements; DCP loads 4-rank FSDP2 state on 3."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torch.distributed.checkpoint as dcp
    from tierio.ckpt.dcp import TierioReader

    for world in (3, 2):
        group = dist.new_group(list(range(world)))
        mesh = DeviceMesh("cpu", list(range(world)))
        if rank >= world:
            continue
        zeros = {n: torch.zeros_like(expected[n]) for n in SHAPES}
        into = {"model": {"w": distribute_tensor(zeros["model/w"], mesh, [Shard(1)]),
                          "v": distribute_tensor(zeros["model/v"], mesh, [Shard(0)]),
                          "r": distribute_tensor(zeros["model/r"], mesh, [Shard(0)]),
                          "grid": distribute_tensor(zeros["model/grid"], mesh, [Replicate()])}}
        with CheckpointManager(tiers(root, rank, s3), process_group=group, node=f"node{rank // 2}") as mgr:
            with pytest.raises(ConfigError, match="'mine'"):  # it differs between the 4 saved ranks
                mgr.restore(into=into)
            out = mgr.restore(into=into, per_rank="own")
        check(flat_globals(out), expected, SHAPES)
        assert torch.equal(out["mine"], torch.full((4,), rank * 100 + 3.0))
        if world == 3:  # DCP's own resharding planner, reading the DCP checkpoint the 4 ranks wrote
            model, opt = fsdp_model(mesh)
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=TierioReader([Tier(f"{root}/dcp-node{rank // 2}", scope="node"), f"{root}/dcp-shared"]),
                     process_group=group)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            check(flat_globals({"fsdp": sd}), expected, [n for n in expected if n.startswith("fsdp/")])
            # and the manager restores the DCP checkpoint (its state tree is DCP's)
            with CheckpointManager([f"{root}/dcp-shared"], process_group=group) as dmgr:
                got = dmgr.restore(into={"model": get_state_dict(model, opt)[0]})
            check(flat_globals({"fsdp": got}), expected, [n for n in expected if n.startswith("fsdp/model/")])


def cluster_worker(rank: int, root: str, s3: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        meshes = (init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2)))
        expected = _save_phase(root, s3, rank, meshes)
        _restore_after_losing_node1(root, s3, rank, meshes, expected)
        dist.barrier()
        _reshard_on_fewer_ranks(root, s3, rank, expected)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank()  # the meshes keep the group's gloo threads: no teardown at the interpreter's exit


def slice_of(shape: tuple[int, ...], dim: int, rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank ``rank``'s part of ``shape`` split along ``dim`` as evenly as possible (uneven ends)."""
    n = shape[dim]
    lo, hi = n * rank // world, n * (rank + 1) // world
    offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
    return offsets, tuple(hi - lo if d == dim else s for d, s in enumerate(shape))


def eight_worker(rank: int, root: str, s3: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=8)
    try:
        expected = load_file(f"{root}/expected.safetensors")
        into: dict = {"model": {}}
        for i, name in enumerate(SHAPES):
            offsets, sizes = slice_of(SHAPES[name], i % 2, rank, 8)
            into["model"][name.split("/")[1]] = TensorSlice(torch.empty(sizes, dtype=expected[name].dtype), offsets, SHAPES[name])
        # ranks 4..7 find nothing on their node tiers: everything comes from the shared tier
        with CheckpointManager(tiers(root, rank, s3), node=f"node{rank // 2}") as mgr:
            out = mgr.restore(into=into, per_rank="own")
        for name in SHAPES:
            ts = out["model"][name.split("/")[1]]
            region = expected[name][tuple(slice(o, o + s) for o, s in zip(ts.offsets, ts.local.shape))]
            assert torch.equal(ts.local, region), name
        assert torch.equal(out["mine"], torch.full((4,), (rank if rank < 4 else 0) * 100 + 3.0))
    finally:
        dist.destroy_process_group()


def test_two_nodes_lose_a_disk_and_reshard_on_1_2_3_and_8_ranks(tmp_path, s3_url):
    root = str(tmp_path)
    tmp.start_processes(cluster_worker, args=(root, s3_url, f"file://{root}/pg4"), nprocs=4, start_method="spawn")
    assert sorted(n for n in os.listdir(tmp_path / "node0" / "step_000000003") if n.endswith(".safetensors")) == \
        ["rank_00000.safetensors", "rank_00001.safetensors"]  # a node's tier holds its own ranks' shards
    for url in (str(tmp_path / "shared"), s3_url):
        assert [c.step for c in list_checkpoints(url)] == [2, 3]
        assert verify(url, 3).ok
    man = inspect(tmp_path / "shared", 3)
    assert man.version == 2 and man.world_size == 4
    # the replicated tensor is written once, by the rank at coordinate 0 of the mesh
    assert [("model/r" in r.tensors) for r in man.ranks] == [True, False, False, False]
    tmp.start_processes(eight_worker, args=(root, s3_url, f"file://{root}/pg8"), nprocs=8, start_method="spawn")
    # one process: whole tensors (its rank-local values are those of saved rank 0, when asked for)
    expected = load_file(f"{root}/expected.safetensors")
    with CheckpointManager([tmp_path / "shared"]) as mgr:
        with pytest.raises(ConfigError, match="'mine' is rank-local"):
            mgr.restore()
        out = mgr.restore(per_rank="own")
    check(flat_globals(out, plain=True), expected, list(expected))
    assert torch.equal(out["mine"], torch.full((4,), 3.0))


def test_export_writes_a_whole_model_directory(tmp_path):
    """tierio ckpt export: global tensors of 4 ranks assembled whole, named like state_dict()."""
    from tierio.cli.main import main

    import threading

    shape = (10, 6)
    whole = torch.arange(60, dtype=torch.float32).reshape(shape)
    errors = []

    def rank(r: int) -> None:
        try:
            with CheckpointManager([tmp_path / "ckpt"], rank=r, world_size=4, run_id="export-test") as mgr:
                off, size = slice_of(shape, 1, r, 4)
                local = whole[:, off[1]: off[1] + size[1]].clone()
                mgr.save(5, {"model": {"fc.weight": TensorSlice(local, off, shape),
                                       "fc.bias": TensorSlice(torch.ones(6), (0,), (6,), write=r == 0)},
                             "optim": {"x": torch.zeros(2)}}).wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "200"]) == 0
    index = __import__("json").loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"fc.weight", "fc.bias"} and index["metadata"]["total_size"] == 264
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(str(tmp_path / "hf" / f)))
    assert torch.equal(got["fc.weight"], whole) and torch.equal(got["fc.bias"], torch.ones(6))
    assert len(set(index["weight_map"].values())) == 2  # 240 + 24 bytes, at most 200 per file
    assert not Path(tmp_path / "hf" / "optim").exists()
