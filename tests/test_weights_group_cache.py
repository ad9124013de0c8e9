"""Cooperative loads through each node's weight cache: 4 real gloo ranks on nodes simulated with
TIERIO_NODE, each node with its own cache directory. Cold nodes fill their cache from the group's
stream (byte-exact files, a committed record); a node whose copy was evicted is filled from the warm
node's ranks without reading the source, also when those only serve (``keys=[]``); warm everywhere,
no exchange; a cache that cannot take
the model never fails the load; a cached copy of another version of the model is refused by name."""

from __future__ import annotations

import json
import os
import random
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from test_weights_group import _reporting, _run, _same
from test_weights_tp import _model
from tierio.io.buffers import HostBuffer
from tierio.io.checksum import xxh3
from tierio.storage.download import WindowWriter
from tierio.weights import LoadStats, TensorParallel, WeightCache, load
from tierio.weights.engine import Counters
from tierio.weights.group import Stream
from tierio.weights.group_cache import StreamFill, fill_while
from tierio.weights.sources import resolve

CHUNK = 64 * 1024


def _files(d: Path) -> dict[str, str]:
    return {p.name: xxh3(p.read_bytes()) for p in sorted(d.glob("*.safetensors"))}


def test_stream_fill_writes_the_source_files_byte_exact_from_pieces_of_any_size(tmp_path):
    """Headers longer than a window, tails after the data section, empty shards, odd sizes: the
    files written from the stream equal the source's, fed whole or in random pieces."""
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    g = torch.Generator().manual_seed(3)
    long_names = {f"t{i:05d}_" + "x" * 200: torch.randn(3, generator=g) for i in range(12_000)}  # a ~3 MiB header
    save_file(long_names, str(src_dir / "a.safetensors"))
    save_file({"big": torch.randn(1_700_001, generator=g), "odd": torch.arange(7, dtype=torch.int8)}, str(src_dir / "b.safetensors"))
    save_file({"e": torch.empty(0)}, str(src_dir / "c.safetensors"))
    with open(src_dir / "b.safetensors", "ab") as f:  # bytes after the data section are part of the file
        f.write(b"trailing bytes")
    for label, pieces in (("whole", None), ("pieces", random.Random(5))):
        src = resolve(str(src_dir))
        counters = Counters()
        stream = Stream(src, counters)
        out = tmp_path / label
        out.mkdir()
        writers = {id(s): WindowWriter(out / s.key, direct=True) for s in src.shards}
        sink = StreamFill(stream.segments, stream.readers, writers, src, 2 << 20)
        data = HostBuffer(stream.size, pin=False).tensor()[: stream.size]  # aligned: whole windows written in place
        stream.read(0, stream.size, data)
        view = memoryview(data.numpy())
        at = 0
        while at < stream.size:
            n = stream.size - at if pieces is None else pieces.choice([1, 4095, 4096, 70_000, 3 << 20])
            sink.feed(at, view[at : at + n])
            at += n
        sink.finish()
        for s in src.shards:
            writers[id(s)].close(s.size)
            assert sorted(writers[id(s)].sums) == list(range(0, s.size, 2 << 20)), (label, s.key)
        stream.close()
        assert _files(out) == _files(src_dir), label


def _cache_worker(rank: int, root: str, init: str) -> None:
    import tierio.weights as weights
    from tierio.errors import GroupError

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4, timeout=timedelta(seconds=60))
    with _reporting(root, rank) as result:
        d = os.path.join(root, "m")
        want = load(d)
        url = str(d)

        def step(label: str, layout: str, cache: WeightCache, **kw) -> dict:
            os.environ["TIERIO_NODE"] = f"node-{layout[rank]}"
            st = weights.LoadStats()
            got = weights.load_group(d, stats=st, chunk_bytes=CHUNK, cache=cache, **kw)
            res = {"ok": _same(got, load(d, shard=kw["shard"]) if "shard" in kw else want), "bytes": st.bytes,
                   "cache": st.extra.get("cache"), "exchange": st.extra.get("group_exchange")}
            result[label] = res
            dist.barrier()
            return res

        node = "aabb"[rank]
        cache = WeightCache(os.path.join(root, f"cache-{node}"), "1GiB", chunk_bytes="2MiB")
        step("cold", "aabb", cache)
        dist.barrier()
        if rank == 2:  # node b loses its copy
            result["evicted"] = cache.evict(url)
        dist.barrier()
        step("b_evicted", "aabb", cache)
        # node b's copy gone again; node a's ranks are running replicas that only serve (keys=[])
        if rank == 2:
            cache.evict(url)
        dist.barrier()
        os.environ["TIERIO_NODE"] = f"node-{node}"
        st = weights.LoadStats()
        got = weights.load_group(d, stats=st, chunk_bytes=CHUNK, cache=cache, keys=[] if rank < 2 else None)
        result["serve"] = {"ok": got == {} if rank < 2 else _same(got, want), "cache": st.extra.get("cache"),
                           "bytes": st.bytes}
        dist.barrier()
        step("warm", "aabb", cache)
        step("warm_tp", "aabb", cache, shard=TensorParallel(rank % 2, 2))
        # every rank alone on its node, only rank 0's node warm: a broadcast per reader, three fills
        alone = WeightCache(os.path.join(root, "cache-a" if rank == 0 else f"cache-alone-{rank}"), "1GiB", chunk_bytes="2MiB")
        step("alone", "abcd", alone)
        # a node whose cache cannot take the model still loads
        tiny = WeightCache(os.path.join(root, f"cache-tiny-{node}"), "64KiB", chunk_bytes="2MiB")
        step("tiny", "aabb", tiny)
        # node a's copy stays in use unchecked (check_source=False) while the source changes: refused by name
        unchecked = WeightCache(os.path.join(root, f"cache-{node}"), "1GiB", chunk_bytes="2MiB", check_source=False)
        if rank == 2:
            unchecked.evict(url)
            save_file({"model.norm.weight": torch.zeros(8)}, os.path.join(d, "model-00002-of-00002.safetensors"))
        dist.barrier()
        os.environ["TIERIO_NODE"] = f"node-{node}"
        try:
            weights.load_group(d, chunk_bytes=CHUNK, cache=unchecked)
        except GroupError as exc:
            result["stale_error"] = str(exc)
    dist.destroy_process_group()


def test_nodes_fill_their_caches_from_the_group_and_a_cold_node_loads_from_a_warm_one(tmp_path):
    t = _model(tmp_path / "m")
    stream = sum(x.numel() * x.element_size() for x in t.values())
    headers = sum(p.stat().st_size for p in (tmp_path / "m").glob("*.safetensors")) - stream
    first = _files(tmp_path / "m")  # the last step rewrites one of them
    assert _run(_cache_worker, 4, tmp_path) == [0, 0, 0, 0]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, x in enumerate(res):
        assert "unexpected" not in x, x["unexpected"]
        for label in ("cold", "b_evicted", "warm", "warm_tp", "alone", "tiny"):
            assert x[label]["ok"], (r, label, x[label])
        # cold: every rank reads its quarter of the source; each node's lowest rank fills its cache
        assert x["cold"]["exchange"] == "node-local memory, 2 node(s)"
        assert x["cold"]["cache"] == ("filled" if r in (0, 2) else None)
        assert x["cold"]["bytes"] <= stream / 4 + CHUNK + (headers if r in (0, 2) else 0)
        # node b's copy evicted: node a's ranks read from their copies, node b's read nothing
        assert x["b_evicted"]["exchange"].endswith("read from the cached copies of rank(s) [0, 1]"), x["b_evicted"]
        assert x["b_evicted"]["cache"] == ("filled" if r == 2 else None)
        assert x["b_evicted"]["bytes"] <= (stream / 2 + CHUNK if r < 2 else headers if r == 2 else 0), (r, x["b_evicted"])
        assert x["serve"]["ok"] and x["serve"]["cache"] == ("filled" if r == 2 else None)
        assert x["serve"]["bytes"] <= (stream / 2 + CHUNK if r < 2 else headers if r == 2 else 0), (r, x["serve"])
        assert x["warm"]["exchange"].startswith("none") and x["warm"]["cache"] == "hit"
        assert x["warm_tp"]["exchange"].startswith("none")
        assert x["alone"]["exchange"].startswith("group (every rank is alone on its node), read from the cached copies of rank(s) [0]")
        assert x["alone"]["cache"] == ("filled" if r else None)
        assert (x["tiny"]["cache"] or "").startswith("not filled") if r in (0, 2) else x["tiny"]["cache"] is None
        assert "ranks [2, 3] see other files than rank 0" in x["stale_error"], x.get("stale_error")
    assert res[2]["evicted"] is True
    # the fills are committed, byte-exact copies of the source's files
    for node in ("a", "alone-1", "alone-2", "alone-3"):  # (node b's was evicted by the last step)
        cache = WeightCache(tmp_path / f"cache-{node}", "1GiB", chunk_bytes="2MiB", check_source=False)
        (entry,) = cache.entries()
        assert _files(entry.path) == first, node


def test_cli_group_load_through_the_cache_fills_once_then_hits(tmp_path):
    """``torchrun ... tierio weights load SRC --group --cache-dir C --json`` twice: the first run
    fills the (one node's) cache, the second loads every rank from it without an exchange."""
    import subprocess
    import sys

    from tierio.storage.seaweed import free_port

    _model(tmp_path / "m")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    got = []
    for run in ("first", "second"):
        logs = tmp_path / f"logs-{run}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "--log-dir", str(logs), "--redirects", "1", "-m", "tierio", "weights",
               "load", str(tmp_path / "m"), "--group", "--cache-dir", str(tmp_path / "cache"), "--json"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        outs = sorted(logs.rglob("stdout.log"), key=lambda f: f.parent.name)
        got.append([json.loads(f.read_text())["extra"] for f in outs])
    assert [x.get("cache") for x in got[0]] == ["filled", None]
    assert [x["cache"] for x in got[1]] == ["hit", "hit"] and all(x["group_exchange"].startswith("none") for x in got[1])


ENDS = """
import os, sys
import torch.distributed as dist
from tierio.cli.main import main
code = main(["weights", "load", sys.argv[1], "--group", "--json"])
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("ENDS", code, dist.is_initialized(), [t for t in threads if "gloo" in t])
"""


def test_the_cli_group_load_ends_the_process_group_it_started(tmp_path):
    """Its gloo threads would otherwise live to the interpreter's exit, whose teardown of them
    sometimes aborted a rank after a finished load (a torchrun job failing with SIGABRT)."""
    import subprocess
    import sys

    from tierio.storage.seaweed import free_port

    _model(tmp_path / "m")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    p = subprocess.run([sys.executable, "-c", ENDS, str(tmp_path / "m")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ENDS 0 False []" in p.stdout, p.stdout[-2000:]


def _killed_worker(rank: int, root: str, init: str) -> None:
    """Two simulated nodes, each filling its cache; rank 1 dies by SIGKILL mid-load. Rank 0 is told
    which rank, its half-made fill is not committed, and alone it loads and fills again."""
    import signal

    import tierio.weights as weights
    from tierio.errors import GroupError

    os.environ["TIERIO_NODE"] = f"node-{rank}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    with _reporting(root, rank) as result:
        d = os.path.join(root, "m")
        cache = WeightCache(os.path.join(root, f"cache-{rank}"), "1GiB", chunk_bytes="2MiB")

        def die(done: int, total: int) -> None:
            if rank == 1 and done > 0:
                os.kill(os.getpid(), signal.SIGKILL)

        try:
            weights.load_group(d, chunk_bytes=CHUNK, cache=cache, progress=die)
        except GroupError as exc:
            result["error"] = str(exc)
        result["entries_after_error"] = len(cache.entries())
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=init + "-again", rank=0, world_size=1, timeout=timedelta(seconds=60))
        st = weights.LoadStats()
        result["retry_ok"] = _same(weights.load_group(d, stats=st, chunk_bytes=CHUNK, cache=cache), load(d))
        result["retry_cache"] = st.extra.get("cache")
        result["entries"] = len(cache.entries())
    os._exit(0)  # the first group lost a rank: no collective teardown


def test_a_rank_killed_during_a_cached_group_load_is_named_and_no_half_fill_is_committed(tmp_path):
    _model(tmp_path / "m")
    assert _run(_killed_worker, 2, tmp_path) == [0, -9]
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert "unexpected" not in res, res["unexpected"]
    assert "rank(s) [1] of the group stopped answering" in res["error"], res
    assert res["entries_after_error"] == 0
    assert res["retry_ok"] and res["retry_cache"] == "filled" and res["entries"] == 1
    assert not any((tmp_path / "cache-0" / ".partial").iterdir())  # the dead fill's scratch went with it


def test_an_exchange_that_fails_inside_a_fill_is_raised_and_never_run_again(tmp_path):
    """The exchange is this rank's part of a collective: after it failed inside the fill (a source
    read error, here), running it again outside would be out of step with the other ranks."""
    import errno

    import pytest

    _model(tmp_path / "m")
    src = resolve(str(tmp_path / "m"))
    stream = Stream(src, Counters())
    cache = WeightCache(tmp_path / "cache", "1GiB", chunk_bytes="2MiB")
    calls = []

    def exchange(sink):
        calls.append(sink)
        raise OSError(errno.EIO, "a read from the source failed")

    from tierio.errors import StorageError

    with pytest.raises(StorageError, match="a read from the source failed"):  # the cache names where it was filling
        fill_while(cache, str(tmp_path / "m"), src, stream.segments, stream.readers, exchange, LoadStats())
    stream.close()
    assert len(calls) == 1 and calls[0] is not None and cache.entries() == []
