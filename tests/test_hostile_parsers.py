"""Hostile and damaged input to every parser of untrusted bytes: a typed error naming the file,
nothing read or written outside the directory the user chose, nothing allocated from a count the
bytes do not back, and the good copy on another tier still used."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tierio.ckpt import CheckpointManager
from tierio.ckpt.ops import list_checkpoints
from tierio.data.builder import build_indexed
from tierio.data.packing import load_plan, plan_packing, save_plan
from tierio.data.shards import MANIFEST, ShardFile, ShardInfo, ShardWriter, load_manifest, parse_index
from tierio.data.streaming import StreamingDataset
from tierio.errors import ConfigError, FormatError
from tierio.format.manifest import parse_manifest
from tierio.format.safetensors import read_header_from
from tierio.io.checksum import xxh3
from tierio.weights import inspect, load

DEEP = b"[" * 5000 + b"]" * 5000
HUGE_INT = "9" * 5000  # over Python's 4300-digit limit: a ValueError inside json


# -- checkpoint manifests ---------------------------------------------------------------------
def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}, "step": 1}


def _manifest(d: Path) -> Path:
    return d / "step_000000001" / "manifest.json"


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_weights_refuse_a_manifest_naming_a_file_outside_the_model(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    save_file({"model.secret": torch.full((4,), 7.0)}, str(victim / "model.safetensors"))
    model = tmp_path / "models" / "m"
    with CheckpointManager([model]) as mgr:
        mgr.save(1, _state()).wait()
    # step_000000001/../../../victim/model.safetensors is tmp_path/victim/model.safetensors
    _edit(_manifest(model), lambda m: m["ranks"][0].__setitem__("file", "../../../victim/model.safetensors"))
    with pytest.raises(FormatError, match="not a plain name"):
        load(model)
    with pytest.raises(FormatError, match="manifest.json"):
        inspect(model)


def test_weights_refuse_a_manifest_that_is_not_a_checkpoint_manifest(tmp_path):
    model = tmp_path / "m"
    with CheckpointManager([model]) as mgr:
        mgr.save(1, _state()).wait()
    _manifest(model).write_text(json.dumps({"step": 1, "chunks": [{"path": "../../x.safetensors"}]}))
    with pytest.raises(FormatError, match="not a tierio checkpoint manifest"):
        load(model)


@pytest.mark.parametrize("damage", [
    pytest.param(lambda raw: raw[: len(raw) // 2], id="truncated"),
    pytest.param(lambda raw: raw.replace(b'"rank"', b'"r\xffnk"'), id="not-utf8"),
    pytest.param(lambda raw: raw.replace(b'"step": 1', b'"step": ' + HUGE_INT.encode()), id="huge-int"),
    pytest.param(lambda raw: raw.replace(b'"step": 1', b'"step": 1, "deep": ' + DEEP), id="deep"),
    pytest.param(lambda raw: raw.replace(b'"timestamp": ', b'"timestamp": NaN, "t": '), id="nan"),
    pytest.param(lambda raw: raw.replace(b'"tree": {', b'"tree": {"x": {"__np__": ["|i1", 1000]}, '), id="np-overflow"),
    pytest.param(lambda raw: raw.replace(b'"tree": {', b'"tree": {"x": {"__dtype__": "_dynamo"}, '), id="not-a-dtype"),
    pytest.param(lambda raw: raw.replace(b'"tree": {', b'"tree": {"x": {"__dict__": [[[1], 2]]}, '), id="list-key"),
])
def test_restore_falls_back_to_the_next_tier_on_a_damaged_manifest(tmp_path, damage):
    t0, t1 = tmp_path / "t0", tmp_path / "t1"
    state = _state()
    with CheckpointManager([t0, t1]) as mgr:
        mgr.save(1, state).wait()
    path = _manifest(t0)
    path.write_bytes(damage(path.read_bytes()))
    with CheckpointManager([t0, t1]) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = mgr.restore(1)
        assert mgr.restored_from.endswith(str(t1))
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["step"] == 1


def test_ckpt_ls_lists_every_step_and_marks_the_hostile_one(tmp_path, capsys):
    tier = tmp_path / "tier"
    with CheckpointManager([tier]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state()).wait()
    bad = tier / "step_000000002" / "manifest.json"
    bad.write_bytes(bad.read_bytes().replace(b'"step": 2', b'"step": ' + HUGE_INT.encode()))
    listed = {c.step: c for c in list_checkpoints(tier)}
    assert sorted(listed) == [1, 2, 3]
    assert listed[1].error is None and listed[3].error is None
    assert "step_000000002/manifest.json" in listed[2].error
    from tierio.cli.main import main

    assert main(["ckpt", "ls", str(tier), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in out["checkpoints"]] == [1, 3]
    assert [b["step"] for b in out["unreadable"]] == [2] and "manifest.json" in out["unreadable"][0]["problem"]


def test_a_flood_of_tiny_values_is_refused_before_it_is_parsed():
    raw = b'{"schema": "tierio.checkpoint", "version": 1, "extra": [' + b"{}," * (4 << 20) + b"{}]}"
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="memory"):
            parse_manifest(raw, "big/manifest.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(raw)  # parsing it would have built ~25x its 12 MiB


def test_a_checkpoint_whose_manifest_its_reader_would_refuse_is_not_committed(tmp_path):
    state = {"w": torch.ones(4), "blob": bytes(50 << 20)}  # 67 MB of base64 in the manifest's state tree
    with pytest.raises(ConfigError, match="store large non-tensor state"):
        with CheckpointManager([tmp_path / "t0"]) as mgr:
            mgr.save(1, state).wait()
    assert list_checkpoints(tmp_path / "t0") == []  # refused when saving, not found unreadable when restoring


def test_an_integer_the_manifest_reader_would_refuse_is_refused_when_saving(tmp_path):
    with CheckpointManager([tmp_path / "t0"]) as mgr:
        mgr.save(1, {"w": torch.ones(2), "seed": 2**64}).wait()  # 20 digits: fine
        assert mgr.restore(1)["seed"] == 2**64
        with pytest.raises(ConfigError, match="digits"):
            mgr.save(2, {"w": torch.ones(2), "seed": 10**30})


# -- safetensors headers ----------------------------------------------------------------------
def _st(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


@pytest.mark.parametrize("header, data", [
    pytest.param(b'{"a": ' + DEEP + b"}", b"", id="deep"),
    pytest.param(json.dumps({"x": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}).encode(), b"", id="shape-0-2^63"),
    pytest.param(b'{"x": {"dtype": "F32", "shape": [' + HUGE_INT.encode() + b'], "data_offsets": [0, 4]}}', b"\0" * 4, id="huge-int"),
    pytest.param(b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, NaN]}}', b"\0" * 4, id="nan"),
    pytest.param(json.dumps({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}).encode(), b"", id="negative"),
    pytest.param(json.dumps({"x": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}).encode(), b"\0" * 4, id="float-dim"),
    pytest.param(json.dumps({"__metadata__": {"k": 1}}).encode(), b"", id="metadata-not-str"),
    pytest.param(json.dumps([1, 2]).encode(), b"", id="not-an-object"),
])
def test_hostile_safetensors_headers_are_format_errors(tmp_path, header, data):
    p = _st(tmp_path / "m.safetensors", header, data)
    with pytest.raises(FormatError, match="m.safetensors"):
        out = load(p)
        out["x"].sum()  # a header that parsed must also load


def test_a_header_larger_than_its_data_can_need_is_refused_unread(tmp_path):
    p = tmp_path / "big.safetensors"
    n = 50_000_000
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n + 16)  # sparse: the header claims 50 MB in front of 16 bytes of data
    asked = []

    def read(off: int, length: int) -> bytes:
        asked.append(length)
        with open(p, "rb") as f:
            f.seek(off)
            return f.read(length)

    with pytest.raises(FormatError, match="describe"):
        read_header_from(read, p.stat().st_size, str(p))
    assert sum(asked) == 8  # only the length prefix was read
    with pytest.raises(FormatError, match="big.safetensors"):
        load(p)


# -- Hugging Face index -----------------------------------------------------------------------
@pytest.mark.parametrize("index, match", [
    pytest.param(b'{"weight_map": ' + DEEP + b"}", "nested too deeply|deeper", id="deep"),
    pytest.param(b'{"metadata": {"total_size": ' + HUGE_INT.encode() + b'}, "weight_map": {}}', "not valid JSON", id="huge-int"),
    pytest.param(json.dumps({"weight_map": {"w": "../outside.safetensors"}}).encode(), "not a relative name", id="traversal"),
    pytest.param(json.dumps({"weight_map": {"w": 5}}).encode(), "expected a string", id="not-a-string"),
    pytest.param(json.dumps({"weight_map": []}).encode(), "JSON object", id="not-a-map"),
])
def test_hostile_hf_index_is_a_format_error(tmp_path, index, match):
    d = tmp_path / "model"
    d.mkdir()
    save_file({"w": torch.ones(2)}, str(d / "model-00001-of-00001.safetensors"))
    (tmp_path / "outside.safetensors").write_bytes((d / "model-00001-of-00001.safetensors").read_bytes())
    (d / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(FormatError, match=match):
        load(d)


# -- shard datasets: index.json, .idx.npy, .npy fields -----------------------------------------
def _dataset(url: str, n: int = 40, format: str = "tar") -> None:
    with ShardWriter(url, ["x"], shard_bytes=4096, format=format) as w:
        for i in range(n):
            w.write({"x": np.array([i, i * i], np.int64)})


def _set_shard(field: str, value):
    return lambda m: m["shards"][0].__setitem__(field, value)


@pytest.mark.parametrize("edit, match", [
    pytest.param(_set_shard("xxh3", "../../victim"), "hex", id="xxh3-traversal"),
    pytest.param(_set_shard("index_xxh3", "../victim"), "hex", id="index-xxh3-traversal"),
    pytest.param(_set_shard("key", "../../victim"), "not a relative name", id="key-traversal"),
    pytest.param(_set_shard("index_key", "/etc/passwd"), "not a relative name", id="index-key-absolute"),
    pytest.param(_set_shard("size", float("nan")), "not valid JSON", id="size-nan"),
    pytest.param(_set_shard("size", -1), "integer", id="size-negative"),
    pytest.param(_set_shard("size", 1e10), "integer", id="size-float"),
    pytest.param(_set_shard("samples", "5"), "integer", id="samples-string"),
    pytest.param(_set_shard("first_sample", True), "integer", id="first-bool"),
    pytest.param(lambda m: m.__setitem__("fields", ["a/b"]), "field name", id="field-slash"),
    pytest.param(lambda m: m.__setitem__("num_samples", 1.5), "integer|samples", id="num-float"),
    pytest.param(lambda m: m.__setitem__("shards", [m["shards"][0]] * 2), "inconsistent|twice", id="shard-twice"),
])
def test_shard_manifest_fields_are_checked_before_any_path_is_built(tmp_path, edit, match):
    url = f"file://{tmp_path / 'ds'}"
    _dataset(url)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    _edit(tmp_path / "ds" / MANIFEST, edit)
    with pytest.raises(FormatError, match=match):
        load_manifest(url)
    with pytest.raises(FormatError):
        StreamingDataset(url, tmp_path / "cache" / "sub", "1MiB")
    assert victim.read_bytes() == b"keep me"


def test_declared_sample_counts_are_checked_against_declared_sizes(tmp_path):
    url = f"file://{tmp_path / 'ds'}"
    _dataset(url)

    def claim(m):  # 1e10 samples, consistently counted, in a shard of a few KiB
        extra = 10**10 - m["shards"][0]["samples"]
        m["shards"][0]["samples"] += extra
        for s in m["shards"][1:]:
            s["first_sample"] += extra
        m["num_samples"] += extra

    _edit(tmp_path / "ds" / MANIFEST, claim)
    with pytest.raises(FormatError, match="cannot fit"):
        StreamingDataset(url, tmp_path / "cache", "1MiB")


def _npy(shape, dtype="<i8", data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + data


def test_a_shard_index_declaring_more_rows_than_its_bytes_is_refused_unallocated():
    raw = _npy((10**12, 3))  # 24 TB of rows declared, none present
    info = ShardInfo("s.tar", 1 << 20, "0" * 16, 10**12, 0, "s.idx.npy", len(raw), xxh3(raw))
    with pytest.raises(FormatError, match="rows"):
        parse_index(raw, info, 1, "s.idx.npy")


def test_a_shard_index_pointing_outside_its_shard_is_refused(tmp_path):
    url = f"file://{tmp_path / 'ds'}"
    _dataset(url)
    man = load_manifest(url)
    info = man.shards[0]
    raw = (tmp_path / "ds" / info.index_key).read_bytes()
    index = parse_index(raw, info, 1, "idx").copy()
    index[1, 0] = -64  # would read the bytes before the shard's start from the end of the mapping
    with pytest.raises(FormatError, match="outside"):
        ShardFile(tmp_path / "ds" / info.key, index, man.fields).sample(1)
    bad = _npy(index.shape, data=index.tobytes())
    forged = ShardInfo(info.key, info.size, info.xxh3, info.samples, 0, info.index_key, len(bad), xxh3(bad))
    with pytest.raises(FormatError, match="outside"):
        parse_index(bad, forged, 1, "idx")


# -- pack plans -------------------------------------------------------------------------------
def test_a_pack_plan_declaring_a_huge_array_is_refused_unallocated(tmp_path):
    good = save_plan(plan_packing([5, 6, 7], 16), tmp_path / "p.npz")
    with np.load(good) as z:
        arrays = {k: z[k] for k in z.files}
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(bad, "w") as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arr)
            zf.writestr(f"{name}.npy", _npy((10**12,)) if name == "doc_ids" else buf.getvalue())
    with pytest.raises(FormatError, match="doc_ids"):
        load_plan(bad)


def test_a_pack_plan_with_compressed_members_is_refused(tmp_path):
    good = save_plan(plan_packing([5, 6, 7], 16), tmp_path / "p.npz")
    with np.load(good) as z:
        np.savez_compressed(tmp_path / "c.npz", **{k: z[k] for k in z.files})
    with pytest.raises(FormatError, match="compressed"):
        load_plan(tmp_path / "c.npz")


# -- Megatron .idx: a FIFO is refused, not waited on ------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["idx", "bin"])
def test_a_fifo_in_place_of_a_dataset_file_is_refused(tmp_path, which):
    build_indexed([[1, 2, 3], [4, 5]], tmp_path / "c", vocab_size=100)
    target = tmp_path / f"c.{which}"
    target.unlink()
    os.mkfifo(target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        r = subprocess.run([sys.executable, "-m", "tierio", "data", "inspect", str(tmp_path / "c")],
                           capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`tierio data inspect` blocked on a FIFO in place of c.{which}")
    assert r.returncode == 1 and "not a regular file" in r.stderr and "Traceback" not in r.stderr
