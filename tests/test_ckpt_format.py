"""Checkpoint format: bit-exact round trips and a strict reader facing hostile or damaged copies."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tierio.ckpt import CheckpointManager, inspect, list_checkpoints, rng_state, set_rng_state, verify
from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError
from tierio.format.manifest import parse_manifest
from tierio.format.safetensors import _ST_TO_TORCH
from tierio.format.statetree import flatten, unflatten

ALL_DTYPES = list(_ST_TO_TORCH.values())


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view that compares bit for bit (nan payloads, -0.0 and float8 included)."""
    t = t.contiguous()
    if t.numel() == 0:
        return t.reshape(-1).view(torch.uint8) if t.dtype.itemsize == 1 else t.reshape(-1).view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    n = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def roundtrip(tmp_path: Path, state, **kw):
    with CheckpointManager([tmp_path / "t0"], **kw) as mgr:
        mgr.save(1, state).wait()
        return mgr.restore()


def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {}
    for dt in ALL_DTYPES:
        name = str(dt).removeprefix("torch.")
        state[name] = random_tensor(dt, (7, 5), gen)
        state[name + "_0d"] = random_tensor(dt, (), gen)
        state[name + "_empty"] = torch.empty((0, 3), dtype=dt)
    base = torch.randn(6, 8, generator=gen)
    state["noncontig_t"] = base.t()
    state["noncontig_slice"] = base[::2, 1::3]
    state["bf16_expanded"] = torch.randn(1, 4, generator=gen).bfloat16().expand(3, 4)
    out = roundtrip(tmp_path, state)
    assert set(out) == set(state)
    for k, v in state.items():
        assert same(v, out[k]), k


def test_nested_trees_rng_and_json_leaves(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    state = {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "rng": rng_state(), "step": 12, "extras": {"loss": [1.5, float("inf"), -0.0], "name": "run", "none": None,
                                                     "t": (1, (2, "x")), "b": b"\x00\xff", "np": np.float32(2.5),
                                                     "arr": np.arange(6, dtype=np.int16).reshape(2, 3), "dt": torch.bfloat16},
    }
    expect_random = (random.random(), np.random.rand(), torch.rand(1))
    out = roundtrip(tmp_path, state)
    for k, v in model.state_dict().items():
        assert same(v, out["model"][k])
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(out["optimizer"])  # int keys, param_groups and step tensors come back usable
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert out["scheduler"] == sched.state_dict()
    set_rng_state(out["rng"])
    assert (random.random(), np.random.rand()) == expect_random[:2] and torch.equal(torch.rand(1), expect_random[2])
    e = out["extras"]
    assert e["loss"][0] == 1.5 and e["loss"][1] == float("inf") and str(e["loss"][2]) == "-0.0"
    assert e["t"] == (1, (2, "x")) and e["b"] == b"\x00\xff" and e["none"] is None and e["dt"] is torch.bfloat16
    assert e["np"] == np.float32(2.5) and isinstance(e["np"], np.float32)
    assert isinstance(e["arr"], np.ndarray) and e["arr"].dtype == np.int16 and (e["arr"] == state["extras"]["arr"]).all()


def test_tied_weights_stored_once_and_restored_shared(tmp_path):
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    state = {"emb": emb.state_dict(), "head": head.state_dict()}
    flat = flatten(state)
    assert len(flat.tensors) == 1
    out = roundtrip(tmp_path, state)
    assert out["emb"]["weight"] is out["head"]["weight"]
    assert same(out["emb"]["weight"], emb.weight.detach())


def test_restore_into_fills_tensors_in_place(tmp_path):
    src = torch.nn.Linear(32, 16)
    dst = torch.nn.Linear(32, 16)
    ptr = dst.weight.data_ptr()
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        mgr.save(3, {"model": src.state_dict(), "step": 3}).wait()
        out = mgr.restore(into={"model": dst.state_dict()})
    assert out["step"] == 3
    assert dst.weight.data_ptr() == ptr and torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    assert out["model"]["weight"].data_ptr() == ptr
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        with pytest.raises(ConfigError, match="shape"):
            mgr.restore(into={"model": torch.nn.Linear(8, 8).state_dict()})


def test_shard_is_a_valid_safetensors_file(tmp_path):
    state = {"a": torch.randn(3, 4), "b": torch.randn(5).bfloat16(), "c": torch.arange(7, dtype=torch.int64)}
    roundtrip(tmp_path, state)
    shard = tmp_path / "t0" / "step_000000001" / "rank_00000.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        assert set(f.keys()) == {"a", "b", "c"}
        for k in f.keys():
            assert same(f.get_tensor(k), state[k])
        assert f.metadata()["format"] == "tierio"


def test_unpicklable_objects_are_refused_clearly(tmp_path):
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        with pytest.raises(ConfigError, match="without pickle"):
            mgr.save(1, {"bad": object()})
        assert mgr.steps() == []


# -- hostile and damaged copies -----------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    gen = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen).half(), "step": 1}
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        mgr.save(1, state).wait()
    d = tmp_path / "t0" / "step_000000001"
    return tmp_path, d, state


def _edit_manifest(d: Path, fn) -> None:
    doc = json.loads((d / "manifest.json").read_text())
    fn(doc)
    (d / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m["ranks"][0].__setitem__("file", "../x"), "not a plain name"),
        (lambda m: m["ranks"][0].__setitem__("file", "/etc/passwd"), "not a plain name"),
        (lambda m: m["ranks"][0]["tensors"]["w"]["chunks"][0].__setitem__("file", "../../x"), "not a plain name"),
        (lambda m: m["ranks"][0]["tensors"]["w"].__setitem__("shape", [2**40, 2**40]), "absurd|exceed"),
        (lambda m: m["ranks"][0]["tensors"]["w"]["chunks"][0].__setitem__("range", [0, 2**62]), "expected an integer|outside"),
        (lambda m: m["ranks"][0]["tensors"]["w"].__setitem__("dtype", "F128"), "unknown dtype"),
        (lambda m: m["ranks"][0]["tensors"]["b"]["chunks"][0].__setitem__(
            "range", m["ranks"][0]["tensors"]["w"]["chunks"][0]["range"][:1] + [m["ranks"][0]["tensors"]["w"]["chunks"][0]["range"][0] + 64]),
         "overlap"),
        (lambda m: m.__setitem__("version", 99), "version"),
        (lambda m: m["ranks"][0]["tree"].__setitem__("x", {"__tensor__": "nope"}), "does not describe"),
        (lambda m: m["ranks"][0]["tensors"]["w"]["chunks"][0].__setitem__("xxh3", "zz"), "hex"),
    ],
)
def test_hostile_manifest_is_rejected(saved, edit, match):
    tmp_path, d, _ = saved
    _edit_manifest(d, edit)
    with pytest.raises(FormatError, match=match):
        inspect(tmp_path / "t0", 1)
    report = verify(tmp_path / "t0", 1)
    assert not report.ok and report.problems[0].file.endswith("manifest.json")
    with CheckpointManager([tmp_path / "t0"]) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(IntegrityError, match="no valid copy"):
            mgr.restore(1)


def test_garbled_and_oversized_manifest(saved):
    tmp_path, d, _ = saved
    (d / "manifest.json").write_bytes(b'{"schema": "tierio.checkpoint", "version": 1, "st')
    with pytest.raises(FormatError, match="not valid JSON"):
        inspect(tmp_path / "t0", 1)
    with pytest.raises(FormatError, match="limit"):
        parse_manifest(b" " * (65 << 20), "big.json")
    with pytest.raises(FormatError):
        parse_manifest(b"[" * 100000 + b"]" * 100000, "deep.json")


def test_flipped_byte_is_named_by_file_and_chunk(saved):
    tmp_path, d, _ = saved
    shard = d / "rank_00000.safetensors"
    man = inspect(tmp_path / "t0", 1)
    c = man.ranks[0].tensors["w"].chunks[0]
    raw = bytearray(shard.read_bytes())
    raw[c.begin + 100] ^= 0x01
    shard.write_bytes(bytes(raw))
    report = verify(tmp_path / "t0", 1)
    assert not report.ok
    (p,) = report.problems
    assert p.file == "step_000000001/rank_00000.safetensors" and "'w' chunk 0" in p.chunk and "checksum" in p.message
    with CheckpointManager([tmp_path / "t0"]) as mgr, pytest.warns(UserWarning, match="rank_00000.safetensors"):
        with pytest.raises(IntegrityError, match="checksum mismatch"):
            mgr.restore(1)


def test_truncated_and_missing_shard(saved):
    tmp_path, d, _ = saved
    shard = d / "rank_00000.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    report = verify(tmp_path / "t0", 1)
    assert not report.ok and "truncated" in report.problems[0].message
    shard.unlink()
    report = verify(tmp_path / "t0", 1)
    assert not report.ok and report.problems[0].message == "shard file is missing"
    with CheckpointManager([tmp_path / "t0"]) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(IntegrityError, match="rank_00000.safetensors"):
            mgr.restore(1)


def test_missing_manifest_is_not_a_checkpoint(saved):
    tmp_path, d, _ = saved
    (d / "manifest.json").unlink()
    assert list_checkpoints(tmp_path / "t0") == []
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        assert mgr.steps() == [] and mgr.latest() is None
        with pytest.raises(NotFoundError):
            mgr.restore()
    report = verify(tmp_path / "t0", 1)
    assert not report.ok and "uncommitted" in report.problems[0].message


def test_corrupt_fast_copy_falls_back_to_next_tier(tmp_path):
    state = {"w": torch.randn(128, 64)}
    with CheckpointManager([tmp_path / "a", tmp_path / "b"]) as mgr:
        mgr.save(5, state).wait()
    shard = tmp_path / "a" / "step_000000005" / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with CheckpointManager([tmp_path / "a", tmp_path / "b"]) as mgr:
        with pytest.warns(UserWarning, match=r"/a/step_000000005/rank_00000.safetensors"):
            out = mgr.restore()
        assert torch.equal(out["w"], state["w"])
        report = mgr.verify(5)
        assert report.copies == {mgr.tiers[0]: "bad", mgr.tiers[1]: "ok"}


def test_statetree_rejects_malformed_markers():
    for tree in ({"__tuple__": 5}, {"__dict__": [[1]]}, {"__dtype__": "nonsense"}, {"__bytes__": "!!"},
                 {"__tensor__": "x", "other": 1}, {"__np__": ["O", 1]}):
        with pytest.raises(FormatError):
            unflatten(tree, lambda n, t: torch.empty(0))


def test_unstaged_shard_bytes_match_the_staged_shard():
    """A synchronous DCP save writes straight from the tensors (ShardBytes): the bytes written and
    every chunk's checksum equal those of the staged shard, for every dtype, empty and 0-d tensors."""
    from tierio.format.shard import ShardBytes, describe, plan_shard, stage_into

    tensors = {"f32": torch.randn(5, 3), "bf16": torch.randn(7).to(torch.bfloat16), "empty": torch.zeros(0, 4),
               "scalar": torch.tensor(3, dtype=torch.int64), "flag": torch.tensor([True, False, True]),
               "grad": torch.randn(4, requires_grad=True), "u8": torch.arange(9, dtype=torch.uint8)}
    layout = plan_shard(tensors, {"k": "v"}, chunk_bytes=16)  # several chunks per tensor
    staged = torch.empty(layout.total_bytes, dtype=torch.uint8)
    stage_into(layout, tensors, staged)
    direct = ShardBytes(layout, tensors)
    assert b"".join(bytes(p) for p in direct.parts) == staged.numpy().tobytes()
    view = memoryview(staged.numpy()).cast("B")
    assert describe(layout, direct, "f") == describe(layout, view, "f")
    with pytest.raises(FormatError, match="'t'"):
        ShardBytes(plan_shard({"t": torch.randn(3, 4).t()}), {"t": torch.randn(3, 4).t()})
