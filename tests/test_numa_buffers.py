"""Staging buffers placed on a NUMA node: allocated and first-touched from that node's CPUs, the
thread's affinity restored after, and the placement reported in the checkpoint manager's stats()."""

from __future__ import annotations

import os

import torch

from tierio.ckpt import CheckpointManager
from tierio.io.buffers import BufferPool, HostBuffer, address_of
from tierio.io.numa import node_cpus, parse_cpulist, placement


def _nodes_of(buf: HostBuffer) -> set[str]:
    """The N<node>= entries /proc/self/numa_maps gives the mapping that holds ``buf``."""
    start = f"{address_of(buf.array):x}"
    with open("/proc/self/numa_maps") as f:
        line = next((ln for ln in f if ln.startswith(start + " ")), "")
    return {w.split("=")[0] for w in line.split() if w.startswith("N") and "=" in w}


def test_cpulists_and_nodes_that_cannot_be_used(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    node = tmp_path / "devices" / "system" / "node" / "node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("100000-100003\n")                      # CPUs this process may not use
    assert node_cpus(1, str(tmp_path)) == {100000, 100001, 100002, 100003}
    far = placement(1, str(tmp_path))
    assert far.node is None and "no CPU this process may run on" in far.reason
    assert placement(None).reason == "not requested"
    assert placement("auto").node is None or torch.cuda.is_available()   # no GPU here: nothing to follow


def test_buffers_first_touched_on_node_0_and_affinity_restored():
    before = os.sched_getaffinity(0)
    where = placement(0)
    assert where.node == 0, where.reason                                  # every Linux machine has node 0
    pool = BufferPool(budget_bytes=None, pin=False, numa_node=0)
    buf = pool.acquire(8 << 20)
    assert buf.numa_node == 0 and os.sched_getaffinity(0) == before
    if os.path.exists("/proc/self/numa_maps"):
        assert _nodes_of(buf) == {"N0"}


def test_checkpoint_staging_reports_its_numa_node(tmp_path):
    with CheckpointManager([tmp_path / "t0"], numa_node=0) as mgr:
        mgr.save(1, {"w": torch.ones(1024)}).wait()
        assert mgr.stats()["staging_numa"] == {"requested": 0, "node": 0, "reason": ""}
    with CheckpointManager([tmp_path / "t1"]) as mgr:
        assert mgr.stats()["staging_numa"]["node"] is None


def test_weight_staging_ring_on_a_numa_node(tmp_path):
    from safetensors.torch import save_file

    from tierio.io.buffers import shared_pool
    from tierio.weights import load_into

    w = torch.arange(1 << 16, dtype=torch.float32)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    target = {"w": torch.zeros_like(w)}
    res = load_into(target, tmp_path / "model.safetensors", numa_node=0)
    assert torch.equal(target["w"], w)
    assert res.stats.extra["staging_numa"] == {"requested": 0, "node": 0, "reason": ""}
    ring = shared_pool("weights-staging", 0, numa_node=0)                 # the ring that load used
    assert ring.numa_node == 0 and ring.allocations >= 1
    plain = load_into({"w": torch.zeros_like(w)}, tmp_path / "model.safetensors")
    assert "staging_numa" not in plain.stats.extra
