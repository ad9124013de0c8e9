"""Replicated (data-parallel) state written once overall and spread evenly over the ranks, with real
gloo ranks: four ranks save, every byte is written by one rank and no rank writes much more than a
quarter; the checkpoint restores bit-exact on one rank and on two."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tierio.ckpt import CheckpointManager, inspect
from tierio.ckpt.replicated import SPLIT_MIN_BYTES, plan, spread


def replicated_state() -> dict:
    """The same values in every process, as DDP's all-reduce leaves them: seeded gradients and an
    Adam step, all element-wise. A forward and backward pass would go through MKL, whose sums may
    differ in the last bits between processes on a loaded machine (it was seen to)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 333),
                                torch.nn.LayerNorm(333))
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}


def _save(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        state = replicated_state()
        with CheckpointManager([root]) as mgr:
            mgr.save(1, spread(state)).wait()
        torch.save(state, f"{root}-saved-{rank}.pt")  # what this rank saved: the test's reference
    finally:
        dist.destroy_process_group()


def _restore(rank: int, root: str, init: str, saved: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        ref = torch.load(saved)["model"]  # what the saving ranks saved, not a recomputation here
        into = {"model": {k: torch.zeros_like(v) for k, v in ref.items()}}
        with CheckpointManager([root]) as mgr:
            got = mgr.restore(1, into=into)
        wrong = [k for k, v in ref.items() if not torch.equal(got["model"][k], v)]
        assert not wrong, f"rank {rank}: restored != saved for {wrong}"
    finally:
        dist.destroy_process_group()


def test_four_ranks_write_a_replicated_state_once_spread_evenly_and_it_restores_anywhere(tmp_path):
    root = str(tmp_path / "ckpt")
    tmp.start_processes(_save, args=(root, f"file://{tmp_path}/pg4"), nprocs=4, start_method="spawn")
    saved = [torch.load(f"{root}-saved-{r}.pt") for r in range(4)]
    state = saved[0]
    for r, other in enumerate(saved[1:], 1):  # replicated state: every rank held the same values
        assert all(torch.equal(other["model"][k], v) for k, v in state["model"].items()), f"rank {r} saved other values"
    tensors: list[torch.Tensor] = []
    for part in (state["model"].values(), *[s.values() for s in state["optim"]["state"].values()]):
        tensors += [t for t in part if isinstance(t, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    man = inspect(root, 1)
    written = [sum(t.nbytes for t in r.tensors.values()) for r in man.ranks]
    assert sum(written) <= 1.01 * total  # once overall
    assert max(written) <= 1.1 * total / 4, written  # about a quarter each
    with CheckpointManager([root]) as mgr:  # one rank: whole tensors
        got = mgr.restore(1)
    assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
    assert got["epoch"] == 3 and torch.equal(got["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    tmp.start_processes(_restore, args=(root, f"file://{tmp_path}/pg2", f"{root}-saved-0.pt"), nprocs=2,
                        start_method="spawn")


def test_the_plan_cuts_large_tensors_in_row_blocks_and_balances_the_small_ones():
    big = ((4096, 64), 4096 * 64 * 4)
    small = [((10,), 40), ((7, 3), 84), ((), 8), ((5,), 20)]
    got = plan([big, *small], 4)
    assert got[0] == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    assert sorted(got[1:]) == [0, 1, 2, 3]  # four small tensors, one a rank
    assert plan([big], 1) == [0] and big[1] >= SPLIT_MIN_BYTES


def test_tied_weights_are_one_slice_stored_once(tmp_path) -> None:
    from tierio.format.statetree import flatten

    big = torch.randn(1024, 512)  # 2 MiB: cut into row blocks
    state = {"wte": big, "lm_head": big.view(1024, 512), "bias": torch.zeros(8)}  # a view: another object, same memory
    for rank in range(2):
        part = spread(state, rank=rank, world_size=2)
        assert part["wte"] is part["lm_head"]
        flat = flatten(part)
        assert sorted(flat.globals) == ["bias", "wte"]  # one global tensor for the two names
        assert flat.tree["lm_head"] == flat.tree["wte"] == {"__global__": "wte"}
