"""The compact columns container: layout, batches, checksummed windows, hostile manifests, export,
writing to S3, and the bounds on what a forged manifest can make a reader allocate or read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_fuzz_parsers import FUZZ, mutated, only_typed_errors
from tierio.data.columns import ALIGN, ColumnShard
from tierio.data.export import export_dataset
from tierio.data.loader import StatefulLoader, build_loader, loader_settings
from tierio.data.shards import MANIFEST, ShardWriter, iter_tar_samples, load_manifest, parse_manifest
from tierio.data.streaming import StreamingDataset
from tierio.errors import ConfigError, FormatError, IntegrityError, TierioError
from tierio.storage import open_store

N = 300


def _sample(i: int) -> dict[str, np.ndarray]:
    return {"tokens": np.full(8, i, np.uint16), "label": np.int64(i), "doc": np.arange(i % 5, dtype=np.int32) + i}


def _write(url: str, n: int = N, shard_size: int = 1024, **kw) -> None:
    with ShardWriter(url, ["tokens", "label", "doc"], shard_bytes=shard_size, meta={"kind": "test"}, **kw) as w:
        for i in range(n):
            w.write(_sample(i))


@pytest.fixture
def url(tmp_path) -> str:
    u = f"file://{tmp_path / 'ds'}"
    _write(u)
    return u


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


# -- layout --------------------------------------------------------------------------------------
def test_a_columns_shard_is_its_raw_bytes_and_the_manifest_says_where_they_are(tmp_path, url):
    man = load_manifest(url)
    assert man.container == "columns" and len(man.shards) > 5 and man.num_samples == N
    types = {t.name: t for t in man.types}
    assert not types["tokens"].variable and types["tokens"].shape == (8,) and types["tokens"].dtype == np.uint16
    assert not types["label"].variable and types["label"].shape == ()
    assert types["doc"].variable and types["doc"].shape == ()
    for info in man.shards:
        n = info.samples
        raw = n * (16 + 8) + 4 * sum((i % 5) for i in range(info.first_sample, info.first_sample + n)) + 8 * (n + 1)
        assert raw <= info.size <= raw + 3 * ALIGN  # padding only: no header, no per-sample framing
        assert len(info.windows) == 1 and info.key.endswith(".cols")
    first = man.shards[0]
    shard = ColumnShard((tmp_path / "ds" / first.key).read_bytes(), man.layout(0), first.key)
    assert [int(x) for x in shard.fixed["label"]] == list(range(first.samples))


def test_batches_are_gathered_whole_and_equal_the_samples(url):
    per_sample = list(StreamingDataset(url, None, seed=3, shuffle_buffer=40, batch_size=16))
    batches = list(StreamingDataset(url, None, seed=3, shuffle_buffer=40, batch_size=16).iter_batches())
    assert sum(len(b["label"]) for b in batches) == N and len(batches) == -(-N // 16)
    flat = [int(x) for b in batches for x in b["label"]]
    assert flat == [int(s["label"]) for s in per_sample] and sorted(flat) == list(range(N))
    for b in batches:
        assert b["tokens"].shape == (len(b["label"]), 8) and b["tokens"].flags.writeable
        assert all((b["tokens"][k] == i).all() and (d == np.arange(i % 5) + i).all()
                   for k, (i, d) in enumerate(zip(b["label"].tolist(), b["doc"])))
    # in order and without copies, a batch inside one shard is a view of the shard's mapping
    plain = StreamingDataset(url, None, shuffle=False, batch_size=4, copy=False)
    first = next(plain.iter_batches())
    assert not first["tokens"].flags.writeable and [int(x) for x in first["label"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_hands_over_whole_batches_with_and_without_workers(tmp_path, url, workers):
    def make():
        return StreamingDataset(url, tmp_path / "cache", "8MiB", seed=5, shuffle_buffer=32, batch_size=8)

    order = make().rank_sample_ids(0).tolist()
    loader = StatefulLoader(make(), 8, num_workers=workers)
    got = []
    for b in loader:
        assert isinstance(b["tokens"], torch.Tensor) and b["tokens"].dtype == torch.uint16
        assert isinstance(b["doc"], list) and all(isinstance(d, torch.Tensor) for d in b["doc"])
        assert (b["tokens"][:, 0].long() == b["label"]).all()
        got += b["label"].tolist()
    assert got == order[: len(order) // 8 * 8]  # drop_last: the short batch is dropped
    assert loader.state_dict()["epoch"] == 1


def test_a_field_that_changes_length_later_is_variable_for_the_whole_dataset(tmp_path):
    u = f"file://{tmp_path / 'ds'}"
    with ShardWriter(u, ["x"], shard_bytes=256) as w:
        for i in range(100):
            w.write({"x": np.zeros(4 if i < 50 else 2 + i % 3, np.float32)})
    man = load_manifest(u)
    assert man.types[0].variable and not man.shards[0].columns[0].ragged  # first shards kept fixed storage
    lens = [len(s["x"]) for s in StreamingDataset(u, None, shuffle=False)]
    assert lens == [4] * 50 + [2 + i % 3 for i in range(50, 100)]


@pytest.mark.parametrize("first, bad, match", [
    pytest.param(True, {"x": np.array(["a"], dtype=object)}, "plain numbers", id="objects-first"),
    pytest.param(False, {"x": np.array(["a"], dtype=object)}, "is object", id="objects-later"),
    pytest.param(False, {"x": np.zeros((2, 3), np.float32)}, "first axis", id="trailing-shape"),
    pytest.param(False, {"x": np.zeros(2, np.complex64)}, "earlier samples were", id="other-kind"),
    pytest.param(False, {"y": np.zeros(2, np.float32)}, "lacks field", id="missing-field"),
])
def test_samples_the_container_cannot_hold_are_refused_and_nothing_is_committed(tmp_path, first, bad, match):
    u = f"file://{tmp_path / 'ds'}"
    with pytest.raises(ConfigError, match=match):
        with ShardWriter(u, ["x"], shard_bytes=64) as w:
            for _ in range(0 if first else 10):
                w.write({"x": np.zeros(2, np.float32)})
            w.write(bad)
    assert not (tmp_path / "ds" / MANIFEST).exists()


# -- checksums --------------------------------------------------------------------------------------
def test_each_window_is_checked_as_it_arrives_and_a_bad_one_keeps_nothing(tmp_path):
    u = f"file://{tmp_path / 'ds'}"
    with ShardWriter(u, ["x"], shard_bytes=1 << 20, window_bytes=64 << 10) as w:
        for i in range(4096):
            w.write({"x": np.full(64, i, np.int32)})
    man = load_manifest(u)
    info = man.shards[0]
    assert len(info.windows) == -(-info.size // (64 << 10)) > 2
    path = tmp_path / "ds" / info.key
    data = bytearray(path.read_bytes())
    data[(64 << 10) + 100] ^= 0xFF  # in the second window
    path.write_bytes(bytes(data))
    ds = StreamingDataset(u, tmp_path / "cache", "64MiB", shuffle=False, prefetch=0)
    with pytest.raises(IntegrityError, match=f"{info.key}.*bytes 65536..131072"):
        list(ds.iter_batches())
    assert not list((tmp_path / "cache" / "entries").iterdir())  # the bad copy was not kept


def test_ragged_offsets_that_go_back_are_a_format_error(tmp_path, url):
    man = load_manifest(url)
    info = man.shards[0]
    col = info.columns[2]
    path = tmp_path / "ds" / info.key
    data = bytearray(path.read_bytes())
    data[col.offsets + 8 : col.offsets + 16] = (10**6).to_bytes(8, "little")  # read in place: no download check
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="offsets of field 'doc'"):
        list(StreamingDataset(url, None, shuffle=False).iter_batches())


# -- hostile manifests ---------------------------------------------------------------------------------
def _shard0(fn):
    return lambda m: fn(m["shards"][0])


@pytest.mark.parametrize("edit, match", [
    pytest.param(_shard0(lambda s: s["columns"][0].__setitem__("offset", 10**9)), "outside", id="column-outside"),
    pytest.param(_shard0(lambda s: s["columns"][1].__setitem__("offset", 8)), "overlaps", id="columns-overlap"),
    pytest.param(_shard0(lambda s: s["columns"][0].__setitem__("offset", -64)), "integer", id="negative-offset"),
    pytest.param(_shard0(lambda s: s["columns"][1].__setitem__("offset", 3)), "aligned", id="unaligned"),
    pytest.param(_shard0(lambda s: s["columns"][2].__setitem__("offsets", 4)), "aligned|overlaps", id="offsets-unaligned"),
    pytest.param(_shard0(lambda s: s["columns"][0].__setitem__("shape", [9])), "shape", id="shape-mismatch"),
    pytest.param(_shard0(lambda s: s["columns"].pop()), "columns for", id="column-missing"),
    pytest.param(_shard0(lambda s: s["windows"].append("0" * 16)), "window checksums|at most", id="window-count"),
    pytest.param(_shard0(lambda s: s.__setitem__("window", 100000)), "power of two", id="window-size"),
    pytest.param(_shard0(lambda s: s["windows"].__setitem__(0, "../../victim/xx")), "hex", id="window-digest"),
    pytest.param(_shard0(lambda s: s.__setitem__("key", "../../victim")), "not a relative name", id="key-traversal"),
    pytest.param(lambda m: m["types"][0].__setitem__("dtype", "|O"), "plain little-endian", id="dtype-object"),
    pytest.param(lambda m: m["types"][0].__setitem__("dtype", ">u2"), "plain little-endian", id="dtype-big-endian"),
    pytest.param(lambda m: m["types"][0].__setitem__("shape", [2**40, 2**40]), "absurdly large", id="shape-absurd"),
    pytest.param(lambda m: m["types"][0].__setitem__("variable", "yes"), "variable", id="variable-string"),
    pytest.param(lambda m: m["types"].pop(), "field types", id="types-missing"),
    pytest.param(lambda m: m.__setitem__("container", "zip"), "container", id="container"),
])
def test_columns_manifest_fields_are_checked_before_any_view_or_path(tmp_path, url, edit, match):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    _edit(tmp_path / "ds" / MANIFEST, edit)
    with pytest.raises(FormatError, match=match):
        load_manifest(url)
    with pytest.raises(FormatError):
        StreamingDataset(url, tmp_path / "cache", "1MiB")
    assert victim.read_bytes() == b"keep me"


@FUZZ
@given(data=st.data())
def test_fuzz_columns_manifest(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("fuzz")
    _write(f"file://{d}", n=40, shard_size=256)
    good = (d / MANIFEST).read_bytes()
    raw = data.draw(mutated(good, json.loads(good)))
    man = only_typed_errors(parse_manifest, raw, MANIFEST)
    if man is not None:  # a manifest that parses describes views that can be made without overrunning
        for i, info in enumerate(man.shards):
            only_typed_errors(ColumnShard, bytes(info.size) if info.size < (1 << 20) else b"", man.layout(i), "s")


# -- what a forged manifest can make a reader do --------------------------------------------------------
@pytest.mark.parametrize("format", ["columns", "tar"])
def test_consistently_huge_declared_sizes_are_refused_before_anything_is_sized_by_them(tmp_path, format):
    """A manifest whose counts agree with its (forged) sizes passes the manifest's own checks; the
    shard's real size is checked before its declared sample count sizes anything (a permutation
    of 1e11 samples would take 800 GB)."""
    u = f"file://{tmp_path / 'ds'}"
    with ShardWriter(u, ["x"], shard_bytes=4096, format=format) as w:
        for i in range(40):
            w.write({"x": np.array(i, np.int64)})
    extra = 10**11

    def claim(m):
        s = m["shards"][0]
        s["samples"] += extra
        if format == "tar":
            s["size"] += extra * 512 * 2
            s["index_size"] += extra * 8 * 3
        else:  # one int64 column from byte 0: the shard is exactly its samples
            s["size"] = s["samples"] * 8
            s["window"] = 1 << 30
            s["windows"] = ["0" * 16] * -(-s["size"] // s["window"])
        for later in m["shards"][1:]:
            later["first_sample"] += extra
        m["num_samples"] += extra

    _edit(tmp_path / "ds" / MANIFEST, claim)
    ds = StreamingDataset(u, tmp_path / "cache", 1 << 60, seed=0)  # the manifest itself is consistent
    with pytest.raises(IntegrityError, match="manifest says"):
        next(iter(ds))


def _write_tar(u: str) -> None:
    with ShardWriter(u, ["x"], shard_bytes=4096, format="tar") as w:
        for i in range(40):
            w.write({"x": np.array([i, i * i], np.int64)})


def test_a_tar_index_longer_than_the_manifest_says_is_read_only_as_far_as_it_says(tmp_path):
    u = f"file://{tmp_path / 'ds'}"
    _write_tar(u)
    man = load_manifest(u)
    index = tmp_path / "ds" / man.shards[0].index_key
    with open(index, "ab") as f:
        f.write(b"\0" * (8 << 20))  # 8 MiB the manifest does not know about
    ids = sorted(int(s["x"][0]) for s in StreamingDataset(u, None, seed=1))
    assert ids == list(range(40))


# -- export and S3 ------------------------------------------------------------------------------------
def test_export_writes_webdataset_shards_that_tar_and_webdataset_read(tmp_path, url):
    out = tmp_path / "wds"
    man = export_dataset(url, f"file://{out}", shard_bytes="16KiB")
    assert man.container == "tar" and man.num_samples == N and len(man.shards) > 1 and man.meta == {"kind": "test"}
    first = out / man.shards[0].key
    listing = subprocess.run(["tar", "tf", str(first)], capture_output=True, text=True, check=True).stdout.split()
    assert listing[:3] == ["000000000000.tokens.npy", "000000000000.label.npy", "000000000000.doc.npy"]
    got = [s for shard in man.shards for s in iter_tar_samples(out / shard.key)]
    assert [int(s["label"]) for s in got] == list(range(N))
    assert all((s["doc"] == np.arange(i % 5) + i).all() for i, s in enumerate(got))
    wds = pytest.importorskip("webdataset")
    assert len(list(wds.WebDataset([str(first)], shardshuffle=False).decode())) == man.shards[0].samples


def test_cli_export(tmp_path, url, capsys):
    from tierio.cli.main import main

    assert main(["data", "export", url, str(tmp_path / "wds"), "--webdataset", "--shard-size", "8KiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "tar" and out["samples"] == N and out["shards"] > 1


@pytest.mark.s3
def test_shards_written_to_s3_in_the_background_read_back_the_same(tmp_path, s3_url):
    _write(s3_url, n=N, shard_size=512, in_flight=3)
    man = load_manifest(s3_url)
    assert len(man.shards) > 5 and set(open_store(s3_url).list("")) == {MANIFEST, *(s.key for s in man.shards)}
    loader = build_loader(StreamingDataset(s3_url, tmp_path / "cache", "8MiB", shuffle=False, batch_size=10), 10,
                          settings=loader_settings(num_workers=0, drop_last=False))
    assert [int(x) for b in loader for x in b["label"]] == list(range(N))


def test_a_failed_write_commits_nothing(tmp_path):
    u = f"file://{tmp_path / 'ds'}"
    with pytest.raises(RuntimeError):
        with ShardWriter(u, ["x"], shard_bytes=64) as w:
            for i in range(100):
                w.write({"x": np.full(8, i, np.int64)})
            raise RuntimeError("the producer died")
    assert not (tmp_path / "ds" / MANIFEST).exists()
    with pytest.raises(TierioError, match="never completed"):
        StreamingDataset(u, None)
