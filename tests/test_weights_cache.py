"""WeightCache against a real SeaweedFS S3 server and real local directories."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierio.errors import ConfigError, IntegrityError
from tierio.storage import open_store
from tierio.weights import LoadStats, WeightCache, load


def make_model(d, n_shards=2, rows=64, seed=0):
    torch.manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    wm, ref = {}, {}
    for i in range(n_shards):
        part = {f"l{i}.w": torch.randn(rows, 1000).to(torch.bfloat16), f"l{i}.b": torch.randn(7)}
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(part, str(d / name))
        wm.update({k: name for k in part})
        ref.update(part)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    (d / "config.json").write_text('{"model_type": "test"}')
    return ref


def upload(d, url):
    store = open_store(url)
    for f in sorted(d.iterdir()):
        store.put_file(f.name, f)
    return store


def same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]), k


def test_s3_fill_is_pipelined_verified_and_hit_is_local(tmp_path, s3_url):
    ref = make_model(tmp_path / "m")
    upload(tmp_path / "m", s3_url)
    cache = WeightCache(tmp_path / "cache", 1 << 30)
    cold = LoadStats()
    same(cache.load(s3_url, stats=cold), ref)
    assert cold.extra["cache"] == "miss" and cold.remote_bytes > 0 and "cache-fill" in cold.method
    entry = cache.entries()[0]
    assert (entry.path / "config.json").exists()
    for f in (tmp_path / "m").glob("*.safetensors"):  # the cached copies are byte-identical
        assert (entry.path / f.name).read_bytes() == f.read_bytes()
    warm = LoadStats()
    same(cache.load(s3_url, stats=warm, verify="full"), ref)
    assert warm.extra["cache"] == "hit" and warm.remote_bytes == 0
    # keys while filling still fills every byte
    cache.evict(s3_url)
    part = cache.load(s3_url, keys=["l1.b"])
    assert list(part) == ["l1.b"] and torch.equal(part["l1.b"], ref["l1.b"])
    same(load(cache.fetch(s3_url)), ref)


def test_cold_cpu_load_maps_the_cache_and_private_mode_does_not(tmp_path, s3_url):
    ref = make_model(tmp_path / "m", rows=3000)  # ~6 MiB a shard: several 2 MiB checksum windows
    upload(tmp_path / "m", s3_url)
    cache = WeightCache(tmp_path / "cache", 1 << 30, chunk_bytes="2MiB")
    cold = LoadStats()
    out = cache.load(s3_url, stats=cold)
    same(out, ref)
    assert cold.method == "mapped+cache-fill" and cold.tensors == len(ref) and cold.remote_bytes == cold.bytes
    full = LoadStats()
    same(cache.load(s3_url, stats=full, verify="full"), ref)  # 64 MiB map windows check every 2 MiB sum
    assert full.method == "mapped"
    assert cache.evict(s3_url)  # the mapped tensors outlive the entry: its files are unlinked, not rewritten
    same(out, ref)
    priv = LoadStats()
    same(cache.load(s3_url, stats=priv, mapped=False), ref)
    assert priv.method == "host-arena+cache-fill"
    shard = cache.entries()[0].path / "model-00001-of-00002.safetensors"
    fd = os.open(shard, os.O_WRONLY)
    os.pwrite(fd, b"\xff", (2 << 20) + 12345)  # inside the second checksum window of the file
    os.close(fd)
    with pytest.raises(IntegrityError, match=f"bytes {2 << 20}..{4 << 20} fail their checksum"):
        cache.load(s3_url, verify="full")
    with pytest.raises(ConfigError, match="multiple of 2 MiB"):
        WeightCache(tmp_path / "c2", 1 << 30, chunk_bytes=3 << 20)


def test_corruption_is_caught_and_changed_source_refetched(tmp_path, s3_url):
    make_model(tmp_path / "m")
    upload(tmp_path / "m", s3_url)
    cache = WeightCache(tmp_path / "cache", 1 << 30)
    cache.fetch(s3_url)
    shard = cache.entries()[0].path / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="checksum"):
        cache.load(s3_url, verify="full")
    # a new version at the source (other size) is fetched again
    ref2 = make_model(tmp_path / "m2", rows=65, seed=3)
    upload(tmp_path / "m2", s3_url)
    st = LoadStats()
    same(cache.load(s3_url, stats=st), ref2)
    assert st.extra["cache"] == "miss"


def test_lru_eviction_by_size_skips_entries_in_use(tmp_path):
    srcs = []
    for i in range(3):
        make_model(tmp_path / f"m{i}", seed=i)
        srcs.append(str(tmp_path / f"m{i}"))
    one = sum(f.stat().st_size for f in (tmp_path / "m0").iterdir())
    cache = WeightCache(tmp_path / "cache", int(2.5 * one))
    cache.fetch(srcs[0])
    cache.fetch(srcs[1])
    cache.load(srcs[0])  # m0 becomes most recently used
    cache.fetch(srcs[2])
    assert sorted(e.source for e in cache.entries()) == sorted([srcs[0], srcs[2]])
    # an entry held by a loader (shared lock) is not evicted; the fill fails instead
    held = os.open(tmp_path / "cache" / "locks" / f"{cache.entry_name(srcs[0])}.lock", os.O_RDWR)
    held2 = os.open(tmp_path / "cache" / "locks" / f"{cache.entry_name(srcs[2])}.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_SH)
    fcntl.flock(held2, fcntl.LOCK_SH)
    try:
        with pytest.raises(Exception, match="in use"):
            cache.fetch(srcs[1])
    finally:
        os.close(held)
        os.close(held2)
    with pytest.raises(ConfigError, match="at most"):
        WeightCache(tmp_path / "small", one // 2).fetch(srcs[0])


def _child(root, url, q):
    out = WeightCache(root, 1 << 30).load(url)
    q.put({k: v.float().sum().item() for k, v in out.items()})


def test_two_processes_share_one_fill(tmp_path, s3_url):
    ref = make_model(tmp_path / "m")
    upload(tmp_path / "m", s3_url)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(str(tmp_path / "cache"), s3_url, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    want = {k: v.float().sum().item() for k, v in ref.items()}
    assert results[0] == results[1] == want
    entries = WeightCache(tmp_path / "cache", 1 << 30).entries()
    assert len(entries) == 1
    assert not [p for p in (tmp_path / "cache" / "entries").iterdir() if p.name.startswith(".")]  # no temp left


def test_cli_fetch_load_inspect(tmp_path, s3_url):
    make_model(tmp_path / "m")
    upload(tmp_path / "m", s3_url)
    env = {**os.environ}
    run = lambda *a: subprocess.run([sys.executable, "-m", "tierio", "weights", *a], capture_output=True, text=True, env=env)  # noqa: E731
    r = run("fetch", s3_url, "--cache", str(tmp_path / "c"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"] > 0
    r = run("load", s3_url, "--cache", str(tmp_path / "c"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["extra"]["cache"] == "hit"
    r = run("inspect", str(tmp_path / "m"), "--json")
    assert json.loads(r.stdout)["kind"] == "hf"
    r = run("load", str(tmp_path / "missing"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    ref = load_file(str(tmp_path / "m" / "model-00001-of-00002.safetensors"))
    assert ref  # the source files are untouched


def test_fetch_reports_download_progress(tmp_path, s3_url):
    make_model(tmp_path / "m")
    upload(tmp_path / "m", s3_url)
    shards = sum(f.stat().st_size for f in (tmp_path / "m").glob("*.safetensors"))
    calls = []
    WeightCache(tmp_path / "cache", 1 << 30).fetch(s3_url, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (shards, shards)


def test_sizes_take_text_and_the_old_chunk_keyword_warns(tmp_path):
    cache = WeightCache(tmp_path / "cache", "64GiB", chunk_bytes="4MiB")
    assert cache.max_bytes == 64 << 30 and cache.chunk_size == 4 << 20
    with pytest.warns(DeprecationWarning, match="chunk_size"):
        assert WeightCache(tmp_path / "c2", 1 << 30, chunk_size=2 << 20).chunk_size == 2 << 20
    with pytest.raises(ConfigError, match="must be positive"):
        WeightCache(tmp_path / "c3", None)
