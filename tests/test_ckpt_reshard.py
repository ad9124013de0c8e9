"""Global tensors in one process: resharding rules, hostile manifests, records by reference, DCP.

Ranks here are managers with an explicit rank and world size on threads of one process (the gloo
versions are in test_ckpt_cluster.py); the storage is real directories."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch

from tierio.ckpt.restore import reshard
from tierio.ckpt import (
    CheckpointManager,
    TensorSlice,
    inspect,
    list_checkpoints,
    verify,
)
from tierio.cli.main import main
from tierio.errors import ConfigError, FormatError, IntegrityError
from tierio.io.engine import ByteRange
from tierio.storage.local import LocalStore

WHOLE = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)


def ranks(world: int, fn) -> None:
    """Run ``fn(rank)`` for every rank on its own thread; re-raise the first failure."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def save_rows(root: Path, step: int = 1, world: int = 2, **options) -> None:
    """``w`` split by rows over ``world`` ranks, ``b`` replicated (written by rank 0), a count."""
    def one(r: int) -> None:
        rows = 10 // world
        with CheckpointManager([root], rank=r, world_size=world, run_id="rows", **options) as mgr:
            mgr.save(step, {"w": TensorSlice(WHOLE[r * rows:(r + 1) * rows].clone(), (r * rows, 0), (10, 6)),
                            "b": TensorSlice(torch.ones(3, dtype=torch.bfloat16), (0,), (3,), write=r == 0),
                            "n": 7}).wait()
    ranks(world, one)


def edit_manifest(root: Path, fn, step: int = 1) -> None:
    path = root / f"step_{step:09d}" / "manifest.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_reshard_rows_to_columns_and_whole(tmp_path):
    save_rows(tmp_path)
    for world in (1, 3):
        for r in range(world):
            lo, hi = 6 * r // world, 6 * (r + 1) // world
            target = TensorSlice(torch.empty(10, hi - lo), (0, lo), (10, 6))
            with CheckpointManager([tmp_path], rank=r, world_size=world) as mgr:
                out = mgr.restore(into={"w": target})
            assert out["w"] is target and torch.equal(target.local, WHOLE[:, lo:hi])
            assert torch.equal(out["b"], torch.ones(3, dtype=torch.bfloat16)) and out["n"] == 7
    plain = torch.zeros(10, 6)
    with CheckpointManager([tmp_path]) as mgr:  # a plain tensor in into= receives the whole tensor
        assert mgr.restore(into={"w": plain})["w"] is plain and torch.equal(plain, WHOLE)


def test_targets_that_do_not_match_are_refused_naming_the_tensor(tmp_path):
    save_rows(tmp_path)
    with CheckpointManager([tmp_path]) as mgr:
        for into in ({"w": torch.zeros(10, 7)}, {"w": torch.zeros(10, 6, dtype=torch.float64)},
                     {"w": TensorSlice(torch.zeros(2, 6), (0, 0), (11, 6))}):
            with pytest.raises(ConfigError, match="'w'"):
                mgr.restore(into=into)


def test_overlapping_out_of_bounds_and_missing_chunks_name_the_tensor_and_file(tmp_path):
    save_rows(tmp_path)
    good = (tmp_path / "step_000000001" / "manifest.json").read_text()

    def chunk(doc, rank):
        return doc["ranks"][rank]["tensors"]["w"]["chunks"][0]

    edit_manifest(tmp_path, lambda d: chunk(d, 1).__setitem__("offsets", [4, 0]))  # rows 4..9 overlap rank 0's
    with CheckpointManager([tmp_path]) as mgr, pytest.raises(IntegrityError, match=r"'w' has overlapping chunks.*rank_0000"):
        mgr.restore(1)
    (tmp_path / "step_000000001" / "manifest.json").write_text(good)
    edit_manifest(tmp_path, lambda d: chunk(d, 1).__setitem__("offsets", [6, 0]))  # rows 6..10 of a 10-row tensor
    with pytest.raises(FormatError, match=r"tensor 'w' chunk 0.*exceed"):
        inspect(tmp_path, 1)
    (tmp_path / "step_000000001" / "manifest.json").write_text(good)
    edit_manifest(tmp_path, lambda d: d["ranks"][1]["tensors"].pop("w"))  # rank 1's rows are gone
    with CheckpointManager([tmp_path]) as mgr, pytest.raises(IntegrityError, match=r"'w'.*cover 30 of the 60.*rank_00000"):
        mgr.restore(1)
    (tmp_path / "step_000000001" / "manifest.json").write_text(good)
    edit_manifest(tmp_path, lambda d: d["ranks"][1]["tensors"]["w"].__setitem__("shape", [10, 7]))
    with pytest.raises(FormatError, match="global tensor 'w' is"):
        inspect(tmp_path, 1)


def test_plain_tensors_that_differ_between_ranks_are_not_resharded_silently(tmp_path):
    def one(r: int) -> None:
        with CheckpointManager([tmp_path], rank=r, world_size=2, run_id="own") as mgr:
            mgr.save(1, {"same": torch.ones(2), "rng": torch.full((2,), float(r))}).wait()
    ranks(2, one)
    with CheckpointManager([tmp_path], rank=2, world_size=3) as mgr:
        with pytest.raises(ConfigError, match="'rng' is rank-local"):
            mgr.restore()
        out = mgr.restore(per_rank="own")  # rank 2 takes saved rank 0's own values
        assert torch.equal(out["rng"], torch.zeros(2)) and torch.equal(out["same"], torch.ones(2))
    with CheckpointManager([tmp_path], rank=1, world_size=2) as mgr:  # the same world size: its own
        assert torch.equal(mgr.restore()["rng"], torch.ones(2))


class CountingStore(LocalStore):
    """A real LocalStore that counts the keys it reads."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[str] = []

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        self.reads.append(key)
        return super().read_into(key, offset, buf)


def test_records_by_reference_for_large_jobs(tmp_path):
    """Beyond inline_record_bytes, the manifest names each rank's record (size, xxh3) instead of inlining it."""
    def one(r: int) -> None:
        with CheckpointManager([tmp_path / "a"], rank=r, world_size=3, run_id="big", inline_record_bytes=0) as mgr:
            mgr.save(1, {"own": torch.full((4,), float(r)), "w": TensorSlice(WHOLE[:, 2 * r:2 * r + 2].clone(), (0, 2 * r), (10, 6))}).wait()
            mgr.save(2, {"own": torch.full((4,), float(r))}).wait()
    ranks(3, one)
    man = inspect(tmp_path / "a", 1)
    assert man.version == 2 and all(r.record is not None and not r.tensors for r in man.ranks)
    assert verify(tmp_path / "a", 1).ok and list_checkpoints(tmp_path / "a")[0].bytes == man.total_bytes > 0
    store = CountingStore(tmp_path / "a")

    def records_read() -> set[str]:
        return {k.rsplit("/", 1)[1].split(".")[0] for k in store.reads if k.endswith(".json") and "manifest" not in k}

    with CheckpointManager([store], rank=1, world_size=3) as mgr:
        out = mgr.restore(1, into={"w": TensorSlice(torch.empty(10, 2), (0, 2), (10, 6))})
        assert torch.equal(out["own"], torch.ones(4)) and torch.equal(out["w"].local, WHOLE[:, 2:4])
        assert records_read() == {"rank_00000", "rank_00001", "rank_00002"}  # where is each slice of w?
        store.reads.clear()
        assert torch.equal(mgr.restore(2)["own"], torch.ones(4))
        assert records_read() == {"rank_00001"}  # only a rank's own values: only its record
        assert {k.rsplit("/", 1)[1] for k in store.reads if k.endswith(".safetensors")} == {"rank_00001.safetensors"}
    # promotion copies the records; the copy verifies; a damaged record is named
    assert main(["ckpt", "promote", str(tmp_path / "a"), str(tmp_path / "b"), "--step", "1"]) == 0
    assert verify(tmp_path / "b", 1).ok
    record = next((tmp_path / "b" / "step_000000001").glob("rank_00002.*.json"))
    record.write_bytes(record.read_bytes().replace(b'"w"', b'"x"', 1))
    report = verify(tmp_path / "b", 1)
    assert not report.ok and report.problems[0].file.endswith(record.name)
    with CheckpointManager([tmp_path / "b", tmp_path / "a"], rank=2, world_size=3) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(mgr.restore(1)["w"], WHOLE)  # the damaged record is read from the other tier


def test_dcp_save_load_and_the_manager_read_each_other(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tierio.ckpt.dcp import TierioReader, TierioWriter

    warnings.simplefilter("ignore", UserWarning)  # DCP warns that it runs without a process group
    sd = {"model": {"w": WHOLE.clone(), "b": torch.ones(3, dtype=torch.bfloat16)},
          "optim": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}, "step": 5}
    with CheckpointManager([tmp_path / "a", tmp_path / "b"]) as mgr:
        dcp.save(sd, storage_writer=TierioWriter(mgr, step=10), no_dist=True)
        fut = dcp.async_save(sd, storage_writer=TierioWriter(mgr), checkpoint_id=20, no_dist=True)
        getattr(fut, "upload_completion", fut).result()
        mgr.wait()
        assert mgr.steps() == [10, 20]
    assert verify(tmp_path / "b", 20).ok and inspect(tmp_path / "b", 20).tree["step"] == 5
    target = {"model": {"w": torch.zeros(10, 6), "b": torch.zeros(3, dtype=torch.bfloat16)},
              "optim": {"param_groups": [{"lr": 0.0, "params": []}]}, "step": 0}
    dcp.load(target, storage_reader=TierioReader(tmp_path / "b"), no_dist=True)  # the latest: 20
    assert torch.equal(target["model"]["w"], WHOLE) and target["step"] == 5 and target["optim"] == sd["optim"]
    with CheckpointManager([tmp_path / "a"]) as mgr:
        assert torch.equal(mgr.restore(10)["model"]["w"], WHOLE)
    save_rows(tmp_path / "c")  # a manager checkpoint of 2 ranks, loaded by DCP on one process
    got = {"w": torch.zeros(10, 6), "n": 0}
    dcp.load(got, storage_reader=TierioReader(tmp_path / "c"), no_dist=True,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(got["w"], WHOLE) and got["n"] == 7
    with CheckpointManager([tmp_path / "d"]) as mgr:  # DCP reports the writer's ConfigError in its own exception
        with pytest.raises(BaseException, match="'x': cannot store object at '<root>' without pickle"):
            dcp.save({"x": object()}, storage_writer=TierioWriter(mgr, step=1), no_dist=True)
        assert mgr.steps() == []


def test_chunks_that_would_bounce_are_asked_for_ahead_and_restore_exactly(tmp_path, monkeypatch):
    """A resharding restore asks a local store to prefetch the chunks it copies anyway (their
    destinations are not 4 KiB-aligned with their file offsets), each at its exact byte range, and
    the bytes still come back exact."""
    save_rows(tmp_path)
    asked: list[tuple[str, list[tuple[int, int]]]] = []
    real = LocalStore.prefetch

    def spy(self, key, ranges):
        asked.append((key, [(r.start, r.end) for r in ranges]))
        return real(self, key, ranges)

    monkeypatch.setattr(LocalStore, "prefetch", spy)
    target = TensorSlice(torch.empty(10, 3), (0, 3), (10, 6))  # columns: every row chunk is staged
    with CheckpointManager([tmp_path], rank=1, world_size=2) as mgr:
        out = mgr.restore(into={"w": target})
    assert torch.equal(out["w"].local, WHOLE[:, 3:6])
    doc = json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())
    want = {}
    for entry in doc["ranks"]:
        ranges = sorted(tuple(c["range"]) for c in entry["tensors"]["w"]["chunks"] if c["range"][0] % 4096)
        if ranges:
            want[entry["file"]] = ranges
    got: dict[str, list[tuple[int, int]]] = {}
    for key, ranges in asked:
        got.setdefault(key.rsplit("/", 1)[1], []).extend(ranges)
    assert want and got == want


def test_read_ahead_asks_for_more_only_as_reads_finish():
    """A restore larger than memory must not ask for more than ``limit`` bytes ahead of its reads."""
    asked: list[list[ByteRange]] = []
    r = [ByteRange(0, 10), ByteRange(10, 20), ByteRange(20, 30)]
    ahead = reshard.ReadAhead(asked.append, r, limit=15)
    ahead.done(None)
    assert asked == [[r[0], r[1]]]  # 20 bytes out: over the limit, stop
    ahead.done(0)
    assert asked[-1] == [r[2]]
    ahead.done(10)
    ahead.done(20)
    assert len(asked) == 2
