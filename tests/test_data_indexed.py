"""Megatron-compatible indexed datasets: exact bytes, round trips, merging, windows, bad input."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tierio.cli.main import main
from tierio.data.builder import build_indexed, iter_input, iter_jsonl_tokens, load_tokenizer, merge_indexed
from tierio.data.indexed import MAGIC, IndexedDataset, IndexedDatasetWriter, optimal_dtype
from tierio.data.window import TokenWindowDataset
from tierio.errors import ConfigError, FormatError, NotFoundError


def _docs(n=50, seed=0, vocab=1000, max_len=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, max_len))) for _ in range(n)]


def test_golden_bytes_match_megatron_layout(tmp_path):
    # two documents [1,2,3] and [4,5] with uint16 tokens, laid out by hand from the format
    build_indexed([[1, 2, 3], [4, 5]], tmp_path / "g", vocab_size=100)
    expected = (
        MAGIC + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", 2) + struct.pack("<Q", 3)
        + np.array([3, 2], np.int32).tobytes() + np.array([0, 6], np.int64).tobytes()
        + np.array([0, 1, 2], np.int64).tobytes()
    )
    assert (tmp_path / "g.idx").read_bytes() == expected
    assert (tmp_path / "g.bin").read_bytes() == np.array([1, 2, 3, 4, 5], np.uint16).tobytes()


def test_reads_megatron_written_multisequence_documents(tmp_path):
    # an index as Megatron's _IndexWriter writes it: int32 tokens, 3 sequences in 2 documents
    seqs = [np.array([7, 8], np.int32), np.array([9], np.int32), np.array([10, 11, 12], np.int32)]
    (tmp_path / "m.bin").write_bytes(b"".join(s.tobytes() for s in seqs))
    lengths, ptrs, docs = [2, 1, 3], [0, 8, 12], [0, 2, 3]
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 4))
        f.write(struct.pack("<Q", 3))
        f.write(struct.pack("<Q", 3))
        f.write(np.array(lengths, np.int32).tobytes())
        f.write(np.array(ptrs, np.int64).tobytes())
        f.write(np.array(docs, np.int64).tobytes())
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2
    assert ds[2].tolist() == [10, 11, 12]
    assert ds.document(0).tolist() == [7, 8, 9]
    assert ds.document_lengths().tolist() == [3, 3]
    assert ds.get(2, offset=1, length=1).tolist() == [11]


def test_writer_items_and_documents_round_trip(tmp_path):
    with IndexedDatasetWriter(tmp_path / "w", dtype=np.int32) as w:
        w.add_item([1, 2])
        w.add_item([3])
        w.end_document()
        w.add_document([4, 5, 6], lengths=[1, 2])
    ds = IndexedDataset(str(tmp_path / "w") + ".bin")  # a .bin or .idx path works too
    assert ds.document_indices.tolist() == [0, 2, 4]
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4], [5, 6]]


def test_build_roundtrip_and_smallest_dtype(tmp_path):
    docs = _docs()
    st = build_indexed(docs, tmp_path / "a")  # vocabulary unknown: narrowed after the fact
    assert st.dtype == "uint16" and st.documents == len(docs)
    ds = IndexedDataset(tmp_path / "a")
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d.tolist()
    assert ds.num_tokens == sum(len(d) for d in docs)
    big = build_indexed([[70000, 1]], tmp_path / "b")
    assert big.dtype == "int32"
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32 and optimal_dtype(None) == np.int32
    with pytest.raises(FormatError, match="vocabulary size"):
        build_indexed([[5, 100]], tmp_path / "c", vocab_size=100)
    with pytest.raises(ConfigError, match="does not fit uint16"):
        build_indexed([[5, 70000]], tmp_path / "d", dtype=np.uint16)
    assert not (tmp_path / "d.bin").exists()  # nothing published on failure


def test_merge(tmp_path):
    a, b = _docs(10, 1), _docs(7, 2)
    build_indexed(a, tmp_path / "a", vocab_size=1000)
    build_indexed(b, tmp_path / "b", vocab_size=1000)
    st = merge_indexed([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    ds = IndexedDataset(tmp_path / "ab")
    assert st.documents == 17 and ds.num_documents == 17
    assert [ds.document(i).tolist() for i in range(17)] == [d.tolist() for d in a + b]
    build_indexed([[1]], tmp_path / "wide", dtype=np.int32)
    with pytest.raises(ConfigError, match="same token dtype"):
        merge_indexed([tmp_path / "a", tmp_path / "wide"], tmp_path / "bad")
    with pytest.raises(ConfigError, match="also an input"):
        merge_indexed([tmp_path / "a"], tmp_path / "a")


def test_inputs_jsonl_npy_and_text(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"tokens": [1, 2]}\n[3, 4, 5]\n\n')
    assert [d.tolist() for d in iter_jsonl_tokens(p)] == [[1, 2], [3, 4, 5]]
    assert [d.tolist() for d in iter_input(p, append_eos=0)] == [[1, 2, 0], [3, 4, 5, 0]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('[1, 2]\n{"text": "x"}\n')
    with pytest.raises(FormatError, match=r"bad.jsonl:2"):
        list(iter_jsonl_tokens(bad))
    npy = tmp_path / "m.npy"
    np.save(npy, np.arange(6, dtype=np.int32).reshape(2, 3))
    assert [d.tolist() for d in iter_input(npy)] == [[0, 1, 2], [3, 4, 5]]
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install tokenizers"):
            load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(NotFoundError):
        list(iter_input(tmp_path / "missing.jsonl"))


def _pair(tmp_path):
    build_indexed(_docs(20), tmp_path / "c", vocab_size=1000)
    return tmp_path / "c.idx", tmp_path / "c.bin"


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda i, b: i.write_bytes(b"NOTMEGA\x00\x00" + i.read_bytes()[9:]), "not a Megatron MMIDIDX"),
        (lambda i, b: i.write_bytes(i.read_bytes()[:-5]), "truncated"),
        (lambda i, b: i.write_bytes(i.read_bytes()[:20]), "truncated"),
        (lambda i, b: b.write_bytes(b.read_bytes()[:-2]), "truncated"),
        (lambda i, b: b.write_bytes(b.read_bytes() + b"\x00\x00"), "longer than its index"),
        (lambda i, b: i.write_bytes(i.read_bytes()[:9] + struct.pack("<Q", 2) + i.read_bytes()[17:]), "version 2"),
        (lambda i, b: i.write_bytes(i.read_bytes()[:17] + b"\x09" + i.read_bytes()[18:]), "unknown dtype code"),
    ],
)
def test_corrupt_pairs_fail_loudly(tmp_path, damage, match):
    idx, bin_ = _pair(tmp_path)
    damage(idx, bin_)
    with pytest.raises(FormatError, match=match):
        IndexedDataset(tmp_path / "c")


def test_corrupt_pointer_is_detected(tmp_path):
    idx, _ = _pair(tmp_path)
    raw = bytearray(idx.read_bytes())
    n = struct.unpack_from("<Q", raw, 18)[0]
    ptr_off = 34 + 4 * n + 8 * 3  # the fourth sequence pointer
    struct.pack_into("<q", raw, ptr_off, 2)
    idx.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="sequence pointer 3"):
        IndexedDataset(tmp_path / "c")


def test_missing_bin(tmp_path):
    _, bin_ = _pair(tmp_path)
    bin_.unlink()
    with pytest.raises(NotFoundError, match="c.bin"):
        IndexedDataset(tmp_path / "c")


def test_token_windows_and_rank_split(tmp_path):
    docs = _docs(60)
    build_indexed(docs, tmp_path / "w", vocab_size=1000)
    flat = np.concatenate(docs)
    full = TokenWindowDataset(tmp_path / "w", 16)
    assert len(full) == (len(flat) - 1) // 16
    x, y = full[3]
    assert x.tolist() == flat[48:64].tolist() and y.tolist() == flat[49:65].tolist()
    assert not x.flags.owndata  # a view of the mapping
    seen = []
    for r in range(3):
        part = TokenWindowDataset(tmp_path / "w", 16, rank=r, world_size=3)
        assert len(part) == len(full) // 3
        seen += [part.global_index(i) for i in range(len(part))]
    assert len(seen) == len(set(seen))  # no window on two ranks
    batch = full.__getitems__([0, 3])
    assert batch["input_ids"][1].tolist() == x.tolist() and batch["labels"].dtype.is_floating_point is False
    with pytest.raises(ConfigError):
        TokenWindowDataset(tmp_path / "w", 16, rank=3, world_size=3)


def test_cli_build_inspect_merge(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(list(range(i, i + 5))) for i in range(10)))
    assert main(["data", "build", str(src), str(tmp_path / "x"), "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["documents"] == 10 and built["dtype"] == "uint16"
    assert main(["data", "inspect", str(tmp_path / "x"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokens"] == 50 and info["doc_len_max"] == 5
    assert main(["data", "merge", str(tmp_path / "xx"), str(tmp_path / "x"), str(tmp_path / "x")]) == 0
    assert IndexedDataset(tmp_path / "xx").num_documents == 20
    capsys.readouterr()
    (tmp_path / "x.idx").write_bytes(b"garbage")
    assert main(["data", "inspect", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
