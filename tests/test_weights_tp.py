"""Tensor-parallel weight loads: each rank's slices equal the whole model cut by the rules, only the
slices' bytes are read, uneven rules are refused by name; pre-sharded directories load per rank
and refuse another degree or files that do not match their index; the CLI does both."""

from __future__ import annotations

import json
import os
from datetime import timedelta
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from tierio.cli.main import main
from tierio.errors import ConfigError, IntegrityError
from tierio.weights import LoadStats, Replicate, Split, TensorParallel, load, load_into, shard_model

H, KV, HD, HID, INTER, VOCAB = 8, 2, 16, 128, 384, 256


def _model(d, fused: bool = False, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A two-layer Llama-family model (Qwen2-style q/k/v biases; Phi-3-style fused tensors with ``fused``)."""
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    t = {"model.embed_tokens.weight": r(vocab, HID), "lm_head.weight": r(vocab, HID), "model.norm.weight": torch.randn(HID)}
    for n in range(2):
        p = f"model.layers.{n}."
        if fused:
            t[p + "self_attn.qkv_proj.weight"] = r((H + 2 * KV) * HD, HID)
            t[p + "mlp.gate_up_proj.weight"] = r(2 * INTER, HID)
        else:
            for k, rows in (("q", H * HD), ("k", KV * HD), ("v", KV * HD)):
                t[p + f"self_attn.{k}_proj.weight"], t[p + f"self_attn.{k}_proj.bias"] = r(rows, HID), r(rows)
            t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = r(INTER, HID), r(INTER, HID)
        t[p + "self_attn.o_proj.weight"], t[p + "mlp.down_proj.weight"] = r(HID, H * HD), r(HID, INTER)
        t[p + "input_layernorm.weight"] = torch.randn(HID)
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(t)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in halves.items():
        save_file({n: t[n] for n in ns}, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: f for f, ns in halves.items() for n in ns}}))
    arch = "Phi3ForCausalLM" if fused else "Qwen2ForCausalLM"
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "num_attention_heads": H,
                                               "num_key_value_heads": KV, "intermediate_size": INTER}))
    return t


def _expected(t: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """The rank's slices written out by hand (Megatron layout), independent of the rules' code."""
    def rows(x, parts):  # parts: (units, rows per unit, shared) sections along dim 0, each split over the ranks
        out, at = [], 0
        for units, per_unit, shared in parts:
            if units % size == 0:
                lo, hi = rank * units // size, (rank + 1) * units // size
            else:
                assert shared and size % units == 0
                lo = rank // (size // units)
                hi = lo + 1
            out.append(x[at + lo * per_unit : at + hi * per_unit])
            at += units * per_unit
        return torch.cat(out)

    e = {}
    for name, x in t.items():
        if "gate_up_proj" in name:
            e[name] = rows(x, [(INTER, 1, False), (INTER, 1, False)])
        elif name.endswith(("embed_tokens.weight", "lm_head.weight", ".gate_proj.weight", ".up_proj.weight")):
            e[name] = rows(x, [(x.shape[0], 1, False)])
        elif ".q_proj." in name:
            e[name] = rows(x, [(H, HD, False)])
        elif ".k_proj." in name or ".v_proj." in name:
            e[name] = rows(x, [(KV, HD, True)])
        elif "qkv_proj" in name:
            e[name] = rows(x, [(H, HD, False), (KV, HD, True), (KV, HD, True)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            n = x.shape[1] // size
            e[name] = x[:, rank * n : (rank + 1) * n]
        else:
            e[name] = x
    return e


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].cpu(), want[k].contiguous()), k


def test_tp_slices_every_path_equal_the_rules_and_read_only_their_bytes(tmp_path):
    """One model per layout (q/k/v with biases; fused qkv and gate_up), every TP degree up to
    more ranks than kv heads, through every read path: mapped, private, strided pieces with gap 0,
    load_into (also into targets of another dtype); bytes read shrink with the degree."""
    for fused in (False, True):
        d = tmp_path / f"m{int(fused)}"
        t = _model(d, fused)
        full_bytes = sum(x.numel() * x.element_size() for x in t.values())
        for size in (1, 2, 4):
            for rank in range(size):
                want = _expected(t, rank, size)
                spec = TensorParallel(rank, size)
                st = LoadStats()
                _same(load(d, shard=spec), want)
                _same(load(d, shard=spec, mapped=False), want)
                _same(load(d, shard=spec, slice_gap_bytes=0, mapped=False, stats=st), want)
                into = {k: torch.zeros_like(v) for k, v in want.items()}
                into["lm_head.weight"] = into["lm_head.weight"].float()  # staged and converted
                res = load_into(into, d, shard=spec, slice_gap_bytes=0)
                assert sorted(res.loaded) == sorted(want)
                _same({k: v.to(want[k].dtype) for k, v in into.items()}, want)
                if size == 4:
                    assert st.bytes < 0.6 * full_bytes, (st.bytes, full_bytes)  # rows below a page are read whole
                    assert st.extra["tp"] == f"rank {rank} of 4"
    # exact pieces: a dim-1 slice of rows longer than pages reads its pieces only (page-granular)
    wide = torch.randn(64, 8192).to(torch.bfloat16)
    save_file({"w": wide}, str(tmp_path / "wide.safetensors"))
    for gap, most in ((0, 0.3), (None, 1.01)):
        exact = LoadStats()
        got = load(tmp_path / "wide.safetensors", shard=TensorParallel(2, 4, [("w", Split(1))]), slice_gap_bytes=gap,
                   stats=exact, dtype=torch.float32)
        assert torch.equal(got["w"], wide[:, 4096:6144].float()) and exact.bytes <= most * wide.numel() * 2
    # explicit rules, DTensor placements among them; unmatched tensors are replicated (t: the fused model)
    rules = [(r"o_proj\.weight$", DShard(1)), (r"embed_tokens", Split(0)), (r"norm", DReplicate()), (r"lm_head", Replicate())]
    got = load(tmp_path / "m1", shard=TensorParallel(3, 4, rules))
    assert torch.equal(got["model.layers.1.self_attn.o_proj.weight"], t["model.layers.1.self_attn.o_proj.weight"][:, 96:])
    assert torch.equal(got["model.embed_tokens.weight"], t["model.embed_tokens.weight"][192:])
    assert got["lm_head.weight"].shape == (VOCAB, HID) and got["model.layers.0.mlp.down_proj.weight"].shape == (HID, INTER)


def test_rules_that_do_not_fit_are_config_errors_naming_tensor_and_shape(tmp_path):
    d = tmp_path / "odd"
    _model(d, vocab=250)
    with pytest.raises(ConfigError, match=r"'(lm_head|model.embed_tokens).weight' of shape \[250, 128\].*do not split evenly over 4"):
        load(d, shard=TensorParallel(0, 4))
    with pytest.raises(ConfigError, match=r"q_proj.weight' of shape \[128, 128\].*8 units.*over 3"):
        load(d, shard=TensorParallel(0, 3, [(r"q_proj\.weight$", Split(0, (H,)))]))
    with pytest.raises(ConfigError, match="dimension 1 needs 2 dimensions"):
        load(d, shard=TensorParallel(0, 2, [(r"norm", Split(1))]))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ConfigError, match="no tensor-parallel preset for architectures.*rules="):
        load(d, shard=TensorParallel(0, 2))
    (d / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": "2"}))
    with pytest.raises(ConfigError, match="'num_key_value_heads' is '2'"):
        load(d, shard=TensorParallel(0, 2))
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load(d, shard=TensorParallel(0, 2))
    with pytest.raises(ConfigError, match="rank 2 of 2"):
        TensorParallel(2, 2)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_presharded_directory_loads_each_rank_and_refuses_what_does_not_match(tmp_path, capsys):
    d, out = tmp_path / "m", tmp_path / "tp2"
    t = _model(d)
    rc, text, _ = _cli(capsys, "weights", "shard", str(d), str(out), "--tp", "2", "--json")
    assert rc == 0 and json.loads(text)["tp"] == 2
    index = json.loads((out / "tierio-tp.json").read_text())
    assert index["tp"] == 2 and set(index["source"]["files"]) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    for rank in range(2):
        st = LoadStats()
        got = load(out, shard=TensorParallel(rank, 2), stats=st)
        _same(got, _expected(t, rank, 2))
        own = out / f"tp-rank-{rank:05d}-of-00002.safetensors"
        assert st.bytes == own.stat().st_size and "pre-sharded" in st.extra["tp"]  # its own file only
        into = {k: torch.empty_like(v) for k, v in got.items()}
        load_into(into, out, shard=TensorParallel(rank, 2))
        _same(into, got)
    rc, text, _ = _cli(capsys, "weights", "load", str(out), "--tp", "2", "--rank", "1", "--json")
    assert rc == 0 and json.loads(text)["loaded_tensors"] == len(t)
    rc, text, _ = _cli(capsys, "weights", "load", str(d), "--tp", "4", "--rank", "3", "--json")
    assert rc == 0 and json.loads(text)["extra"]["tp"] == "rank 3 of 4"

    with pytest.raises(ConfigError, match="pre-sharded for 2 tensor-parallel ranks, not 4: re-shard.*--tp 4"):
        load(out, shard=TensorParallel(0, 4))
    rc, _, err = _cli(capsys, "weights", "load", str(out), "--tp", "4")
    assert rc != 0 and "re-shard" in err
    with pytest.raises(ConfigError, match="tierio-tp.json: the directory is pre-sharded"):
        load(out)
    # files swapped between ranks: each names its rank and source in its metadata
    bad = tmp_path / "swapped"
    shutil.copytree(out, bad)
    a, b = bad / "tp-rank-00000-of-00002.safetensors", bad / "tp-rank-00001-of-00002.safetensors"
    a.rename(bad / "x")
    b.rename(a)
    (bad / "x").rename(b)
    with pytest.raises(IntegrityError, match=r"tp-rank-00000-of-00002.safetensors (is \d+ bytes but the index|does not match)"):
        load(bad, shard=TensorParallel(0, 2))
    # a file cut from another model: same size, other source digest
    other = tmp_path / "other"
    shard_model(d, other, 2)
    idx = json.loads((other / "tierio-tp.json").read_text())
    idx["source"]["digest"] = "0" * 16
    (other / "tierio-tp.json").write_text(json.dumps(idx))
    with pytest.raises(IntegrityError, match="tp-rank-00001-of-00002.safetensors does not match the index.*tierio.tp.source"):
        load(other, shard=TensorParallel(1, 2))
    # bytes changed in place: the window's xxh3 names the file
    victim = out / "tp-rank-00001-of-00002.safetensors"
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) - 3)
        f.write(b"\x7f\x7f\x7f")
    with pytest.raises(IntegrityError, match="pre-sharded .*tp-rank-00001-of-00002.safetensors bytes .* fail their checksum"):
        load(out, shard=TensorParallel(1, 2), mapped=False)
    victim.unlink()
    with pytest.raises(IntegrityError, match="tp-rank-00001-of-00002.safetensors is missing"):
        load(out, shard=TensorParallel(1, 2))
    assert load_file(str(out / "tp-rank-00000-of-00002.safetensors"))  # rank files are plain safetensors


def _mesh_check(rank: int, root: str) -> bool:
    """On a 2-rank device mesh: the rank's slices, pre-sharded or not, reassemble as DTensors placed
    by the rules into the whole tensors (the slices follow the DTensor placements)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    import tierio.weights as weights

    sub = dist.new_group([0, 1])
    if rank >= 2:
        return True
    mesh = DeviceMesh.from_group(sub, "cpu")
    spec = weights.TensorParallel.from_mesh(mesh)
    assert (spec.rank, spec.size) == (rank, 2)
    whole = {**load_file(os.path.join(root, "m", "model-00001-of-00002.safetensors")),
             **load_file(os.path.join(root, "m", "model-00002-of-00002.safetensors"))}
    rules = weights.tp.llama_rules({"num_attention_heads": H, "num_key_value_heads": KV})
    for source in ("m", "tp2"):
        for name, local in weights.load(os.path.join(root, source), shard=spec).items():
            take = TensorParallel(rank, 2, rules).take(name, tuple(whole[name].shape))
            placement = DReplicate() if take is None else DShard(take.dim)
            full = DTensor.from_local(local, mesh, [placement], run_check=False).full_tensor()
            assert torch.equal(full, whole[name]), (source, name)
    return True


def _group_worker(rank: int, root: str, init: str, out: str) -> None:
    """A rank of a 3-way gloo group: a cooperative load of every tensor and of TP slices, each
    rank reading about a third of the bytes; TP slices on a device mesh of two of the ranks; then
    rank 2 dies by SIGKILL in a cooperative load, and the other two load again without it."""
    import signal

    import tierio.weights as weights
    from tierio.errors import GroupError

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=timedelta(seconds=60))
    result: dict = {}
    try:
        d = os.path.join(root, "m")
        st = weights.LoadStats()
        got = weights.load_group(d, stats=st, chunk_bytes="64KiB")
        result["whole_ok"] = sorted(got) == sorted(load(d)) and all(torch.equal(got[k], v) for k, v in load(d).items())
        result["bytes"] = st.bytes
        spec = TensorParallel(rank % 2, 2)
        got = weights.load_group(d, shard=spec, chunk_bytes="64KiB")
        want = load(d, shard=spec)
        result["tp_ok"] = sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
        result["mesh_ok"] = _mesh_check(rank, root)
        dist.barrier()

        def die(done: int, total: int) -> None:
            if rank == 2 and done > 0:
                os.kill(os.getpid(), signal.SIGKILL)

        try:
            weights.load_group(d, chunk_bytes="64KiB", progress=die)
        except GroupError as exc:
            result["error"] = str(exc)
        # the survivors start again without the dead rank, as the error says to
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=init + "-again", rank=rank, world_size=2, timeout=timedelta(seconds=60))
        again = weights.load_group(d, chunk_bytes="64KiB")
        result["retry_ok"] = all(torch.equal(again[k], v) for k, v in load(d).items())
    except Exception:  # reported by the test, which reads the file
        import traceback
        result["unexpected"] = traceback.format_exc()[-1500:]
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        os._exit(0)  # the group lost a rank: no collective teardown


def test_gloo_group_load_reads_each_byte_once_mesh_slices_reassemble_and_a_killed_rank_is_named(tmp_path):
    import multiprocessing as mp

    t = _model(tmp_path / "m")
    shard_model(tmp_path / "m", tmp_path / "tp2", 2)
    stream = sum(x.numel() * x.element_size() for x in t.values())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_group_worker, args=(r, str(tmp_path), f"file://{tmp_path}/pg", str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0, -9]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["whole_ok"] and r["tp_ok"] and r["mesh_ok"]
        assert r["bytes"] <= stream / 3 + 64 * 1024  # its third of the windows, no more
        assert "rank(s) [2] of the group stopped answering" in r["error"] and r["retry_ok"]
