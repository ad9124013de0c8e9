"""Where the GPUs, the NVMe drives and the NICs sit: their PCIe path and NUMA node, read from sysfs.

GPUDirect Storage moves bytes between a drive (or a NIC) and a GPU by peer-to-peer DMA. When the two
share a PCIe switch the bytes never reach the CPU; across sockets they cross the inter-socket link
(UPI/QPI), which costs up to 40% of GDS bandwidth. Recorded as plain records, so a node's topology
can be saved and judged elsewhere like every other doctor observation.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tierio.diag.rules import OK, WARN, Finding, skipped

GDS_CROSS_COST = 0.40     # GDS bandwidth lost, at most, when the path leaves the switch or the socket
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_GPU_VENDORS = {"0x10de", "0x1002"}     # NVIDIA, AMD
_GPU_CLASSES = ("0x0300", "0x0302", "0x0380")


@dataclass
class PciDevice:
    """One endpoint: ``chain`` is its PCIe path from the root port down (addresses such as 0000:17:00.0)."""

    kind: str                 # "gpu", "nvme" or "nic"
    name: str                 # nvme0n1, ib0, or the GPU's PCI address
    chain: list[str] = field(default_factory=list)
    numa: int | None = None

    def shared_switch(self, other: PciDevice) -> str | None:
        """The upstream port of a switch both sit under (a common path longer than the root port), if any."""
        common = 0
        for a, b in zip(self.chain[:-1], other.chain[:-1]):
            if a != b:
                break
            common += 1
        return self.chain[common - 1] if common >= 2 else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _endpoint(real: str) -> tuple[list[str], str | None]:
    """The PCIe chain in a resolved sysfs path and the directory of its last (endpoint) address."""
    parts = real.split("/")
    idx = [i for i, p in enumerate(parts) if _BDF.match(p)]
    if not idx:
        return [], None
    return [parts[i] for i in idx], "/".join(parts[: idx[-1] + 1])


def _device(kind: str, name: str, link: str) -> PciDevice | None:
    if not os.path.exists(link):
        return None
    chain, directory = _endpoint(os.path.realpath(link))
    if not chain or directory is None:
        return None   # virtual, or over a fabric (NVMe-oF): no PCIe path on this node
    numa = _read(os.path.join(directory, "numa_node"))
    node = int(numa) if numa and numa.lstrip("-").isdigit() and int(numa) >= 0 else None
    return PciDevice(kind, name, chain, node)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def record_topology(sysfs: str = "/sys") -> list[PciDevice]:
    """GPUs (by PCI vendor and class), NVMe block devices and NICs with a PCIe path, from ``sysfs``."""
    out: list[PciDevice] = []
    pci = os.path.join(sysfs, "bus", "pci", "devices")
    for addr in _listdir(pci):
        d = os.path.join(pci, addr)
        if _read(os.path.join(d, "vendor")) in _GPU_VENDORS and (_read(os.path.join(d, "class")) or "").startswith(
                _GPU_CLASSES):
            out.append(_device("gpu", addr, d))
    for name in _listdir(os.path.join(sysfs, "block")):
        if name.startswith("nvme"):
            out.append(_device("nvme", name, os.path.join(sysfs, "block", name, "device")))
    for name in _listdir(os.path.join(sysfs, "class", "net")):
        out.append(_device("nic", name, os.path.join(sysfs, "class", "net", name, "device")))
    return [d for d in out if d is not None]


def topology_to_dicts(devices: list[PciDevice]) -> list[dict[str, Any]]:
    return [asdict(d) for d in devices]


def topology_from_dicts(rows: list[dict[str, Any]]) -> list[PciDevice]:
    return [PciDevice(str(r["kind"]), str(r["name"]), [str(c) for c in r.get("chain", [])], r.get("numa"))
            for r in rows]


def _nearest(gpu: PciDevice, others: list[PciDevice]) -> tuple[PciDevice, str | None] | None:
    """The device closest to ``gpu``: one under the same switch first, then one on its NUMA node."""
    if not others:
        return None
    ranked = sorted(others, key=lambda o: (gpu.shared_switch(o) is None, o.numa != gpu.numa, o.name))
    return ranked[0], gpu.shared_switch(ranked[0])


def _placement(gpu: PciDevice, dev: PciDevice, switch: str | None) -> tuple[bool, str]:
    if switch:
        return True, f"{dev.name} and GPU {gpu.name} share switch {switch}"
    if gpu.numa is not None and dev.numa is not None and gpu.numa != dev.numa:
        return False, f"{dev.name} and GPU {gpu.name} are on NUMA nodes {dev.numa} and {gpu.numa}"
    return False, f"{dev.name} and GPU {gpu.name} share no PCIe switch (NUMA {_node(gpu.numa)})"


def _node(n: int | None) -> str:
    return "unknown" if n is None else str(n)


def rule_topology(devices: list[PciDevice], storage: set[str] | None = None, reason: str = "") -> list[Finding]:
    """Per GPU: the nearest NVMe (of ``storage`` when given) and NIC. Under one switch → ok;
    otherwise warn with the cost (up to −40% GDS bandwidth) and the fix."""
    check = "PCIe/NUMA topology"
    gpus = [d for d in devices if d.kind == "gpu"]
    if not gpus:
        return [skipped(check, "GPUs", reason or "no GPU in sysfs on this node: GPUDirect placement not judged")]
    nvme = [d for d in devices if d.kind == "nvme" and (not storage or d.name in storage)] or \
        [d for d in devices if d.kind == "nvme"]
    nics = [d for d in devices if d.kind == "nic"]
    out = []
    for gpu in gpus:
        seen, bad = [], []
        for near in (_nearest(gpu, nvme), _nearest(gpu, nics)):
            if near is None:
                continue
            good, text = _placement(gpu, *near)
            seen.append(text)
            if not good:
                bad.append(near[0])
        data = {"gpu": gpu.name, "numa": gpu.numa, "far": [d.name for d in bad]}
        target = f"GPU {gpu.name}"
        if not seen:
            out.append(skipped(check, target, "no NVMe drive or NIC with a PCIe path on this node"))
        elif bad:
            out.append(Finding(check, target, WARN, "; ".join(seen) + f": GPUDirect transfers cross the root complex"
                               f" or the socket link, up to {GDS_CROSS_COST:.0%} less GDS bandwidth",
                               f"Use the drive/NIC under the GPU's switch for its data; run the rank on NUMA node "
                               f"{_node(gpu.numa)} (numactl --cpunodebind={_node(gpu.numa)} "
                               f"--membind={_node(gpu.numa)}) so its host buffers are local", data))
        else:
            out.append(Finding(check, target, OK, "; ".join(seen), data=data))
    return out
