"""Promotion to a real S3 server (SeaweedFS), including the server dying during promotion."""

from __future__ import annotations

import shutil
import warnings

import torch

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
