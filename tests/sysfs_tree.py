"""Lay out a recorded sysfs listing (tests/data/doctor/sysfs/*.txt) as a real directory tree with
relative symlinks, the shape /sys has, so the topology reader runs on it unchanged."""

from __future__ import annotations

import os
from pathlib import Path


def _link(root: Path, at: str, target: str) -> None:
    link = root / at
    link.parent.mkdir(parents=True, exist_ok=True)
    dest = root / "devices" / target
    dest.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(dest, link.parent))


def build_sysfs(listing: Path, root: Path) -> Path:
    for line in listing.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        kind, *rest = words
        if kind == "dev":
            path, attrs = rest[0], dict(w.split("=", 1) for w in rest[1:])
            d = root / "devices" / path
            d.mkdir(parents=True, exist_ok=True)
            for key, name in (("numa", "numa_node"), ("vendor", "vendor"), ("class", "class")):
                if key in attrs:
                    (d / name).write_text(attrs[key] + "\n")
            _link(root, f"bus/pci/devices/{path.rsplit('/', 1)[-1]}", path)
        elif kind == "block":
            _link(root, f"block/{rest[0]}/device", rest[1])
        elif kind == "net":
            (root / "class" / "net" / rest[0]).mkdir(parents=True, exist_ok=True)  # lo: no device link
            if len(rest) > 1:
                _link(root, f"class/net/{rest[0]}/device", rest[1])
    return root
