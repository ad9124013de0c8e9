"""The restore modes, bit for bit: new memory (maps of local shard files), in place (into=), and
resharding; a chunk that fails its checksum while a map is populated sends the file to the next copy."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tierio.ckpt import CheckpointManager, TensorSlice
from tierio.errors import ConfigError, IntegrityError
from tierio.format.manifest import parse_manifest

from test_ckpt_reshard import WHOLE, ranks, save_rows


def make_state() -> dict:
    g = torch.Generator().manual_seed(16)
    return {
        "big": torch.randn(17 << 20, generator=g),  # 68 MiB: two checksum chunks, the first populated in 4 windows
        "w": torch.randn(333, 77, generator=g),
        "h": torch.randn(1001, generator=g).bfloat16(),
        "i8": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "nested": {"m": [torch.arange(5), torch.ones(3, 3, dtype=torch.float16)]},
        "step": 9,
    }


def tensors(state) -> dict[str, torch.Tensor]:
    out = {}

    def walk(prefix, v):
        if isinstance(v, torch.Tensor):
            out[prefix] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)
    walk("", state)
    return out


def assert_same(got, want) -> None:
    a, b = tensors(got), tensors(want)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k  # bits, not values
    assert got["step"] == want["step"]


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state).values())


def shard(root: Path, step: int = 1, rank: int = 0) -> Path:
    return root / f"step_{step:09d}" / f"rank_{rank:05d}.safetensors"


def test_new_memory_restore_maps_the_files_bit_exact_and_writable(tmp_path):
    state = make_state()
    with CheckpointManager([tmp_path]) as mgr:
        mgr.save(1, state).wait()
    with CheckpointManager([tmp_path]) as mgr:
        got = mgr.restore()
        assert_same(got, state)
        stats = mgr.stats()["restore"]
        assert stats["step"] == 1 and stats["mapped_bytes"] == nbytes(state) and stats["read_bytes"] == 0
        got["big"].add_(1)  # copy-on-write: the checkpoint's file is not changed by training
        got["nested"]["m"][1][0, 0] = 7
        assert_same(mgr.restore(), state)
        private = mgr.restore(mapped=False)
        assert_same(private, state)
        stats = mgr.stats()["restore"]
        assert stats["mapped_bytes"] == 0 and stats["read_bytes"] == nbytes(state)
        way = mgr.stats()["tiers"][0]["read_path"]
        assert way["chosen"] in ("direct", "buffered", "measuring")


def test_a_restored_rng_state_is_accepted_by_torch(tmp_path):
    # torch.set_rng_state reads the tensor's storage from its start: a mapped tensor owns its storage
    with CheckpointManager([tmp_path]) as mgr:
        mgr.save(1, {"pad": torch.ones(7, dtype=torch.int8), "rng": torch.get_rng_state()}).wait()
        got = mgr.restore()
    expected = torch.rand(4, generator=torch.Generator().set_state(got["rng"].clone()))
    torch.set_rng_state(got["rng"])
    assert torch.equal(torch.rand(4), expected)


def test_the_read_way_is_chosen_by_measurement_per_file_system():
    from tierio.io.readpath import CLEAR, SAMPLES, ReadPath

    way = ReadPath(device=1)
    picks = [way.direct() for _ in range(4)]
    assert picks == [True, False, True, False]  # alternates while measuring
    assert CLEAR > 1.5
    for _ in range(SAMPLES):
        assert way.measuring
        way.record(True, 200, 1.0)
        assert way.measuring
        way.record(False, 300, 1.0)  # 1.5x: not clear from one pair, decided by SAMPLES of each
    assert way.chosen == "buffered" and not way.direct()
    assert way.to_dict() == {"chosen": "buffered", "direct_gb_per_s": 0.0, "buffered_gb_per_s": 0.0}
    clear = ReadPath(device=4)
    clear.record(True, 1e8, 1.0)
    clear.record(True, 2e8, 1.0)
    assert clear.measuring  # one way alone decides nothing
    clear.record(False, 3.5e9, 1.0)
    assert clear.chosen == "buffered"  # far ahead from its first sample: no more slow reads
    fast_disk = ReadPath(device=2)
    for _ in range(SAMPLES):
        fast_disk.record(True, 3e9, 1.0)
        fast_disk.record(False, 1e9, 1.0)
    assert fast_disk.chosen == "direct" and fast_disk.direct()


def test_o_direct_must_win_clearly_and_bounced_destinations_are_measured_apart(tmp_path):
    from tierio.io.readpath import MARGIN, SAMPLES, ReadPath, forget
    from tierio.storage.local import LocalStore

    close_call = ReadPath(device=3)
    for _ in range(SAMPLES):  # O_DIRECT ahead, but within the noise of a loaded machine: buffered
        close_call.record(True, 1.1e9, 1.0)
        close_call.record(False, 1e9, 1.0)
    assert MARGIN > 1.1 and close_call.chosen == "buffered"
    forget()
    store = LocalStore(tmp_path)
    data = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    store.put_buffers("f", [memoryview(data.numpy())])  # 16 MiB
    a, b = (torch.zeros((16 << 20) + 4096, dtype=torch.uint8) for _ in range(2))
    lands = a[(-a.data_ptr()) % 4096:][: 16 << 20]  # address = offset 0 modulo 4 KiB: O_DIRECT lands in it
    bounces = b[(64 - b.data_ptr()) % 4096:][: 8 << 20]  # 64 bytes off: O_DIRECT would bounce every byte
    store.read_into("f", 0, memoryview(lands.numpy()))
    store.read_into("f", 0, memoryview(bounces.numpy()))
    store.read_into("f", 8 << 20, memoryview(bounces.numpy()))
    way, bounced = store.read_path(), store.read_path(bounced=True)
    assert way is not bounced and bounced.bounced and not way.bounced
    if way.chosen is None:  # (a file system without O_DIRECT settles on buffered at once)
        samples = {k: len(v) for k, v in way.rates.items()}, {k: len(v) for k, v in bounced.rates.items()}
        assert samples == ({"direct": 1, "buffered": 0}, {"direct": 1, "buffered": 1})  # each of its own kind
    assert torch.equal(lands, data) and torch.equal(bounces, data[8 << 20:])
    forget()


def test_in_place_restore_reads_into_the_given_tensors_bit_exact(tmp_path):
    state = make_state()
    with CheckpointManager([tmp_path]) as mgr:
        mgr.save(1, state).wait()
    into = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    into["nested"] = {"m": [torch.zeros(5, dtype=torch.int64), torch.zeros(3, 3, dtype=torch.float16)]}
    big = into["big"]
    with CheckpointManager([tmp_path]) as mgr:
        got = mgr.restore(into=into)
        assert got["big"] is big
        assert_same(got, state)
        stats = mgr.stats()["restore"]
        assert stats["mapped_bytes"] == 0 and stats["read_bytes"] == nbytes(state)


def test_resharding_restores_into_new_memory_and_in_place(tmp_path):
    save_rows(tmp_path)  # w: rows 0..4 in rank 0's file, 5..9 in rank 1's; b written by rank 0 only
    with CheckpointManager([tmp_path]) as mgr:  # one rank, new memory: w spans two files, b lies in one
        got = mgr.restore()
        assert torch.equal(got["w"], WHOLE) and torch.equal(got["b"], torch.ones(3, dtype=torch.bfloat16))
        stats = mgr.stats()["restore"]
        assert stats["mapped_bytes"] == 6 and stats["read_bytes"] == WHOLE.numel() * 4
    for world in (2, 3):
        def one(r: int, world: int = world) -> None:
            lo, hi = 10 * r // world, 10 * (r + 1) // world
            target = TensorSlice(torch.full((hi - lo, 6), -1.0), (lo, 0), (10, 6))
            with CheckpointManager([tmp_path], rank=r, world_size=world) as mgr:
                out = mgr.restore(into={"w": target})
                assert out["w"] is target and torch.equal(target.local, WHOLE[lo:hi])
                fresh = mgr.restore()
                assert torch.equal(fresh["w"], WHOLE) and fresh["n"] == 7
        ranks(world, one)


def test_a_global_tensor_saved_whole_is_mapped(tmp_path):
    with CheckpointManager([tmp_path]) as mgr:
        mgr.save(1, {"w": TensorSlice(WHOLE.clone(), (0, 0), (10, 6))}).wait()
    with CheckpointManager([tmp_path]) as mgr:
        assert torch.equal(mgr.restore()["w"], WHOLE)
        assert mgr.stats()["restore"]["mapped_bytes"] == WHOLE.numel() * 4


def test_populate_windows_group_small_chunks_and_cut_large_ones_on_pages():
    from tierio.ckpt.restore.mapped import windows
    from tierio.format.manifest import ChunkInfo

    def chunk(begin: int, end: int) -> ChunkInfo:
        return ChunkInfo("rank_00000.safetensors", begin, end, (0,), (end - begin,), "0" * 16)

    size = 16 * 4096
    small = [chunk(4096 + i * 10_000, 4096 + (i + 1) * 10_000) for i in range(6)]  # 60,000 bytes
    big = chunk(small[-1].end, small[-1].end + 3 * size + 123)
    got = windows(small + [big], 4096, size)
    assert [len(w.chunks) for w in got] == [6, 1, 1, 1, 1]
    assert got[0].offset == 0 and got[0].length == 60_000
    pieces = got[1:]
    assert all(w.chunks == [big] for w in pieces)
    assert pieces[0].offset == big.begin - 4096 and all(w.length <= size for w in pieces)
    assert all(w.length % 4096 == 0 for w in pieces[:-1])
    assert sum(w.length for w in pieces) == big.nbytes  # every byte once, none past the chunk
    assert all(a.offset + a.length == b.offset for a, b in zip(pieces, pieces[1:]))


def corrupt_chunk(root: Path, name: str, index: int) -> None:
    """Flip one byte in the middle of chunk ``index`` of tensor ``name`` of rank 0's shard of step 1."""
    raw = (root / "step_000000001" / "manifest.json").read_bytes()
    man = parse_manifest(raw, "manifest", expect_step=1)
    c = man.ranks[0].tensors[name].chunks[index]
    with open(shard(root), "r+b") as f:
        f.seek((c.begin + c.end) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("index", [0, 1])
def test_a_chunk_failing_its_checksum_while_mapping_falls_back_to_the_next_copy(tmp_path, index):
    state = make_state()
    tiers = [tmp_path / "fast", tmp_path / "slow"]
    with CheckpointManager(tiers) as mgr:
        mgr.save(1, state).wait()
        mgr.wait()
    corrupt_chunk(tiers[0], "big", index)
    with CheckpointManager(tiers) as mgr:
        with pytest.warns(UserWarning, match=r"passed over are unusable: checksum mismatch in .*fast/step_000000001/rank_00000.safetensors"):
            got = mgr.restore(1)
        assert_same(got, state)
        assert mgr.stats()["restore"]["mapped_bytes"] == nbytes(state)
        assert mgr.restored_from.endswith("slow")
    corrupt_chunk(tiers[1], "big", index)
    with CheckpointManager(tiers) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(IntegrityError, match="no valid copy of step 1"):
            mgr.restore(1)


def test_a_mapped_tensor_unmaps_its_file_when_dropped_without_waiting_for_gc(tmp_path):
    # A file deleted by retention keeps taking space (a tmpfs tier) while a map of it lives.
    import gc

    with CheckpointManager([tmp_path]) as mgr:
        mgr.save(1, make_state()).wait()
        gc.disable()
        try:
            assert mgr.restore(1)["w"].shape == (333, 77)
            assert str(shard(tmp_path)) not in Path("/proc/self/maps").read_text()
        finally:
            gc.enable()


def test_a_restore_from_s3_fills_tier_0_so_the_next_restore_reads_it_locally(tmp_path, s3_url):
    from tierio.ckpt import verify

    state = make_state()
    nvme = tmp_path / "nvme"
    with CheckpointManager([nvme, s3_url]) as mgr:
        mgr.save(1, state).wait()
    shutil.rmtree(nvme)  # a new node, or the node's disk was lost
    with CheckpointManager([nvme, s3_url]) as mgr:
        assert_same(mgr.restore(), state)  # streamed from S3 into memory
        local, s3 = mgr.tiers
        got = mgr.stats()["restore"]
        assert got["from"] == s3 and got["fill"] == local and got["mapped_bytes"] == 0
    assert verify(nvme, 1).ok  # copied behind the restore (the manager waits for it at close), verified
    with CheckpointManager([nvme, s3_url]) as mgr:
        assert_same(mgr.restore(), state)
        got = mgr.stats()["restore"]
        assert got["from"] == local and got["mapped_bytes"] == nbytes(state) and "fill" not in got


def test_restoring_some_parts_reads_only_their_bytes(tmp_path):
    state = {"model": {"w": torch.randn(64, 64)}, "optimizer": {"m": torch.randn(256, 256)}, "step": 3}
    with CheckpointManager([tmp_path]) as mgr:
        mgr.save(1, state).wait()
    with CheckpointManager([tmp_path]) as mgr:
        got = mgr.restore(parts=["model"])  # e.g. the best model at the end of training, without its optimizer
        assert got.keys() == {"model"} and torch.equal(got["model"]["w"], state["model"]["w"])
        stats = mgr.stats()["restore"]
        assert stats["mapped_bytes"] + stats["read_bytes"] == state["model"]["w"].nbytes
        with pytest.raises(ConfigError, match=r"no part 'scheduler'; pass parts among \['model', 'optimizer', 'step'\]"):
            mgr.restore(parts=["scheduler"])
