"""GPUDirect Storage readiness, the counterpart of `gdscheck -p`: the NVIDIA driver, the nvidia-fs
module, the cuFile settings that matter, whether kvikio would run in compatibility mode, and which of
the diagnosed filesystems GDS can serve. Recorded as plain values; judged by ``rule_gds``."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tierio.diag.rules import OK, WARN, Finding, skipped
from tierio.errors import FormatError
from tierio.io.untrusted import loads

CUFILE_ENV = "CUFILE_ENV_PATH_JSON"
# The cuFile settings that change what a read does (cufile.json, "properties" unless dotted).
CUFILE_KEYS = ("allow_compat_mode", "max_direct_io_size_kb", "max_device_cache_size_kb", "use_poll_mode",
               "rdma_dev_addr_list", "fs.lustre.rdma_dev_addr_list", "use_pci_p2pdma")
# Filesystems cuFile does DMA for (local ones in ordered/default mode); NFS only over RDMA.
GDS_FILESYSTEMS = {"ext4", "xfs", "lustre", "gpfs", "wekafs", "beegfs"}


@dataclass
class GdsFacts:
    driver: bool = False                    # /proc/driver/nvidia exists
    gpus: int = 0
    nvidia_fs: str | None = None            # the module's version ("loaded" when it has none), None: not loaded
    cufile_path: str | None = None
    cufile: dict[str, Any] = field(default_factory=dict)
    cufile_reason: str = ""
    kvikio: str | None = None               # "gds", "compat", or None: kvikio or CUDA absent

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _strip_comments(text: str) -> str:
    """cufile.json carries // comments; drop them (outside strings) so it parses as JSON."""
    return re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*', lambda m: m.group(1) or "", text)


def cufile_settings(text: str, where: str) -> dict[str, Any]:
    """The settings of ``CUFILE_KEYS`` found in a cufile.json text."""
    doc = loads(_strip_comments(text), where, limit=1 << 20)
    if not isinstance(doc, dict):
        raise FormatError(f"{where} is not a cuFile configuration (not a JSON object)")
    props = doc.get("properties") if isinstance(doc.get("properties"), dict) else {}
    out = {}
    for key in CUFILE_KEYS:
        node: Any = props if "." not in key else doc
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[key] = node
    return out


def _kvikio_mode() -> str | None:
    from tierio.io.gds import compat_mode

    mode = compat_mode()
    return None if mode is None else ("compat" if mode else "gds")


def record_gds(root: str = "/") -> GdsFacts:
    """What this node (or a tree recorded from one, at ``root``) says about GDS; never raises."""
    facts = GdsFacts(driver=os.path.isdir(os.path.join(root, "proc/driver/nvidia")))
    try:
        facts.gpus = len(os.listdir(os.path.join(root, "proc/driver/nvidia/gpus")))
    except OSError:
        facts.gpus = 0
    module = os.path.join(root, "sys/module/nvidia_fs")
    if os.path.isdir(module):
        try:
            with open(os.path.join(module, "version"), encoding="ascii") as f:
                facts.nvidia_fs = f.read().strip() or "loaded"
        except OSError:
            facts.nvidia_fs = "loaded"
    path = os.environ.get(CUFILE_ENV) if root == "/" else None
    path = path or os.path.join(root, "etc/cufile.json")
    try:
        with open(path, encoding="utf-8") as f:
            facts.cufile, facts.cufile_path = cufile_settings(f.read(), path), path
    except OSError:
        facts.cufile_reason = f"no cuFile configuration at {path}"
    except FormatError as exc:
        facts.cufile_reason = str(exc)
    if root == "/" and facts.driver:
        facts.kvikio = _kvikio_mode()
    return facts


def gds_filesystem(fs_type: str | None, options: str | None) -> bool:
    fs = (fs_type or "").lower()
    return fs in GDS_FILESYSTEMS or (fs.startswith("nfs") and "proto=rdma" in (options or ""))


def rule_gds(facts: GdsFacts, paths: list[tuple[str, str | None, str | None]] = ()) -> Finding:
    """No NVIDIA driver → skipped, one line. nvidia-fs not loaded, or kvikio in compatibility mode → warn
    (reads go through a host bounce buffer). ``paths``: (path, fs type, mount options) to say which GDS serves."""
    check, target = "GPUDirect Storage", "node"
    if not facts.driver:
        return skipped(check, target, "no NVIDIA driver on this node: GDS not applicable, reads use the host path")
    served = [p for p, fs, opts in paths if gds_filesystem(fs, opts)]
    not_served = [f"{p} ({fs})" for p, fs, opts in paths if not gds_filesystem(fs, opts)]
    data = {**facts.to_dict(), "gds_paths": served, "posix_paths": not_served}
    where = f"; POSIX fallback for {', '.join(not_served)}" if not_served else ""
    settings = ", ".join(f"{k}={v}" for k, v in facts.cufile.items()) or facts.cufile_reason or "defaults"
    if facts.nvidia_fs is None:
        return Finding(check, target, WARN, f"{facts.gpus} GPU(s), nvidia-fs not loaded: cuFile runs in "
                       f"compatibility mode, every read through a host bounce buffer{where}",
                       "Install the nvidia-gds package and load the module (modprobe nvidia-fs); confirm with "
                       "gdscheck -p", data)
    if facts.kvikio == "compat":
        return Finding(check, target, WARN, f"nvidia-fs {facts.nvidia_fs} loaded but kvikio runs in "
                       f"compatibility mode (cuFile: {settings}){where}",
                       "Unset KVIKIO_COMPAT_MODE and set \"allow_compat_mode\": false in cufile.json so the "
                       "reason cuFile refuses DMA is reported; then gdscheck -p", data)
    return Finding(check, target, OK, f"nvidia-fs {facts.nvidia_fs}, kvikio {facts.kvikio or 'not installed'}, "
                   f"cuFile: {settings}{where}", data=data)
