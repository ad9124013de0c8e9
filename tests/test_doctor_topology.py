"""PCIe/NUMA placement of GPUs, NVMe drives and NICs, read from recorded sysfs trees laid out as real
directories with symlinks; carried through --save/--replay; and nothing to judge on a node without GPUs."""

from __future__ import annotations

import json
from pathlib import Path

from sysfs_tree import build_sysfs
from tierio.diag.doctor import PathFacts, Recorded, diagnose
from tierio.diag.rules import OK, SKIPPED, WARN
from tierio.diag.topology import record_topology, rule_topology, topology_to_dicts

SYSFS = Path(__file__).parent / "data" / "doctor" / "sysfs"


def node(tmp_path: Path, name: str):
    root = tmp_path / name
    if not root.exists():
        build_sysfs(SYSFS / f"{name}.txt", root)
    return record_topology(str(root))


def test_sysfs_paths_and_numa_nodes(tmp_path):
    devs = {d.name: d for d in node(tmp_path, "dual_socket_split")}
    assert set(devs) == {"0000:03:00.0", "0000:83:00.0", "nvme0n1", "nvme1n1", "ib0", "ib1"}   # lo has no device
    assert devs["nvme0n1"].chain == ["0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"]
    assert devs["0000:83:00.0"].kind == "gpu" and devs["0000:83:00.0"].numa == 1
    assert devs["nvme0n1"].shared_switch(devs["0000:03:00.0"]) == "0000:01:00.0"
    assert devs["nvme1n1"].shared_switch(devs["0000:03:00.0"]) is None


def test_gpu_whose_drive_is_across_the_socket(tmp_path):
    f = {x.target: x for x in rule_topology(node(tmp_path, "dual_socket_split"))}
    near = f["GPU 0000:03:00.0"]
    assert near.verdict == OK and "nvme0n1 and GPU 0000:03:00.0 share switch 0000:01:00.0" in near.detail
    far = f["GPU 0000:83:00.0"]
    assert far.verdict == WARN and "are on NUMA nodes 0 and 1" in far.detail and "up to 40% less GDS" in far.detail
    assert "ib1 and GPU 0000:83:00.0 share switch 0000:81:00.0" in far.detail
    assert "numactl --cpunodebind=1 --membind=1" in far.fix
    # the doctor's paths narrow the drives judged: data only on nvme1n1 puts GPU 0 across its root complex
    only1 = {x.target: x for x in rule_topology(node(tmp_path, "dual_socket_split"), {"nvme1n1"})}
    assert only1["GPU 0000:03:00.0"].verdict == WARN and "share no PCIe switch" in only1["GPU 0000:03:00.0"].detail


def test_each_gpu_with_its_own_drive_and_nic(tmp_path):
    assert {x.verdict for x in rule_topology(node(tmp_path, "dual_socket_paired"))} == {OK}


def test_topology_is_replayed_and_absent_gpus_are_one_line(tmp_path):
    rec = Recorded(paths=[PathFacts("/mnt/nvme", device="nvme1n1")],
                   topology=topology_to_dicts(node(tmp_path, "dual_socket_split")))
    again = Recorded.from_dict(json.loads(json.dumps(rec.to_dict())))
    topo = [x for x in diagnose(again) if x.check == "PCIe/NUMA topology"]
    assert [x.verdict for x in topo] == [WARN, WARN]                       # both GPUs judged against nvme1n1
    here = rule_topology(record_topology())                               # this machine: no GPU
    assert len(here) == 1 and here[0].verdict == SKIPPED and "no GPU" in here[0].detail
