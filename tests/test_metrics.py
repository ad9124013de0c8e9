"""tierio.metrics: the real endpoint scraped over loopback and parsed with prometheus_client's text
parser; regression alerts that log once and set a gauge; nothing exported unless asked."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from metrics_scrape import scrape  # noqa: E402

from tierio import events, metrics  # noqa: E402
from tierio.ckpt import CheckpointManager  # noqa: E402
from tierio.errors import ConfigError  # noqa: E402
from tierio.storage.cache import CacheOptions, FillPlan, NodeCache  # noqa: E402

UNIT = 1 << 16


def one(samples: dict, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


@pytest.fixture
def exporter():
    ex = metrics.serve(0)
    yield ex
    ex.close()


def _fill(size: int):
    return lambda: FillPlan(size, lambda target: target.write_bytes(b"x" * size), f"entry of {size} bytes")


def test_endpoint_exports_checkpoints_caches_weights_and_data_wait(tmp_path: Path, exporter) -> None:
    t0, t1 = tmp_path / "t0", tmp_path / "t1"
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 0}
    with CheckpointManager([str(t0), str(t1)]) as mgr:
        for step in (1, 2, 3):
            state["step"] = step
            mgr.save(step, state)
            mgr.wait()
        shard = t0 / "step_000000003" / "rank_00000.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF
        shard.write_bytes(bytes(raw))
        with pytest.warns(UserWarning, match="unusable"):
            mgr.restore(step=3)  # tier 0's copy is damaged: read from tier 1
    cache = NodeCache(tmp_path / "cache", CacheOptions(limit=2 * UNIT, name="shards"))
    for key in ("a", "a", "b", "c"):  # miss, hit, miss, miss that evicts "a"
        cache.get(key, "file", _fill(UNIT)).release()
    from safetensors.torch import save_file

    from tierio.weights import load

    save_file({"x": torch.ones(1024, 256)}, str(tmp_path / "m.safetensors"))
    load(str(tmp_path / "m.safetensors"))
    for _ in events.timed(iter(range(5)), loader="train"):
        pass

    s = scrape(exporter.port)
    u0, u1 = f"file://{t0}", f"file://{t1}"
    assert one(s, "tierio_checkpoint_save_blocking_seconds_count", tier=u0) == 3
    assert one(s, "tierio_checkpoint_persist_seconds_count", tier=u0) == 3
    assert one(s, "tierio_tier_written_bytes_total", tier=u0) > 3 * 16384
    assert one(s, "tierio_tier_written_bytes_total", tier=u1) == one(s, "tierio_tier_written_bytes_total", tier=u0)
    assert one(s, "tierio_tier_write_gb_per_second", tier=u1) > 0
    assert one(s, "tierio_checkpoint_promotion_lag_seconds_count", tier=u0) == 3
    assert one(s, "tierio_checkpoint_promotions_pending", tier=u0) == 0
    assert one(s, "tierio_checkpoint_restore_seconds_count", tier=u1) == 1  # the tier it came from
    assert one(s, "tierio_checkpoint_verify_failures_total", tier=u0) == 1
    assert 0 < one(s, "tierio_tier_free_bytes", tier=u0) <= one(s, "tierio_tier_size_bytes", tier=u0)
    assert one(s, "tierio_checkpoint_oldest_pending_promotion_seconds", tier=u0) == 0
    assert one(s, "tierio_cache_lookups_total", cache="shards", result="hit") == 1
    assert one(s, "tierio_cache_lookups_total", cache="shards", result="miss") == 3
    assert one(s, "tierio_cache_hit_ratio", cache="shards") == pytest.approx(0.25)
    assert one(s, "tierio_cache_evictions_total", cache="shards") == 1
    assert one(s, "tierio_cache_evicted_bytes_total", cache="shards") == UNIT
    assert one(s, "tierio_weights_load_bytes_total") == (tmp_path / "m.safetensors").stat().st_size  # header too
    assert one(s, "tierio_weights_load_gb_per_second") > 0
    assert one(s, "tierio_data_wait_seconds_count", loader="train") == 5
    assert one(s, "tierio_alerts_total", alert="checkpoint_persist_regression") == 0


def test_persist_regression_logs_once_and_sets_the_gauge(exporter, caplog) -> None:
    tier = "file:///regression-test"
    caplog.set_level(logging.INFO, logger="tierio.metrics")
    for i, seconds in enumerate([1.0, 1.1, 0.9, 1.0, 1.05]):
        events.emit(events.CheckpointPersisted(i, tier, 100, seconds, False))
    assert scrape(exporter.port).get("tierio_alert", {}) == {}
    events.emit(events.CheckpointPersisted(5, tier, 100, 2.5, False))  # 2.5x the median of 1.0
    events.emit(events.CheckpointPersisted(6, tier, 100, 3.0, False))  # still slow: no second warning
    s = scrape(exporter.port)
    assert one(s, "tierio_alert", alert="checkpoint_persist_regression", key=tier) == 1
    assert one(s, "tierio_alerts_total", alert="checkpoint_persist_regression") == 1
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "2.5x the median 1s" in warned[0].getMessage()
    assert (("checkpoint_persist_regression", tier) in exporter.alerts())
    events.emit(events.CheckpointPersisted(7, tier, 100, 1.0, False))
    assert one(scrape(exporter.port), "tierio_alert", alert="checkpoint_persist_regression", key=tier) == 0
    assert exporter.alerts() == {}


def test_data_wait_variance_alert_uses_the_doctor_threshold(exporter, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tierio.metrics")
    for i in range(200):  # steady waits: P99/mean ~1
        events.emit(events.DataWait("steady", 0.004 + (i % 3) * 0.0001))
    for i in range(200):  # an OST hotspot every 25 batches
        events.emit(events.DataWait("bursty", 0.25 if i % 25 == 7 else 0.003))
    s = scrape(exporter.port)
    assert one(s, "tierio_data_wait_p99_over_mean", loader="steady") < 1.5
    assert one(s, "tierio_data_wait_p99_over_mean", loader="bursty") > 3
    assert one(s, "tierio_data_wait_p99_seconds", loader="bursty") == pytest.approx(0.25)
    assert one(s, "tierio_alert", alert="data_wait_variance", key="bursty") == 1
    assert ("data_wait_variance", "steady") not in exporter.alerts()
    assert [r.getMessage() for r in caplog.records if "bursty" in r.getMessage()][0].count("alert above 3x") == 1
    assert len([r for r in caplog.records if "bursty" in r.getMessage()]) == 1


def test_sub_millisecond_waits_never_alert(exporter) -> None:
    for i in range(300):
        events.emit(events.DataWait("fast", 0.0009 if i % 50 == 0 else 0.00001))
    assert one(scrape(exporter.port), "tierio_data_wait_p99_over_mean", loader="fast") > 3
    assert exporter.alerts() == {}


def test_register_into_the_applications_registry(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    ex = metrics.register(registry, alerts=metrics.AlertOptions(persist_factor=1.5))
    try:
        with pytest.raises(ConfigError, match="already has them"):
            metrics.register(registry)
        events.emit(events.CacheLookup("weights", True))
        assert registry.get_sample_value("tierio_cache_lookups_total", {"cache": "weights", "result": "hit"}) == 1
    finally:
        ex.close()
    assert registry.get_sample_value("tierio_cache_lookups_total", {"cache": "weights", "result": "hit"}) is None
    metrics.register(registry).close()  # closed: the names are free again


def test_nothing_is_observed_unless_asked_and_a_failing_observer_fails_nothing(tmp_path: Path, caplog) -> None:
    before = events._observers
    import tierio.metrics  # noqa: F401 - importing exports nothing

    assert events._observers == before
    calls = []

    def broken(ev):
        calls.append(ev)
        raise RuntimeError("observer bug")

    caplog.set_level(logging.WARNING, logger="tierio.events")
    with events.subscribe(broken):
        with CheckpointManager([str(tmp_path / "t0")]) as mgr:
            mgr.save(1, {"w": torch.zeros(16)}).wait()
            mgr.save(2, {"w": torch.ones(16)}).wait()
            assert mgr.restore()["w"].sum() == 16
    assert len(calls) >= 6
    assert len([r for r in caplog.records if "observer bug" in r.getMessage()]) == 1
    assert events._observers == before


def test_alert_options_and_port_in_use_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="above 1"):
        metrics.AlertOptions(persist_factor=1.0)
    with pytest.raises(ConfigError, match="cannot exceed"):
        metrics.AlertOptions(wait_min_batches=10, wait_window=5)
    with metrics.serve(0) as first:
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{first.port}"):
            metrics.serve(first.port)


def test_events_from_many_threads_are_all_counted(exporter) -> None:
    def work() -> None:
        for _ in range(500):
            events.emit(events.CacheLookup("weights", True))
            events.emit(events.CacheLookup("weights", False))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = scrape(exporter.port)
    assert one(s, "tierio_cache_lookups_total", cache="weights", result="hit") == 2000
    assert one(s, "tierio_cache_hit_ratio", cache="weights") == pytest.approx(0.5)
    time.sleep(0)  # nothing pending: emits are synchronous


def test_the_documented_alert_rules_use_exported_metrics(exporter, tmp_path: Path) -> None:
    """docs/diagnose.md's rule file parses, and every tierio_* series it queries is one the endpoint exports."""
    import re

    yaml = pytest.importorskip("yaml")
    doc = (Path(__file__).parents[1] / "docs" / "diagnose.md").read_text()
    block = re.search(r"```yaml\n(groups:.*?)```", doc, re.S)
    assert block is not None
    rules = yaml.safe_load(block.group(1))["groups"][0]["rules"]
    assert len(rules) >= 6 and all({"alert", "expr", "annotations"} <= set(r) for r in rules)
    tier = f"file://{tmp_path}"
    events.emit(events.CheckpointStaged(1, tier, 1, 0.1, 0.0))
    events.emit(events.CheckpointPersisted(1, tier, 1, 1.0, True))  # the pending promotion appears
    for kind in (events.CacheLookup("shards", True), events.CacheEviction("shards", 1), events.DataWait("train", 0.1)):
        events.emit(kind)
    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as r:
        families = {f.name for f in text_string_to_metric_families(r.read().decode())}
    exported = set(scrape(exporter.port)) | families  # a family without samples yet (tierio_alert) counts
    for rule in rules:
        for name in re.findall(r"\btierio_[a-z0-9_]+", rule["expr"]):
            family = re.sub(r"_(total|bucket|count|sum)$", "", name)
            assert name in exported or family in families, (rule["alert"], name)


def test_stateful_loader_and_shard_cache_report_in_process(tmp_path: Path, exporter) -> None:
    import numpy as np

    from tierio.data.loader import StatefulLoader
    from tierio.data.shards import ShardWriter
    from tierio.data.streaming import StreamingDataset

    url = f"file://{tmp_path / 'remote'}"
    with ShardWriter(url, ["x"], shard_bytes=256) as w:
        for i in range(96):
            w.write({"x": np.array([i], np.int64)})
    loader = StatefulLoader(StreamingDataset(url, tmp_path / "cache", "4MiB", seed=1, batch_size=8), 8, num_workers=0)
    batches = sum(1 for _ in loader)
    s = scrape(exporter.port)
    assert one(s, "tierio_data_wait_seconds_count", loader="StatefulLoader") == batches == 12
    misses = one(s, "tierio_cache_lookups_total", cache="shards", result="miss")
    assert misses == len(w.manifest.shards) > 1  # every shard fetched once into the cache


def test_kv_cache_gets_report_blocks_served_per_tier(tmp_path: Path, exporter) -> None:
    from kv_helpers import cache, put_chain, read_back, tokens
    from tierio.kv import KVTier as Tier

    with cache(tmp_path, dram_blocks=16, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(6))
        put_chain(c, keys)
        c.flush()
        c.evict(keys[4:], Tier.DRAM)
        assert read_back(c, keys)[1] == [Tier.DRAM] * 4 + [Tier.NVME] * 2
        assert read_back(c, c.hash_blocks(tokens(2, seed=5)))[0] == 0  # never stored: 2 misses
    s = scrape(exporter.port)
    assert one(s, "tierio_kv_blocks_served_total", tier="dram") == 4
    assert one(s, "tierio_kv_blocks_served_total", tier="nvme") == 2
    assert one(s, "tierio_kv_blocks_served_total", tier="shared") == 0
    assert one(s, "tierio_kv_blocks_missed_total") == 2
    assert one(s, "tierio_kv_hit_ratio", tier="dram") == pytest.approx(4 / 8)
    assert one(s, "tierio_kv_hit_ratio", tier="nvme") == pytest.approx(2 / 8)


def test_kv_blocks_served_by_the_device_tier_are_counted_as_device(tmp_path: Path, exporter) -> None:
    from kv_helpers import LAYOUT, cache, put_chain, read_back, tokens
    from tierio.kv import KVTier as Tier

    with cache(tmp_path, dram_blocks=16, device_bytes=8 * LAYOUT.block_bytes, device="cpu") as c:  # a CPU tensor stands in for HBM
        keys = c.hash_blocks(tokens(3))
        put_chain(c, keys)
        assert read_back(c, keys)[1] == [Tier.DEVICE] * 3
    s = scrape(exporter.port)
    assert one(s, "tierio_kv_blocks_served_total", tier="device") == 3
    assert one(s, "tierio_kv_blocks_served_total", tier="dram") == 0
    assert one(s, "tierio_kv_hit_ratio", tier="device") == pytest.approx(1.0)
