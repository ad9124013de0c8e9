"""Shards and StreamingDataset: order, partitioning, exact resume, the cache, real S3, bad input."""

from __future__ import annotations

import gc
import os
import subprocess

import numpy as np
import torch
import pytest

from tierio.data.cache import ShardCache, release_fd
from tierio.data.loader import StatefulLoader
from tierio.data.shards import ShardWriter, iter_tar_samples, load_manifest
from tierio.data.streaming import StreamingDataset
from tierio.errors import ConfigError, DiskFullError, IntegrityError, NotFoundError
from tierio.storage import open_store

N = 400


def _write(url, n=N, shard_size=320, seed=None, format="columns"):
    """n samples {x: [i, i*i mod 97], pad}; small shards so a dataset has many (10 samples of 32
    bytes in a columns shard, ~10 in a 16 KiB tar shard)."""
    if format == "tar" and shard_size == 320:
        shard_size = 16384
    with ShardWriter(url, ["x", "pad"], shard_bytes=shard_size, meta={"seed": seed}, format=format) as w:
        for i in range(n):
            w.write({"x": np.array([i, (i * i) % 97], np.int64), "pad": np.zeros(16, np.uint8)})
    return w.manifest


def _ids(samples):
    return [int(s["x"][0]) for s in samples]


@pytest.fixture
def local_url(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    _write(url)
    return url


@pytest.fixture
def tar_url(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    _write(url, format="tar")
    return url


def test_shards_are_plain_tar_and_webdataset_reads_them(tmp_path, tar_url):
    man = load_manifest(tar_url)
    assert man.num_samples == N and len(man.shards) > 5
    first = tmp_path / "remote" / man.shards[0].key
    listing = subprocess.run(["tar", "tf", str(first)], capture_output=True, text=True, check=True).stdout.split()
    assert listing[:2] == ["000000000000.x.npy", "000000000000.pad.npy"]
    assert [int(s["x"][0]) for s in iter_tar_samples(first)] == list(range(man.shards[0].samples))
    wds = pytest.importorskip("webdataset")
    got = list(wds.WebDataset([str(first)], shardshuffle=False).decode())
    assert [int(g["x.npy"][0]) for g in got] == list(range(man.shards[0].samples))


def test_epoch_covers_every_sample_once_and_order_is_a_function_of_seed_and_epoch(tmp_path, local_url):
    ds = StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=3, shuffle_buffer=32)
    e0 = _ids(ds)
    e1 = _ids(ds)
    assert sorted(e0) == list(range(N)) and sorted(e1) == list(range(N))
    assert e0 != e1 and e0 != list(range(N))
    again = StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=3, shuffle_buffer=32)
    assert _ids(again) == e0
    again.set_epoch(1)
    assert _ids(again) == e1
    other = StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=4, shuffle_buffer=32)
    assert _ids(other) != e0
    plain = StreamingDataset(local_url, None, shuffle=False)  # local store read in place
    assert _ids(plain) == list(range(N))


def test_ranks_partition_without_overlap(tmp_path, local_url):
    seen = []
    for rank in range(3):
        ds = StreamingDataset(local_url, tmp_path / "cache", "4MiB", rank=rank, world_size=3, seed=1)
        ids = _ids(ds)
        assert len(ids) == N // 3 and ids == ds.rank_sample_ids(0).tolist()
        seen += ids
    assert len(seen) == len(set(seen)) == 3 * (N // 3)


@pytest.mark.parametrize("workers_before, workers_after", [(0, 2), (2, 1)])
def test_exact_resume_after_worker_count_change(tmp_path, local_url, workers_before, workers_after):
    def make():
        return StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=7, shuffle_buffer=48, batch_size=8)

    full = make().rank_sample_ids(0).tolist()
    loader = StatefulLoader(make(), 8, num_workers=workers_before)
    got = []
    for step, batch in enumerate(loader):
        got += batch["x"][:, 0].tolist()
        if step == 9:
            state = loader.state_dict()
            break
    assert state["consumed"] == [[0, 80]] and got == full[:80]
    del loader
    gc.collect()
    resumed = StatefulLoader(make(), 8, num_workers=workers_after)
    resumed.load_state_dict(state)
    rest = [i for b in resumed for i in b["x"][:, 0].tolist()]
    assert got + rest == full  # nothing repeated, nothing skipped (N is a multiple of 8)
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["consumed"] == []


def test_state_dict_from_another_dataset_or_seed_is_refused(tmp_path, local_url):
    ds = StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=1)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    assert state["consumed"] == [[0, 5]]
    with pytest.raises(ConfigError, match="seed"):
        StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=2).load_state_dict(state)
    other_url = f"file://{tmp_path / 'other'}"
    _write(other_url, n=N + 8)
    with pytest.raises(ConfigError, match="another dataset"):
        StreamingDataset(other_url, tmp_path / "cache2", "4MiB", seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="shuffle_buffer"):
        StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=1, shuffle_buffer=7).load_state_dict(state)
    fresh = StreamingDataset(local_url, tmp_path / "cache", "4MiB", seed=1)
    fresh.load_state_dict(state)
    assert _ids(fresh) == ds.rank_sample_ids(0).tolist()[5:]


def test_cache_is_bounded_lru_and_never_evicts_a_shard_in_use(tmp_path, local_url):
    man = load_manifest(local_url)
    limit = 3 * man.max_shard_size
    with pytest.raises(ConfigError, match="smaller than shard"):
        StreamingDataset(local_url, tmp_path / "c0", man.max_shard_size - 1)
    ds = StreamingDataset(local_url, tmp_path / "cache", limit, seed=0, shuffle_buffer=1, max_open_shards=1, prefetch=0)
    assert sorted(_ids(ds)) == list(range(N))
    cache = ShardCache(open_store(local_url), tmp_path / "cache", limit)
    present, reserved = cache.usage()
    assert present <= limit and reserved == 0
    # pin one shard, then force the cache to make room for everything else
    pinned = man.shards[0]
    path, fd = cache.open_locked(pinned)
    try:
        for info in man.shards[1:]:
            cache.ensure(info)
        assert path.exists(), "a shard in use was evicted"
        assert cache.usage()[0] <= limit
    finally:
        release_fd(fd)
    # with every shard pinned there is no room: a clear error instead of blowing the limit
    tight = ShardCache(open_store(local_url), tmp_path / "tight", man.max_shard_size, wait_timeout=0.2)
    p0, fd0 = tight.open_locked(man.shards[0])
    try:
        with pytest.raises(ConfigError, match="in use"):
            tight.ensure(man.shards[1])
    finally:
        release_fd(fd0)


@pytest.mark.s3
def test_streams_from_s3_through_the_cache(tmp_path, s3_url):
    _write(s3_url)
    ds = StreamingDataset(s3_url, tmp_path / "cache", "4MiB", seed=5, batch_size=4)
    e0 = _ids(ds)
    assert sorted(e0) == list(range(N))
    cache = ds.cache
    misses = cache.misses
    assert misses == len(load_manifest(s3_url).shards)
    e1 = _ids(ds)
    assert sorted(e1) == list(range(N)) and cache.misses == misses  # second epoch: all from the cache
    # workers share the node cache and still produce the exact order
    loader = StatefulLoader(StreamingDataset(s3_url, tmp_path / "cache", "4MiB", seed=5, batch_size=4), 4, num_workers=2)
    assert [i for b in loader for i in b["x"][:, 0].tolist()] == e0


@pytest.mark.s3
def test_missing_and_corrupt_shards_on_the_server(tmp_path, s3_url):
    man = _write(s3_url)
    store = open_store(s3_url)
    victim = man.shards[2]
    data = bytearray(store_bytes := _read_all(store, victim.key))
    data[len(store_bytes) // 2] ^= 0xFF
    store.put_buffers(victim.key, [bytes(data)])
    ds = StreamingDataset(s3_url, tmp_path / "cache", "4MiB", shuffle=False, prefetch=0)
    with pytest.raises(IntegrityError, match=victim.key):
        _ids(ds)
    cache_files = [p.name for p in (tmp_path / "cache").iterdir() if p.is_file() and not p.name.startswith(".")]
    assert not any(victim.key in n for n in cache_files)  # the bad copy was not kept
    assert not list((tmp_path / "cache" / ".partial").iterdir())
    store.delete(victim.key)
    ds = StreamingDataset(s3_url, tmp_path / "cache", "4MiB", shuffle=False, prefetch=0)
    with pytest.raises(NotFoundError, match=f"{victim.key}.*missing"):
        _ids(ds)


def _read_all(store, key):
    from tierio.storage import read_bytes

    return read_bytes(store, key)


def test_cache_on_a_full_disk(tmp_path, small_tmpfs):
    url = f"file://{tmp_path / 'big'}"
    man = _write(url, n=64, shard_size=1 << 20)
    # fill the 64 MiB tmpfs so that less than one shard fits
    st = os.statvfs(small_tmpfs)
    free = st.f_bavail * st.f_frsize
    with open(small_tmpfs / "filler", "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(0, free - man.max_shard_size // 2))
    ds = StreamingDataset(url, small_tmpfs / "cache", "1GiB", shuffle=False, prefetch=0)
    with pytest.raises(DiskFullError, match="cache directory"):
        _ids(ds)
    leftovers = [p for p in (small_tmpfs / "cache").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert leftovers == []  # no partial shard left behind


def _rank_main(rank, world, url, cache, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = StreamingDataset(url, cache, "4MiB", seed=11)  # rank and world size from torch.distributed
        ids = _ids(ds)
        gathered = [None] * world
        dist.all_gather_object(gathered, ids)
        if rank == 0:
            out.put(gathered)
    finally:
        dist.destroy_process_group()


def test_real_gloo_ranks_get_disjoint_samples(tmp_path, local_url):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, local_url, str(tmp_path / "cache"), port, out)) for r in range(2)]
    for p in procs:
        p.start()
    gathered = out.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    a, b = gathered
    assert len(a) == len(b) == N // 2 and not set(a) & set(b)
    assert sorted(a + b) == list(range(N))


@pytest.fixture(scope="module")
def module_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("prop")
    url = f"file://{root / 'remote'}"
    _write(url, n=150, shard_size=4096)
    return url


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(1, 3), batch=st.integers(1, 7), workers=st.integers(1, 4), seed=st.integers(0, 5),
    buffer=st.integers(1, 64), cut=st.floats(0, 1),
)
def test_worker_streams_interleave_to_the_rank_order_from_any_position(module_url, monkeypatch, world, batch, workers,
                                                                       seed, buffer, cut):
    """Simulates the DataLoader: each worker batches its own stream; batches are taken round-robin."""
    import tierio.data.streaming as streaming

    for rank in range(world):
        ds = StreamingDataset(module_url, None, seed=seed, shuffle_buffer=buffer, rank=rank, world_size=world,
                              batch_size=batch, prefetch=0)
        order = ds.rank_sample_ids(2).tolist()
        start = int(cut * len(order))
        streams = []
        for w in range(workers):
            monkeypatch.setattr(streaming, "_worker", lambda w=w: (w, workers))
            ds.set_epoch(2)
            ds.resume(2, start)
            ids = _ids(ds)
            streams.append([ids[i : i + batch] for i in range(0, len(ids), batch)])
        merged = []
        for k in range(max(len(s) for s in streams)):
            for s in streams:
                if k < len(s):
                    merged += s[k]
        assert merged == order[start:]


def _as_dicts(batch):
    """A user's own collate_fn: it sees each sample as a dict of plain arrays."""
    assert all(isinstance(s["x"], np.ndarray) for s in batch)
    return {"x": torch.as_tensor(np.stack([s["x"] for s in batch]))}


def test_plain_dataloader_workers_hand_out_exactly_the_batches_of_no_workers(tmp_path):
    """Batches from workers' shared-memory slots equal the batches made without workers, byte for
    byte, whether the loop drops each batch (slots reused) or keeps them all (the slots run out:
    the rest come through the pipe); no segment stays behind in /dev/shm."""
    from torch.utils.data import DataLoader

    from tierio.data import wire

    url = f"file://{tmp_path / 'remote'}"
    _write(url, n=2000, shard_size=4096)
    ds = StreamingDataset(url, tmp_path / "cache", batch_size=16, seed=3)  # workers interleave whole batches
    alone = [{k: v.clone() for k, v in b.items()} for b in DataLoader(ds, batch_size=16, num_workers=0)]
    assert len(alone) == 125
    before = {p.name for p in wire.SHM_DIR.glob("tierio-wire-*")}
    ds.set_epoch(0)  # iterating in this process moved it to the next epoch; forked workers start at 0
    loader = DataLoader(ds, batch_size=16, num_workers=2)
    for i, b in enumerate(loader):  # each batch dropped before the next: its slot comes back
        assert all(torch.equal(b[k], alone[i][k]) and b[k].dtype == alone[i][k].dtype for k in b), f"batch {i}"
        if i == 8:  # both workers' segments are mapped by now: their names are gone, workers or not
            assert {p.name for p in wire.SHM_DIR.glob("tierio-wire-*")} <= before
    kept = list(loader)  # every batch alive at once: more than the workers' 2 x WIRE_SLOTS
    assert len(kept) == len(alone) > 2 * wire.WIRE_SLOTS
    assert all(torch.equal(b[k], a[k]) for b, a in zip(kept, alone) for k in a)
    del loader
    gc.collect()
    assert {p.name for p in wire.SHM_DIR.glob("tierio-wire-*")} <= before


def _reversed(batch):
    """A user's collate_fn that reorders the samples before torch's default_collate."""
    from torch.utils.data import default_collate

    return default_collate(batch[::-1])


def test_plain_dataloader_batches_reordered_by_the_users_collate_keep_their_order(local_url, tmp_path):
    """A worker's gather sits in a shared-memory slot; a batch of exactly its rows, in order, crosses
    as that slot. Rows reordered (or a batch that mixes gathers) are stacked into a new slot: the
    loop gets them in the order the collate_fn gave them."""
    from torch.utils.data import DataLoader

    ds = StreamingDataset(local_url, tmp_path / "cache", batch_size=16, seed=5)
    alone = list(DataLoader(ds, batch_size=16, num_workers=0))
    ds.set_epoch(0)
    flipped = list(DataLoader(ds, batch_size=16, num_workers=2, collate_fn=_reversed))
    assert len(flipped) == len(alone)
    assert all(torch.equal(b[k], a[k].flip(0)) for b, a in zip(flipped, alone) for k in a)
    ds.set_epoch(0)
    odd = list(DataLoader(ds, batch_size=12, num_workers=2))  # batches that straddle the gathers
    assert sorted(int(i) for b in odd for i in b["x"][:, 0]) == sorted(int(i) for b in alone for i in b["x"][:, 0])


def test_plain_dataloader_batches_too_large_for_a_ring_come_as_bytes(local_url, tmp_path, monkeypatch):
    """Batches a worker's ring could hold only a few of travel through the pipe, unchanged."""
    from torch.utils.data import DataLoader

    from tierio.data import wire

    monkeypatch.setattr(wire, "WIRE_RING_BYTES", wire.WIRE_SLOT_MIN_BYTES * (wire.WIRE_MIN_SLOTS - 1))
    ds = StreamingDataset(local_url, tmp_path / "cache", batch_size=8, seed=1)
    alone = list(DataLoader(ds, batch_size=8, num_workers=0))
    ds.set_epoch(0)
    before = {p.name for p in wire.SHM_DIR.glob("tierio-wire-*")}
    loader = iter(DataLoader(ds, batch_size=8, num_workers=2))
    got = [next(loader)]
    assert {p.name for p in wire.SHM_DIR.glob("tierio-wire-*")} <= before  # no ring was made
    got += list(loader)
    assert len(got) == len(alone) == N // 8 and all(torch.equal(b[k], a[k]) for b, a in zip(got, alone) for k in a)


def test_a_plain_dataloader_with_workers_gets_every_sample_once_as_tensors(local_url, tmp_path):
    """In a plain DataLoader's workers the batches travel in a shared-memory slot or as bytes
    (tierio.data.wire), not through a new segment per batch; the loop gets the same tensors as
    without workers."""
    from torch.utils.data import DataLoader

    ds = StreamingDataset(local_url, tmp_path / "cache", shuffle=False)
    alone = list(DataLoader(ds, batch_size=16, num_workers=0))
    with_workers = list(DataLoader(ds, batch_size=16, num_workers=2))
    for b in with_workers:
        assert isinstance(b["x"], torch.Tensor) and b["x"].dtype == alone[0]["x"].dtype == torch.int64
        assert isinstance(b["pad"], torch.Tensor) and b["pad"].shape[1:] == (16,)
        assert not b["x"].is_shared()  # a worker's slot or the pipe, not a new segment per batch
    ids = sorted(int(i) for b in with_workers for i in b["x"][:, 0])
    assert ids == sorted(int(i) for b in alone for i in b["x"][:, 0]) == list(range(N))
    own = list(DataLoader(ds, batch_size=16, num_workers=2, collate_fn=_as_dicts))
    assert sorted(int(i) for b in own for i in b["x"][:, 0]) == list(range(N))


def test_downloads_ahead_wait_for_the_first_shard(local_url, tmp_path):
    """Shards asked for ahead before any shard is open start downloading once the first one is in
    hand: they would split the link with the download the first batch waits for."""
    ds = StreamingDataset(local_url, tmp_path / "cache", shuffle=False)
    reader = ds._reader
    reader.prefetch([3, 4])
    assert reader._pool is None and not reader._pending  # nothing downloads before the first shard
    reader.shard(0)
    assert sorted(reader._pending) == [3, 4]
    for fut in list(reader._pending.values()):
        fut.result(timeout=30)
    reader.close()
    assert not reader._deferred
