"""Promotion to a real S3 server (SeaweedFS), including the server dying during promotion and
connections dropped during a restore."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from faulty_endpoints import Fault, FaultyProxy, ranged_get, via

from tierio.ckpt import CheckpointManager, list_checkpoints, verify
from tierio.format.shard import manifest_key, shard_key
from tierio.storage import open_store


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3 << 20, generator=g), "step": step}  # 12 MiB: a multipart upload


def test_promote_to_s3_and_restore_from_it(tmp_path, s3_url):
    with CheckpointManager([tmp_path / "nvme", s3_url]) as mgr:
        mgr.save(1, state_for(1)).wait()
        assert verify(s3_url, 1).ok
    shutil.rmtree(tmp_path / "nvme")  # the node's disk is gone
    with CheckpointManager([tmp_path / "nvme", s3_url]) as mgr:
        out = mgr.restore()
        assert torch.equal(out["w"], state_for(1)["w"])


def test_s3_outage_during_promotion_keeps_local_copy_and_retries(tmp_path, s3_url, seaweed):
    local = tmp_path / "nvme"
    s3 = open_store(s3_url)
    with CheckpointManager([local, s3_url]) as mgr:
        mgr.save(1, state_for(1)).wait()
        seaweed.stop()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                h = mgr.save(2, state_for(2))
                h.persisted.result(timeout=120)
                assert h.promoted.exception(timeout=120) is not None
            assert any("promotion of step 2 failed" in str(w.message) for w in caught)
            assert mgr.stats()["pending_promotions"] == [2]
            assert [c.step for c in list_checkpoints(local)] == [1, 2]  # the local copy stays
            assert torch.equal(mgr.restore(2)["w"], state_for(2)["w"])
        finally:
            seaweed.start()
        assert not s3.exists(manifest_key(2))  # never a manifest without its shards
        mgr.promote()  # the retry
        assert mgr.stats()["pending_promotions"] == []
        assert s3.exists(shard_key(2, 0)) and [c.step for c in list_checkpoints(s3_url)] == [1, 2]
        report = mgr.verify(2)
        assert report.ok and len(report.good_tiers) == 2


@pytest.mark.timeout(300)
def test_restore_from_s3_survives_dropped_connections(tmp_path, s3_url, seaweed):
    """Connections cut mid-download are retried, not reported as a corrupt checkpoint."""
    with CheckpointManager([tmp_path / "nvme", s3_url]) as mgr:
        mgr.save(1, state_for(1)).wait()
    shutil.rmtree(tmp_path / "nvme")

    def cut_three_shard_reads(line: str) -> Fault | None:  # small header reads pass whole; large ones are cut
        big_read = ranged_get(line) and ".safetensors" in line and len(proxy.cuts) < 3
        return Fault(cut_after=200_000) if big_read else None

    proxy = FaultyProxy(seaweed.endpoint, cut_three_shard_reads)
    try:
        with CheckpointManager([tmp_path / "nvme", via(proxy.endpoint, s3_url)]) as mgr:
            out = mgr.restore()
        assert torch.equal(out["w"], state_for(1)["w"]) and len(proxy.cuts) >= 3  # more when cut in parallel
    finally:
        proxy.close()
