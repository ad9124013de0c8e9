"""Mixtures: megatron-core's blending rule, sources of every kind, local and on S3, bad sources and weights."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tierio.data import IndexedDataset, PackedDataset, TokenWindowDataset, build_indexed, collate_packed, plan_packing
from tierio.data.blend import BlendedDataset, blending_indices
from tierio.data.loader import build_loader
from tierio.data.shards import ShardWriter
from tierio.data.streaming import StreamingDataset
from tierio.errors import ConfigError, FormatError, NotFoundError

SEQ = 8


def _corpus(path, base, tokens):
    """One document of ``tokens`` ids counting up from ``base``: window i starts with base + i*SEQ."""
    build_indexed([np.arange(base, base + tokens)], path, dtype=np.int32)
    return str(path)


def test_blending_indices_follow_megatron_core():
    # megatron-core 0.16.1: helpers_cpp.build_blending_indices(..., [0.5, 0.3, 0.2], 3, 10, False)
    source, sample = blending_indices([5, 3, 2], 10)
    assert source.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert sample.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]
    assert blending_indices([1, 1, 1], 7)[0].tolist() == [0, 1, 2, 0, 1, 2, 0]  # a tie goes to the first source
    # the blend's first n samples do not depend on its size (the rule looks back only)
    assert blending_indices([0.7, 0.1, 0.2], 50)[0].tolist() == blending_indices([0.7, 0.1, 0.2], 80)[0][:50].tolist()


def test_blending_indices_equal_megatron_core_own_helper():
    helpers = _megatron_helpers()
    rng = np.random.default_rng(29)
    ties = [np.ones(3) / 3, np.array([0.5, 0.25, 0.25]), np.array([0.25, 0.25, 0.5])]  # exact ties: first wins
    for case in range(28):
        n = int(rng.integers(1, 7))
        w = rng.random(n) * (rng.random(n) > 0.2)
        w = (w if w.sum() else np.ones(n)) / (w.sum() or n)
        w = ties[case - 25] if case >= 25 else w
        n, size = len(w), int(rng.integers(0, 4000))
        src, smp = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(src, smp, w, n, size, False)
        mine = blending_indices(w, size)
        assert (mine[0] == src).all() and (mine[1] == smp).all(), (w, size)


def _megatron_helpers():
    """megatron-core's compiled helper alone (importing megatron.core itself loads far more)."""
    import glob
    import importlib.machinery
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    found = [f for p in (spec.submodule_search_locations or []) if spec
             for f in glob.glob(f"{p}/core/datasets/helpers_cpp*.so")] if spec else []
    if not found:
        pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core)")
    loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("helpers_cpp", loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("weights", [[1, -1], [1, math.nan], [0, 0], [1, math.inf], ["x", 1]])
def test_bad_weights_are_config_errors(tmp_path, weights):
    a = _corpus(tmp_path / "a", 0, 100)
    with pytest.raises(ConfigError, match="weight"):
        BlendedDataset([a, a], weights)


def test_missing_or_damaged_source_fails_at_construction_naming_it(tmp_path):
    good = _corpus(tmp_path / "good", 0, 100)
    with pytest.raises(NotFoundError, match="blend source 'code'"):
        BlendedDataset({"web": good, "code": str(tmp_path / "nothing")}, [1, 1])
    bad = _corpus(tmp_path / "bad", 0, 100)
    with open(f"{bad}.idx", "r+b") as f:
        f.truncate(30)
    with pytest.raises(FormatError, match=f"blend source '{bad}'"):
        BlendedDataset([good, bad], [1, 1])
    with pytest.raises(ConfigError, match="world_size=1"):
        BlendedDataset([TokenWindowDataset(good, SEQ, rank=1, world_size=2)], [1])


def test_windows_blend_through_workers_states_each_source(tmp_path):
    sources = [TokenWindowDataset(_corpus(tmp_path / f"s{d}", d * 100_000, n * SEQ + 1), SEQ)
               for d, n in enumerate([300, 50, 120])]
    blend = BlendedDataset(sources, [0.5, 0.2, 0.3])
    info = {i.name: i for i in blend.sources_info()}
    assert info["source 1"].state == "exhausted" and info["source 1"].drawn == 50  # 50 / 0.2: the first to run out
    assert info["source 0"].state == info["source 2"].state == "partial" and abs(blend.size - 250) <= 3
    assert sum(i.drawn for i in info.values()) == blend.size
    one_more = BlendedDataset(sources, [0.5, 0.2, 0.3], samples=blend.size + 1).sources_info()
    assert [i.state for i in one_more] == ["partial", "upsampled", "partial"]  # the default is the largest size
    first = [int(x[0]) for x, _ in (blend[i] for i in range(len(blend)))]
    assert [f // 100_000 for f in first] == blend.source_index.tolist()
    assert [f % 100_000 // SEQ for f in first] == blend.sample_index.tolist()
    got = []
    for batch in build_loader(blend, 16, num_workers=2, drop_last=False):
        assert batch["input_ids"].shape[1] == SEQ and (batch["labels"][:, 0] == batch["input_ids"][:, 0] + 1).all()
        got += batch["input_ids"][:, 0].tolist()
    assert got == first
    bigger = BlendedDataset(sources, [0.5, 0.2, 0.3], samples=1000)
    states = {i.name: i.state for i in bigger.sources_info()}
    assert states == {"source 0": "upsampled", "source 1": "upsampled", "source 2": "upsampled"}
    again = [k for d, k in zip(bigger.source_index.tolist(), bigger.sample_index.tolist()) if d == 1]
    assert again[50:60] == list(range(50, 60))  # a source read past its end starts over from its start
    assert int(bigger[bigger.source_index.tolist().index(1, 400)][0][0]) % 100_000 < 50 * SEQ


def test_window_batches_equal_the_blend_sample_by_sample(tmp_path):
    """A batch gathers each source's windows at once (one strided view for a run of consecutive
    blend positions); every batch layout must give exactly the windows ``blend[i]`` gives."""
    sources = [TokenWindowDataset(_corpus(tmp_path / f"s{d}", d * 100_000, n * SEQ + 1), SEQ)
               for d, n in enumerate([300, 50, 120])]

    def rows(ds, idx):
        return np.stack([np.concatenate([x, y[-1:]]) for x, y in (ds[i] for i in idx)]).astype(np.int64)

    def check(ds, idx):
        got = ds.__getitems__(list(idx))
        want = rows(ds, idx)
        assert np.array_equal(got["input_ids"].numpy(), want[:, :-1]) and np.array_equal(got["labels"].numpy(), want[:, 1:])

    blend = BlendedDataset(sources, [0.5, 0.2, 0.3])
    for a in range(0, len(blend) - 40, 37):
        check(blend, range(a, a + 40))  # runs: one view per source
    check(blend, np.random.default_rng(0).permutation(len(blend))[:64].tolist())  # shuffled: no runs
    check(blend, [5, 3, 4, 6])  # consecutive positions out of order
    check(blend, [7])
    check(blend, range(len(blend) - 40, len(blend)))  # the last run
    check(sources[0], range(100, 164))  # one source's own run: a slice of its windows
    for ds in (blend, sources[0]):
        with pytest.raises(IndexError):
            ds.__getitems__(list(range(len(ds) - 3, len(ds) + 1)))  # a run past the end
    upsampled = BlendedDataset(sources, [0.5, 0.2, 0.3], samples=1000)
    for a in (0, 230, 240, 600, 936):
        check(upsampled, range(a, a + 64))  # across a source's end: its windows wrap to its start
    from tierio.data.blend import PLAN_BATCHES

    assert len(upsampled) > 2 * PLAN_BATCHES  # batches of 2 span more than one plan
    for n in (2, 7, 64):  # a sequential sampler's batches (planned PLAN_BATCHES at a time): every one,
        for ds in (blend, upsampled):  # across plans and the upsampled sources' wraps, the short last one too
            for a in range(0, len(ds), n):
                check(ds, range(a, min(a + n, len(ds))))
    resumed = BlendedDataset(sources, [0.5, 0.2, 0.3])
    resumed.resume(0, 17)
    check(resumed, range(0, 64))
    for r in range(2):
        check(BlendedDataset(sources, [0.5, 0.2, 0.3], rank=r, world_size=2), range(10, 74))


def test_blend_of_packed_datasets_composes_with_packing(tmp_path):
    packs = []
    for d in range(2):
        docs = [np.full(n, 10 * d + 1 + j % 5) for j, n in enumerate(np.random.default_rng(d).integers(3, 30, 60))]
        build_indexed(docs, tmp_path / f"p{d}", dtype=np.int32)
        ds = IndexedDataset(tmp_path / f"p{d}")
        packs.append(PackedDataset(ds, plan_packing(ds.document_lengths(), 32)))
    blend = BlendedDataset(packs, [2, 1])
    batch = collate_packed(blend.__getitems__(list(range(6))))
    assert batch["input_ids"].shape == (6, 32) and int(batch["cu_seqlens"][-1]) == 6 * 32
    for row, (d, k) in enumerate(zip(blend.source_index[:6].tolist(), blend.sample_index[:6].tolist())):
        assert (batch["input_ids"][row].numpy() == packs[d][k]["input_ids"]).all()


def test_blend_of_a_stream_on_s3_and_a_local_prefix(tmp_path, s3_url):
    with ShardWriter(s3_url, ["x"], shard_bytes=256) as w:
        for i in range(60):
            w.write({"x": np.array([1000 + i], np.int64)})
    local = str(tmp_path / "local")
    build_indexed([[k] for k in range(90)], local, dtype=np.int32)
    stream = StreamingDataset(s3_url, tmp_path / "cache", "16MiB", seed=3)
    blend = BlendedDataset([stream, IndexedDataset(local)], [0.5, 0.5], samples=200)  # the stream read in 2 epochs
    assert {i.state for i in blend.sources_info()} == {"upsampled"}
    order = [stream.rank_sample_ids(e).tolist() for e in range(2)]
    got = blend.__getitems__(list(range(len(blend))))
    for i, (d, k) in enumerate(zip(blend.source_index.tolist(), blend.sample_index.tolist())):
        if d == 0:
            assert int(got[i]["x"][0]) == 1000 + order[k // 60][k % 60]
        else:
            assert got[i].tolist() == [k % 90]  # the IndexedDataset's one document
