"""Every parser of untrusted bytes, driven with mutated valid inputs: only TierioErrors come out.

Mutations work on bytes (flips, truncation, insertion, deletion, duplication) and on the JSON
document (a value replaced by a wrong type, a huge or negative integer, a float where an integer
belongs, NaN, deep nesting, a path that escapes, a missing or extra key). An input a parser
accepts must also be usable: what it describes is then read too. TIERIO_FUZZ_EXAMPLES sets the
number of examples per parser (200 by default) for a longer hunt.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierio.data.indexed import IndexedDataset
from tierio.data.packing import parse_plan, plan_packing, save_plan
from tierio.data.shards import ShardWriter, decode_npy, load_manifest, parse_index
from tierio.data.shards import parse_manifest as parse_shard_manifest
from tierio.errors import FormatError, TierioError
from tierio.format.manifest import Manifest, encode_record, parse_manifest, parse_record
from tierio.format.safetensors import read_header_from
from tierio.format.shard import plan_shard
from tierio.format.statetree import flatten
from tierio.io.checksum import xxh3
from tierio.io.untrusted import loads
from tierio.weights.presharded import parse_index as parse_tp_index
from tierio.weights.sources import parse_hf_index
from tierio.weights.tp import Split, TensorParallel, preset

FUZZ = settings(max_examples=int(os.environ.get("TIERIO_FUZZ_EXAMPLES", "200")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

EVIL_VALUES = [
    None, True, "", "x", "../../victim", "/etc/passwd", "a/../../b", "0" * 16, [], {}, [1, 2], {"a": 1},
    -1, 0, 1, 2**31, 2**63, 2**64, 10**30, 1e10, 0.5, -1.0, float("nan"), float("inf"),
    [0, 2**63], [2**40, 2**40], {"__tensor__": 5}, {"__np__": ["|i1", 1000]}, {"__dtype__": "cuda"},
    {"__dict__": [[[1], 2]]}, {"__tuple__": "x"}, {"__bytes__": "!!"},
]


DEEP = {n: f"__deep_{n}__" for n in (100, 700, 5000)}  # placeholders, nested arrays in the bytes


# -- mutations ----------------------------------------------------------------------------------
@st.composite
def byte_mutation(draw, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate", "digit"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 64))]
        elif kind == "duplicate":
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 64))]
        elif kind == "digit":  # numbers are where sizes live
            data[pos:pos] = draw(st.sampled_from([b"9" * 30, b"-", b"1e300", b"0.5", b"NaN"]))
    return bytes(data)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _nest(raw: bytes) -> bytes:
    for n, mark in DEEP.items():
        raw = raw.replace(f'"{mark}"'.encode(), b"[" * n + b"1" + b"]" * n)
    return raw


@st.composite
def json_mutation(draw, doc: Any) -> bytes:
    """The document with one to three values replaced, removed or added, as JSON bytes."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        kind = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "deep"]))
        value = copy.deepcopy(draw(st.sampled_from(EVIL_VALUES))) if kind != "deep" else DEEP[draw(st.sampled_from(sorted(DEEP)))]
        if not path:
            doc = value if kind in ("replace", "deep") else doc
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if kind in ("replace", "deep"):
            parent[key] = value
        elif kind == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[f"k{draw(st.integers(0, 9))}"] = value
        else:
            parent.insert(key, value)
    return _nest(json.dumps(doc).encode())


def mutated(raw: bytes, doc: Any | None = None):
    """Byte mutations, plus JSON mutations when the input is a JSON document."""
    strategies = [byte_mutation(raw)]
    if doc is not None:
        strategies.append(json_mutation(doc))
    return st.one_of(*strategies)


def only_typed_errors(fn, *args) -> Any:
    try:
        return fn(*args)
    except TierioError:
        return None


# -- valid inputs -------------------------------------------------------------------------------
def _rank_entry():
    from tierio.format.manifest import ChunkInfo, RankEntry, TensorInfo

    flat = flatten({"model": {"w": torch.ones(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 3,
                    "rng": (1, 2.5, float("nan")), "lr": {0: 0.1}})
    layout = plan_shard(flat.tensors)
    tensors = {}
    for name, chunks in layout.chunks.items():
        e = layout.header.tensors[name]
        tensors[name] = TensorInfo(name, e.dtype, e.shape, [
            ChunkInfo("rank_00000.safetensors", c.begin, c.end, (c.row0,) + (0,) * (len(c.shape) - 1), c.shape, "0123456789abcdef")
            for c in chunks
        ])
    return RankEntry(0, "rank_00000.safetensors", layout.total_bytes, flat.tree, tensors), layout


RANK, LAYOUT = _rank_entry()
MANIFEST_RAW = Manifest(7, 1, [RANK], "2026-01-01T00:00:00Z", 1.0, {"note": "x"}).encode()
FRAGMENT_RAW = encode_record(7, 1, RANK)
SAFETENSORS_RAW = bytes(LAYOUT.header_bytes) + b"\x01" * LAYOUT.header.data_bytes
HF_INDEX = {"metadata": {"total_size": 100}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}


def test_the_valid_inputs_parse():
    assert parse_manifest(MANIFEST_RAW, "m").step == 7
    assert parse_record(FRAGMENT_RAW, "f", 7, 1).rank == 0
    assert len(read_header_from(lambda o, n: SAFETENSORS_RAW[o : o + n], len(SAFETENSORS_RAW), "s").tensors) == 2
    assert len(parse_hf_index(json.dumps(HF_INDEX).encode(), "i")) == 2


# -- checkpoint manifests and fragments ---------------------------------------------------------
@FUZZ
@given(mutated(MANIFEST_RAW, json.loads(MANIFEST_RAW)))
def test_fuzz_checkpoint_manifest(raw):
    only_typed_errors(parse_manifest, raw, "step_000000007/manifest.json", 7)


@FUZZ
@given(mutated(FRAGMENT_RAW, json.loads(FRAGMENT_RAW)))
def test_fuzz_manifest_fragment(raw):
    only_typed_errors(parse_record, raw, "step_000000007/rank_00000.json", 7, 1)


# -- safetensors headers ------------------------------------------------------------------------
def _header_doc() -> dict:
    n = int.from_bytes(SAFETENSORS_RAW[:8], "little")
    return json.loads(SAFETENSORS_RAW[8 : 8 + n])


@st.composite
def safetensors_files(draw) -> bytes:
    if draw(st.booleans()):
        return draw(byte_mutation(SAFETENSORS_RAW))
    header = draw(json_mutation(_header_doc()))
    data = SAFETENSORS_RAW[8 + int.from_bytes(SAFETENSORS_RAW[:8], "little") :]
    return len(header).to_bytes(8, "little") + header + data


@FUZZ
@given(safetensors_files())
def test_fuzz_safetensors_header(raw):
    header = only_typed_errors(read_header_from, lambda o, n: raw[o : o + n], len(raw), "model.safetensors")
    if header is not None:  # what parsed must be readable: every tensor lies inside the file
        for e in header.tensors.values():
            buf = raw[header.data_offset + e.begin : header.data_offset + e.end]
            assert len(buf) == e.nbytes == math.prod(e.shape) * torch.empty(0, dtype=_dtype(e.dtype)).element_size()
            _tp_pieces_inside(header, e, len(raw))


def _tp_pieces_inside(header, e, size: int) -> None:
    """Every piece a tensor-parallel slice of an accepted header reads lies inside its tensor's bytes
    (or the split is refused, typed)."""
    from tierio.weights.sliced import Strided, narrowed
    from tierio.weights.sources import Shard

    shard = Shard("model.safetensors", size, "model.safetensors", header=header)
    lo, hi = shard.data_offset + e.begin, shard.data_offset + e.end
    for dim in range(len(e.shape)):
        take = only_typed_errors(TensorParallel(1, 2, [(".*", Split(dim))]).take, e.name, e.shape)
        if take is not None and take.contiguous(e.shape):
            n = narrowed(e, take)
            assert e.begin <= n.begin <= n.end <= e.end
        elif take is not None:
            p = Strided(e.name, shard, e, take).pieces()
            assert (p[:, 0] >= lo).all() and (p[:, 0] + p[:, 1] <= hi).all()


def _dtype(name: str) -> torch.dtype:
    from tierio.format.safetensors import torch_dtype

    return torch_dtype(name)


# -- Hugging Face index -------------------------------------------------------------------------
@FUZZ
@given(mutated(json.dumps(HF_INDEX, indent=2).encode(), HF_INDEX))
def test_fuzz_hf_index(raw):
    files = only_typed_errors(parse_hf_index, raw, "model.safetensors.index.json")
    if files is not None:
        assert all(isinstance(f, str) and ".." not in f.split("/") and not f.startswith("/") for f in files)


# -- tensor parallelism: the pre-sharded index, config.json presets ------------------------------
TP_INDEX = {"format": "tierio-tp", "version": 1, "tp": 2, "rules": [["o_proj", "Split(dim=1)"]], "window": 2 << 20,
            "source": {"url": "/m", "digest": "0123456789abcdef", "files": {"model.safetensors": "fedcba9876543210"}},
            "files": [{"file": f"tp-rank-{r:05d}-of-00002.safetensors", "rank": r, "bytes": 4096, "xxh3": "0" * 16,
                       "windows": {"0": "1" * 16}} for r in range(2)]}
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 2,
                "intermediate_size": 384, "hidden_size": 128}
TP_SHAPES = {"model.layers.0.self_attn.q_proj.weight": (128, 128), "model.layers.0.self_attn.k_proj.weight": (32, 128),
             "model.layers.0.self_attn.qkv_proj.weight": (192, 128), "model.layers.0.mlp.gate_up_proj.weight": (768, 128),
             "model.layers.0.mlp.down_proj.weight": (128, 384), "model.embed_tokens.weight": (256, 128)}


@FUZZ
@given(mutated(json.dumps(TP_INDEX, indent=1).encode(), TP_INDEX))
def test_fuzz_presharded_index(raw):
    doc = only_typed_errors(lambda: loads(raw, "tierio-tp.json", limit=1 << 20))
    got = only_typed_errors(parse_tp_index, doc, "tierio-tp.json", Path("/m"), TensorParallel(1, 2))
    if got is not None:  # what parsed names the rank's own file inside the directory
        assert got.path == Path("/m/tp-rank-00001-of-00002.safetensors") and got.size >= 0


@FUZZ
@given(mutated(json.dumps(LLAMA_CONFIG).encode(), LLAMA_CONFIG))
def test_fuzz_config_presets(raw):
    config = only_typed_errors(lambda: loads(raw, "config.json", limit=1 << 20))
    rules = only_typed_errors(preset, config)
    for name, shape in TP_SHAPES.items() if rules is not None else ():
        take = only_typed_errors(TensorParallel(3, 4, rules).take, name, shape)
        if take is not None:  # a slice that was accepted lies inside the tensor
            assert all(0 <= a < b <= shape[take.dim] for a, b in take.ranges)


# -- Megatron .idx ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> tuple[Path, bytes]:
    from tierio.data.builder import build_indexed

    d = tmp_path_factory.mktemp("megatron")
    build_indexed([[1, 2, 3], [4], [5, 6, 7, 8], []], d / "good", vocab_size=100)
    return d, (d / "good.idx").read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzz_megatron_idx(megatron, data):
    d, good = megatron
    raw = data.draw(byte_mutation(good))
    (d / "fuzz.idx").write_bytes(raw)
    (d / "fuzz.bin").write_bytes((d / "good.bin").read_bytes())
    ds = only_typed_errors(IndexedDataset, d / "fuzz")
    if ds is not None:  # an index that validates describes the .bin: every document reads
        assert sum(len(ds.document(j)) for j in range(ds.num_documents)) <= ds.num_tokens
        ds.document_lengths(), ds.close()


# -- shard datasets: index.json, .idx.npy, .npy fields ------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Any, Path]:
    d = tmp_path_factory.mktemp("shards")
    with ShardWriter(f"file://{d}", ["x", "y"], shard_bytes=2048, format="tar") as w:
        for i in range(12):
            w.write({"x": np.arange(i, dtype=np.int32), "y": np.array(float(i))})
    return load_manifest(f"file://{d}"), d


@FUZZ
@given(data=st.data())
def test_fuzz_shard_manifest(shards, data):
    _, d = shards
    good = (d / "index.json").read_bytes()
    raw = data.draw(mutated(good, json.loads(good)))
    man = only_typed_errors(parse_shard_manifest, raw, "index.json")
    if man is not None:
        assert all(len(s.xxh3) == 16 and ".." not in s.key.split("/") for s in man.shards)
        assert sum(s.samples for s in man.shards) == man.num_samples


@FUZZ
@given(data=st.data())
def test_fuzz_shard_index_and_npy_fields(shards, data):
    man, d = shards
    info = man.shards[0]
    raw = data.draw(byte_mutation((d / info.index_key).read_bytes()))
    forged = type(info)(**{**info.to_dict(), "index_size": len(raw), "index_xxh3": xxh3(raw)})  # past the checksum
    index = only_typed_errors(parse_index, raw, forged, len(man.fields), info.index_key)
    if index is not None:
        shard = (d / info.key).read_bytes()
        for row in index:
            for j in range(len(man.fields)):
                only_typed_errors(decode_npy, shard, int(row[2 * j]), int(row[2 * j + 1]))


@FUZZ
@given(data=st.data())
def test_fuzz_npy_field(data):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.arange(12, dtype=np.int16).reshape(3, 4))
    raw = data.draw(byte_mutation(buf.getvalue()))
    arr = only_typed_errors(decode_npy, raw)
    if arr is not None:
        assert arr.nbytes <= len(raw)


# -- pack plans ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_bytes(tmp_path_factory) -> bytes:
    p = save_plan(plan_packing([5, 6, 7, 1, 9, 3], 16), tmp_path_factory.mktemp("plan") / "p.npz")
    return p.read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzz_pack_plan(plan_bytes, data):
    raw = data.draw(byte_mutation(plan_bytes))
    plan = only_typed_errors(parse_plan, io.BytesIO(raw), "p.npz")
    if plan is not None:
        assert len(plan) == len(plan.pack_offsets) - 1 and all(len(plan.pack(i)[0]) >= 0 for i in range(len(plan)))


def test_a_pack_plan_whose_member_claims_encryption_is_a_format_error(plan_bytes):
    """Found by the fuzzer: the zip flag bit 'encrypted' made zipfile raise a bare RuntimeError."""
    raw = bytearray(plan_bytes)
    for sig, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local header, central directory
        at = raw.find(sig)
        while at >= 0:
            raw[at + flag_at] |= 0x01
            at = raw.find(sig, at + 4)
    with pytest.raises(FormatError, match="not a readable pack plan"):
        parse_plan(io.BytesIO(bytes(raw)), "p.npz")


@FUZZ
@given(data=st.data())
def test_fuzz_pack_plan_meta(plan_bytes, data):
    import zipfile

    with np.load(io.BytesIO(plan_bytes)) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    arrays["meta"] = np.frombuffer(data.draw(json_mutation(meta)), dtype=np.uint8)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, arr in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, arr)
            zf.writestr(f"{name}.npy", member.getvalue())
    only_typed_errors(parse_plan, io.BytesIO(buf.getvalue()), "p.npz")


# -- token parts manifest (a distributed build's parts.json) ------------------------------------
def _parts_manifest() -> bytes:
    from tierio.data.parts import PartRecord, manifest_of

    recs = [PartRecord(f"part-{i:06d}", f"in/{i}.jsonl", "0123456789abcdef", "uint16", 3 + i, 4 + i, 100 * (i + 1),
                       200 * (i + 1), 34 + 12 * (4 + i) + 8 * (4 + i), "0" * 16, "f" * 16) for i in range(3)]
    return manifest_of(recs).to_bytes()


PARTS_RAW = _parts_manifest()


@FUZZ
@given(mutated(PARTS_RAW, json.loads(PARTS_RAW)))
def test_fuzz_parts_manifest(raw):
    from tierio.data.parts import parse_manifest as parse_parts
    from tierio.io.untrusted import loads

    man = only_typed_errors(lambda: parse_parts(loads(raw, "parts.json", limit=1 << 20), "parts.json"))
    if man is not None:
        assert all(p.name.startswith("part-") and "/" not in p.name for p in man.parts)
        assert man.tokens == sum(p.tokens for p in man.parts)
