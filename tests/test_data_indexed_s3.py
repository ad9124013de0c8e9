"""Megatron .bin/.idx datasets read straight from S3 (real SeaweedFS): through the node cache, or by
ranged GETs when the .bin does not fit it; the same samples as the local copy either way."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from tierio.cli.main import main
from tierio.data.builder import build_indexed
from tierio.data.indexed import IndexedDataset
from tierio.data.packing import PackedDataset, plan_packing
from tierio.data.remote_pair import RemoteOptions, split_prefix
from tierio.data.window import TokenWindowDataset
from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.storage import open_store


def docs(n: int = 300, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, int(rng.integers(1, 300))) for _ in range(n)]


def upload(tmp_path, s3_url: str, name: str, documents) -> tuple[str, IndexedDataset]:
    """Build ``name`` locally, copy its pair to S3; the S3 prefix and the local dataset."""
    build_indexed(documents, tmp_path / name, vocab_size=50_000)
    store = open_store(s3_url)
    for suffix in (".bin", ".idx"):
        store.put_file(f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    base, _, query = s3_url.partition("?")
    return f"{base}/{name}?{query}", IndexedDataset(tmp_path / name)


def same_samples(a: IndexedDataset, b: IndexedDataset) -> None:
    assert (len(a), a.num_documents, a.num_tokens, a.dtype) == (len(b), b.num_documents, b.num_tokens, b.dtype)
    for i in range(len(a)):
        assert np.array_equal(a[i], b[i])
    for j in (0, a.num_documents // 2, a.num_documents - 1):
        assert np.array_equal(a.document(j), b.document(j))
    assert a.fingerprint() == b.fingerprint()


def test_prefix_urls_split_into_store_and_name():
    assert split_prefix("s3://b/d/corpus_text_document.idx?endpoint=http://h:1") == ("s3://b/d?endpoint=http://h:1",
                                                                                     "corpus_text_document")
    with pytest.raises(ConfigError, match="names no dataset"):
        split_prefix("s3://b/")


def test_a_dataset_on_s3_reads_the_same_samples_cached_or_by_ranges(tmp_path, s3_url):
    url, local = upload(tmp_path, s3_url, "corpus", docs())
    cache = tmp_path / "cache"
    cached = IndexedDataset(url, remote=RemoteOptions(cache_dir=cache))
    same_samples(cached, local)
    entries = sorted((p.name, p.stat().st_ino) for p in (cache / "entries").iterdir())
    assert len(entries) == 2  # the .idx and the whole .bin
    again = pickle.loads(pickle.dumps(cached))  # as a DataLoader worker opens it: from the node cache
    same_samples(again, local)
    assert sorted((p.name, p.stat().st_ino) for p in (cache / "entries").iterdir()) == entries

    # A .bin larger than the cache limit is read by ranges; a tiny chunk makes sequences span chunks.
    ranged = IndexedDataset(url, remote=RemoteOptions(cache_dir=tmp_path / "c2", cache_limit_bytes=local.index_bytes + 1,
                                                      chunk_bytes=4096))
    assert ranged._pair.bin_path is None
    same_samples(ranged, local)
    with pytest.raises(ConfigError, match="bin_reads='ranges'"):
        IndexedDataset(url, remote=RemoteOptions(cache_dir=tmp_path / "c3", cache_limit_bytes=1000, bin_reads="cache"))

    # The consumers of flat tokens read the same from either.
    for ds in (cached, ranged):
        win = TokenWindowDataset(ds, seq_len=64, rank=1, world_size=2)
        ref = TokenWindowDataset(local, seq_len=64, rank=1, world_size=2)
        got, want = win.__getitems__(list(range(len(win)))), ref.__getitems__(list(range(len(ref))))
        assert torch.equal(got["input_ids"], want["input_ids"])
        plan = plan_packing(local.document_lengths(), 512)
        a, b = PackedDataset(ds, plan, check_source=False), PackedDataset(local, plan, check_source=False)
        assert all(np.array_equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(len(a)))
    for ds in (cached, ranged, again, local):
        ds.close()


def test_a_rewritten_dataset_is_never_read_through_its_old_copy(tmp_path, s3_url, capsys):
    url, _ = upload(tmp_path, s3_url, "corpus", docs(100, seed=1))
    cache = tmp_path / "cache"
    IndexedDataset(url, remote=RemoteOptions(cache_dir=cache)).close()
    _, local = upload(tmp_path, s3_url, "corpus", docs(120, seed=2))  # same name, other content
    fresh = IndexedDataset(url, remote=RemoteOptions(cache_dir=cache))
    same_samples(fresh, local)
    fresh.close()

    assert main(["data", "inspect", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == 120 and report["bin_bytes"] == local.num_tokens * local.dtype.itemsize


def test_a_missing_or_damaged_pair_on_s3_names_the_object(tmp_path, s3_url):
    url, _ = upload(tmp_path, s3_url, "corpus", docs(50))
    store = open_store(s3_url)
    data = (tmp_path / "corpus.bin").read_bytes()
    store.put_buffers("corpus.bin", [data[:-6]])  # truncated on the store
    with pytest.raises(FormatError, match=r"s3://.*/corpus\.bin: data file is .* \(truncated\)"):
        IndexedDataset(url, remote=RemoteOptions(cache_dir=tmp_path / "cache"))
    store.put_buffers("corpus.idx", [b"MMIDIDX\x00\x00" + b"\xff" * 30])  # a hostile header
    with pytest.raises(FormatError, match=r"corpus\.idx"):
        IndexedDataset(url, remote=RemoteOptions(cache_dir=tmp_path / "cache"))
    store.delete("corpus.bin")
    with pytest.raises(NotFoundError, match=r"corpus\.bin does not exist"):
        IndexedDataset(url, remote=RemoteOptions(cache_dir=tmp_path / "cache"))
