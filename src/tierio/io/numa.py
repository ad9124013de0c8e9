"""Placing host buffers on a NUMA node: allocate and first-touch them from that node's CPUs.

Linux places an anonymous page on the node of the CPU that first touches it. Running the
allocation and the pre-fault with the thread's affinity narrowed to one node's CPUs
(``os.sched_setaffinity`` on the calling thread), then restoring it, puts a staging buffer beside
the GPU or drive it feeds, without libnuma. On a two-socket node a buffer on the far socket makes
every byte cross the inter-socket link twice (into the buffer, out to the device).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tierio.stats import Stats

SYSFS = "/sys"


def parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` → {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus(node: int, sysfs: str = SYSFS) -> set[int]:
    """The CPUs of NUMA node ``node`` (empty when the node does not exist here)."""
    try:
        with open(f"{sysfs}/devices/system/node/node{node}/cpulist", encoding="ascii") as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return set()


def pci_numa_node(address: str, sysfs: str = SYSFS) -> int | None:
    """The NUMA node sysfs gives a PCI device such as ``0000:17:00.0`` (None: unknown or one node)."""
    try:
        with open(f"{sysfs}/bus/pci/devices/{address}/numa_node", encoding="ascii") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_numa_node() -> int | None:
    """The NUMA node of the current CUDA device (None without CUDA or when sysfs does not say)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return pci_numa_node(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    except Exception:  # an old torch without the PCI fields, or a CUDA runtime problem: no placement
        return None


@dataclass
class NumaPlacement(Stats):
    """Where a pool's buffers were placed: ``node`` when bound, else None and ``reason``."""

    requested: int | str | None = None
    node: int | None = None
    reason: str = ""


def placement(requested: int | str | None, sysfs: str = SYSFS) -> NumaPlacement:
    """Resolve ``requested`` (a node, ``"auto"`` for the current GPU's node, None) to a node bindable here."""
    if requested is None:
        return NumaPlacement(None, None, "not requested")
    node = gpu_numa_node() if requested == "auto" else int(requested)
    if node is None:
        return NumaPlacement(requested, None, "no GPU with a known NUMA node")
    cpus = node_cpus(node, sysfs) & os.sched_getaffinity(0)
    if not cpus:
        return NumaPlacement(requested, None, f"NUMA node {node} has no CPU this process may run on")
    return NumaPlacement(requested, node)


@contextmanager
def first_touch_on(node: int | None, sysfs: str = SYSFS) -> Iterator[None]:
    """Run the body with this thread on ``node``'s CPUs (nothing changes for None), then restore."""
    if node is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, node_cpus(node, sysfs) & before or before)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
