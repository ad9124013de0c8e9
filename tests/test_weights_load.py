"""tierio.weights.load / load_into: bit-identical to safetensors, strict validation, all source kinds."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError
from tierio.io import pagecache
from tierio.weights import LoadOptions, LoadStats, inspect, load, load_into


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same(a: dict, b: dict) -> None:
    assert list(sorted(a)) == list(sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert tuple(a[k].shape) == tuple(b[k].shape), k
        assert raw(a[k]) == raw(b[k]), k


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "bf16": f(37, 5).to(torch.bfloat16), "fp16": f(3, 7, 11).to(torch.float16), "fp32": f(1001),
        "fp64": f(3).double(), "f8e4": f(129).to(torch.float8_e4m3fn), "f8e5": f(17).to(torch.float8_e5m2),
        "i8": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g), "u8": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        "i16": torch.arange(9, dtype=torch.int16), "i32": torch.arange(-5, 6, dtype=torch.int32), "i64": torch.arange(3, dtype=torch.int64) * (1 << 40),
        "bool": f(23) > 0, "scalar": torch.tensor(2.5), "scalar_bf16": torch.tensor(-1.0, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4), "empty_i64": torch.empty(0, dtype=torch.int64), "big": f(300_000),  # > one 4 KiB block, odd size
    }


@pytest.fixture
def st_file(tmp_path):
    p = tmp_path / "all.safetensors"
    save_file(every_dtype(), str(p))
    return p


def test_every_dtype_matches_safetensors(st_file):
    stats = LoadStats()
    out = load(st_file, stats=stats)
    same(out, load_file(str(st_file)))
    assert stats.tensors == len(every_dtype()) and stats.bytes >= stats.direct_bytes + stats.buffered_bytes - 4096
    out["fp32"] += 1  # loaded tensors are ordinary writable tensors


def test_private_mode_reads_cold_file_with_o_direct_and_warm_file_through_page_cache(tmp_path):
    p = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(512, 1024)}, str(p))
    pagecache.evict(p)
    assert pagecache.resident_fraction(p) < 0.5
    cold = LoadStats()
    a = load(p, stats=cold, mapped=False)
    assert cold.method == "host-arena"
    p.read_bytes()  # now in the page cache
    assert pagecache.resident_fraction(p) == 1.0
    warm = LoadStats()
    b = load(p, stats=warm, mapped=False)
    same(a, b)
    assert warm.buffered_bytes >= warm.bytes - 4096
    if cold.direct_bytes == 0:
        pytest.skip("this filesystem refuses O_DIRECT (tmpfs?); direct path untested here")
    assert cold.direct_bytes > 0.9 * cold.bytes


def test_default_cpu_load_is_mapped_and_writes_stay_private(st_file, tmp_path):
    before = st_file.read_bytes()
    pagecache.evict(st_file)
    stats = LoadStats()
    out = load(st_file, stats=stats)
    assert stats.method == "mapped"
    assert pagecache.resident_fraction(st_file) == 1.0  # populated before returning, not on first use
    same(out, load_file(str(st_file)))
    out["fp32"] += 1  # copy-on-write: the tensor changes, the file does not
    assert st_file.read_bytes() == before
    sub = load(st_file, keys=["i32", "bf16"], dtype=torch.float32)
    assert sub["bf16"].dtype == torch.float32 and torch.equal(sub["i32"], load_file(str(st_file))["i32"])
    same(load(st_file, mapped=False), load(st_file))


def test_mapped_tensors_survive_replacing_the_file_by_rename(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(300_000, dtype=torch.float32)}, str(p))
    out = load(p)
    new = tmp_path / "new.safetensors"
    save_file({"w": torch.zeros(300_000)}, str(new))
    os.replace(new, p)  # how writers update a model in place safely
    assert torch.equal(out["w"], torch.arange(300_000, dtype=torch.float32))
    p.unlink()
    assert float(out["w"][-1]) == 299_999.0


def test_file_truncated_between_header_and_data_is_an_error_not_a_crash(tmp_path, monkeypatch):
    """Truncated after its header was read: mapping must report it, not SIGBUS the process."""
    from tierio.weights import sources

    p = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(1 << 20)}, str(p))
    real = sources.resolve

    def resolve_then_truncate(*a, **kw):
        src = real(*a, **kw)
        os.truncate(p, 1 << 16)
        return src

    monkeypatch.setattr("tierio.weights.loader.resolve", resolve_then_truncate)
    with pytest.raises(IntegrityError, match="truncated"):
        load(p)


def test_keys_subset_and_dtype(st_file):
    out = load(st_file, keys=["i32", "bf16", "scalar"], dtype=torch.float32)
    assert list(out) == ["i32", "bf16", "scalar"]
    ref = load_file(str(st_file))
    assert out["bf16"].dtype == torch.float32 and torch.equal(out["bf16"], ref["bf16"].float())
    assert out["i32"].dtype == torch.int32  # integers keep their dtype
    with pytest.raises(NotFoundError, match="nope"):
        load(st_file, keys=["nope"])


def test_unaligned_tensor_offsets(tmp_path):
    """A header whose length is not a multiple of 8 leaves tensors at odd file offsets."""
    a, b = torch.randn(1000), torch.arange(999, dtype=torch.int64)
    header = {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "a": {"dtype": "F32", "shape": [1000], "data_offsets": [1, 4001]},
              "b": {"dtype": "I64", "shape": [999], "data_offsets": [4001, 4001 + 999 * 8]}}
    hb = json.dumps(header).encode()
    hb += b" " * (3 - len(hb) % 8 if len(hb) % 8 <= 3 else 11 - len(hb) % 8)  # data starts at an odd offset
    data = b"\x07" + raw(a) + raw(b)
    p = tmp_path / "odd.safetensors"
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + data)
    stats = LoadStats()
    out = load(p, stats=stats)
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
    same(out, load_file(str(p)))
    assert stats.copied_tensors >= 1
    same(load(p, mapped=False), load_file(str(p)))


def _write(path, header_bytes: bytes, data: bytes = b"", length: int | None = None):
    path.write_bytes(struct.pack("<Q", len(header_bytes) if length is None else length) + header_bytes + data)
    return path


@pytest.mark.parametrize(
    "case, header, data, length, message",
    [
        ("beyond", b"{}", b"", 1000, "only"),
        ("notjson", b"{not json", b"", None, "not valid JSON"),
        ("range", json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), b"\0" * 8, None, "spans bytes"),
        ("overlap", json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode(), b"\0" * 12, None, "overlap"),
        ("dtype", json.dumps({"x": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}).encode(), b"\0", None, "unknown dtype"),
        ("huge", b"{}", b"", 200_000_000, "above"),
    ],
)
def test_malformed_headers_raise_format_error_naming_file(tmp_path, case, header, data, length, message):
    p = _write(tmp_path / f"{case}.safetensors", header, data, length)
    with pytest.raises(FormatError, match=message) as exc:
        load(p)
    assert str(p) in str(exc.value)


def test_hf_directory_with_index_and_sharded_load_into(tmp_path):
    torch.manual_seed(0)
    parts = [{"emb": torch.randn(50, 8), "l0.w": torch.randn(8, 8)}, {"l1.w": torch.randn(8, 8).half(), "step": torch.tensor(7)}]
    wm = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, str(tmp_path / name))
        wm.update({k: name for k in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    out = load(tmp_path)
    same(out, {**parts[0], **parts[1]})
    assert inspect(tmp_path)["kind"] == "hf"
    # in place: different dtype for one target (converted), same storage kept
    target = {"emb": torch.zeros(50, 8), "l0.w": torch.zeros(8, 8), "l1.w": torch.zeros(8, 8), "step": torch.zeros((), dtype=torch.int64)}
    ptr = target["emb"].data_ptr()
    res = load_into(target, tmp_path)
    assert target["emb"].data_ptr() == ptr and torch.equal(target["emb"], parts[0]["emb"])
    assert torch.equal(target["l1.w"], parts[1]["l1.w"].float()) and int(target["step"]) == 7
    assert sorted(res.loaded) == sorted(target)
    with pytest.raises(ConfigError, match="shape"):
        load_into({"emb": torch.zeros(3)}, tmp_path, strict=False)
    with pytest.raises(NotFoundError, match="lacks"):
        load_into({"other": torch.zeros(3)}, tmp_path)


def test_load_into_module_streams_without_second_copy(tmp_path):
    torch.manual_seed(1)
    src = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.ReLU(), torch.nn.Linear(700, 5))
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    dst = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.ReLU(), torch.nn.Linear(700, 5))
    load_into(dst, tmp_path / "model.safetensors", chunk_bytes="64KiB")  # many windows, tensors split across them
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_tierio_checkpoint_model_subtree(tmp_path):
    from tierio.ckpt import CheckpointManager

    with CheckpointManager([tmp_path]) as mgr:
        mgr.save(42, {"model": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}, "optim": {"m": torch.zeros(3)}}).wait()
    (tmp_path / "step_000000041").mkdir()  # uncommitted (no manifest): ignored
    out = load(tmp_path)
    assert sorted(out) == ["b", "w"] and torch.equal(out["w"], torch.arange(6.0).view(2, 3))
    assert inspect(tmp_path)["kind"] == "tierio"


def test_missing_source_and_bad_device(tmp_path, st_file):
    with pytest.raises(NotFoundError):
        load(tmp_path / "none.safetensors")
    with pytest.raises(NotFoundError, match="no .safetensors"):
        load(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            load(st_file, device="cuda")


def test_transformers_save_pretrained_loads(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + index
    assert (tmp_path / "model.safetensors.index.json").exists()
    ref = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    same(load(tmp_path), ref)
    fresh = transformers.LlamaForCausalLM(cfg)
    load_into(fresh, tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_mapping_of_a_file_truncated_after_mapping_reports_it(tmp_path):
    from tierio.weights.memory import FileMapping

    p = tmp_path / "t.bin"
    p.write_bytes(b"x" * (8 << 20))
    m = FileMapping(p, 0, 8 << 20)
    os.truncate(p, 1 << 20)
    with pytest.raises(IntegrityError, match="truncated"):
        m.populate(0, 8 << 20)  # touching the pages instead would kill the process with SIGBUS


@pytest.mark.parametrize("mapped", [True, False])
def test_progress_reports_every_byte_in_order(st_file, mapped):
    calls = []
    stats = LoadStats()
    load(st_file, stats=stats, mapped=mapped, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1] == (stats.bytes, stats.bytes)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    into = {k: torch.empty_like(v) for k, v in load_file(str(st_file)).items()}
    calls.clear()
    res = load_into(into, st_file, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (res.stats.bytes, res.stats.bytes)


def test_options_object_and_old_keywords_load_the_same(st_file):
    ref = load_file(str(st_file))
    stats = LoadStats()
    got = load(st_file, options=LoadOptions(chunk_bytes="64KiB", mapped=False, stats=stats))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert stats.method == "host-arena" and stats.bytes > 0
    with pytest.warns(DeprecationWarning, match="chunk_size"):
        old = load(st_file, chunk_size=64 << 10, mapped=False)
    assert all(torch.equal(old[k], ref[k]) for k in ref)
    into = {k: torch.empty_like(v) for k, v in ref.items()}
    res = load_into(into, st_file, LoadOptions(strict=False), depth=2)
    assert sorted(res.loaded) == sorted(ref) and res.to_dict()["stats"]["bytes"] == res.stats.bytes
    with pytest.raises(ConfigError, match="no_such_knob"):
        load(st_file, no_such_knob=1)
