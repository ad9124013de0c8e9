"""Doctor rules: pure functions from recorded facts to one verdict and one concrete fix.

A rule never touches the machine. `tierio.diag.doctor` records the facts (or a test hands in
captured ones) and each rule judges them. Verdicts: ``ok``, ``warn`` (costs time, fix soon),
``alert`` (costs a lot of GPU time or will fail a job), ``skipped`` (could not be judged here, and
why).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tierio.diag.parse import DeviceLoad, StripeLayout
from tierio.plan.quantities import fmt_bytes, fmt_rate, fmt_seconds

OK, WARN, ALERT, SKIPPED = "ok", "warn", "alert", "skipped"
VERDICTS = (OK, WARN, ALERT, SKIPPED)

# Thresholds, named so docs and tests refer to the same numbers.
FULL_ALERT = 0.80             # used fraction of a filesystem
UTIL_ALERT = 80.0             # %util of a device
AWAIT_WARN_MS = {"nvme": 1.0, "other": 20.0}
QD_RATIO_WARN = 2.0           # QD32 / QD1 read bandwidth
READ_AHEAD_MIN_KB = 128
SMALL_FILE_BYTES = 1_000_000
SMALL_SHARE = 0.5
SMALL_WARN_COUNT, SMALL_ALERT_COUNT = 1_000, 10_000
LARGE_FILE_BYTES = 1 << 30
WAIT_P99_MEAN = 3.0
STEP_P99_P50 = 3.0
WAIT_SHARE_WARN = 0.03        # data wait as a share of step time
CKPT_STALL_ALERT = 0.01       # checkpoint stall as a share of step time
MIN_STEPS = 10


@dataclass
class Finding:
    """One check's result: the verdict, what was seen, and the one thing to do about it."""

    check: str
    target: str
    verdict: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def skipped(check: str, target: str, reason: str) -> Finding:
    return Finding(check, target, SKIPPED, reason)


# ---- filesystem -------------------------------------------------------------------------------

_NETWORK_NFS = {"nfs", "nfs4", "cifs", "smb3", "smbfs"}
_PARALLEL = {"lustre", "wekafs", "gpfs", "beegfs", "cephfs", "ceph", "panfs", "daos", "fuse.juicefs", "juicefs"}
_LOCAL = {"ext4", "xfs", "btrfs", "ext3", "zfs", "f2fs", "bcachefs"}


def rule_fs_type(path: str, fs_type: str | None) -> Finding:
    """NFS (or SMB) under checkpoints or datasets serializes through one server; tmpfs and overlay are not storage tiers."""
    check = "filesystem type"
    if not fs_type:
        return skipped(check, path, "filesystem type unknown (no /proc/self/mountinfo)")
    fs = fs_type.lower()
    if fs in _NETWORK_NFS:
        return Finding(check, path, WARN, f"{fs_type}: one server carries every client's reads and checkpoint writes",
                       "Move checkpoints and datasets to a parallel filesystem (Lustre, Weka, GPFS) or stage them on "
                       "local NVMe; NFS holds up only below ~32 GPUs", {"fs_type": fs_type})
    if fs == "tmpfs" or fs == "ramfs":
        return Finding(check, path, WARN, f"{fs_type}: lives in RAM and is lost on reboot or node failure",
                       "Use tmpfs only for staging; persist checkpoints to local NVMe or a shared filesystem",
                       {"fs_type": fs_type})
    if fs == "overlay":
        return Finding(check, path, WARN, "overlay: a container's copy-on-write layer, slow for large files",
                       "Mount a host NVMe directory or the shared filesystem into the container for data and checkpoints",
                       {"fs_type": fs_type})
    kind = "parallel filesystem" if fs in _PARALLEL else "local filesystem" if fs in _LOCAL else "filesystem"
    return Finding(check, path, OK, f"{fs_type} ({kind})", data={"fs_type": fs_type})


def rule_free_space(path: str, total_bytes: int | None, avail_bytes: int | None) -> Finding:
    """Used ≥ 80% → alert: a checkpoint save that hits a full disk fails the job."""
    check = "free space"
    if not total_bytes or avail_bytes is None:
        return skipped(check, path, "could not stat the filesystem")
    used = 1 - avail_bytes / total_bytes
    data = {"total_bytes": total_bytes, "avail_bytes": avail_bytes, "used_fraction": used}
    detail = f"{used:.0%} used, {fmt_bytes(avail_bytes)} free of {fmt_bytes(total_bytes)}"
    if used >= FULL_ALERT:
        return Finding(check, path, ALERT, detail,
                       "Delete old checkpoints now and set a retention policy (keep the last 2–3 on this tier); "
                       "alert at 80% so a save never meets a full disk", data)
    return Finding(check, path, OK, detail, data=data)


def rule_lustre_stripe(path: str, layouts: list[StripeLayout] | None, file_sizes: dict[str, int] | None = None,
                       reason: str = "") -> Finding:
    """Stripe count 1 (or the default 0) on a checkpoint/dataset directory or a large file → alert.

    All of that data goes through one OST whatever the OST count; ``lfs setstripe -c -1``
    spreads new files over every OST, existing ones must be rewritten (``lfs migrate``).
    """
    check = "lustre striping"
    if layouts is None:
        return skipped(check, path, reason or "not a Lustre filesystem")
    if not layouts:
        return skipped(check, path, "lfs getstripe reported no layout")
    sizes = file_sizes or {}
    narrow_dirs = [x for x in layouts if x.is_dir and x.stripe_count in (0, 1)]
    narrow_files = [x for x in layouts if not x.is_dir and x.stripe_count == 1
                    and sizes.get(x.path, LARGE_FILE_BYTES) >= LARGE_FILE_BYTES]
    counts = sorted({x.stripe_count for x in layouts})
    data = {"stripe_counts": counts, "narrow_dirs": [x.path for x in narrow_dirs],
            "narrow_files": [x.path for x in narrow_files], "layouts": len(layouts)}
    if narrow_dirs:
        d = narrow_dirs[0]
        return Finding(check, path, ALERT,
                       f"directory {d.path} gives new files stripe count {d.stripe_count}"
                       f"{' (filesystem default, usually 1)' if d.stripe_count == 0 else ''}: every file on one OST",
                       f"lfs setstripe -c -1 -S 4m {d.path}   (new files; rewrite old ones with lfs migrate -c -1)", data)
    if narrow_files:
        f = narrow_files[0]
        more = f" and {len(narrow_files) - 1} more" if len(narrow_files) > 1 else ""
        return Finding(check, path, ALERT, f"large file {f.path}{more} has stripe count 1: read and written by one OST",
                       f"lfs migrate -c -1 -S 4m {f.path}   (and lfs setstripe -c -1 -S 4m on its directory)", data)
    return Finding(check, path, OK, f"stripe counts seen: {', '.join(map(str, counts))} (-1 = all OSTs)", data=data)


def rule_odirect(path: str, supported: bool | None, reason: str = "") -> Finding:
    """Filesystems that refuse O_DIRECT force page-cache copies for every checkpoint and weight byte."""
    check = "O_DIRECT"
    if supported is None:
        return skipped(check, path, reason or "O_DIRECT not testable here")
    if supported:
        return Finding(check, path, OK, "O_DIRECT accepted: large reads and writes can bypass the page cache")
    return Finding(check, path, WARN, f"O_DIRECT refused{': ' + reason if reason else ''}; I/O falls back to buffered "
                   "copies through the page cache",
                   "Put checkpoint staging and weight caches on an XFS or ext4 NVMe filesystem that accepts O_DIRECT",
                   {"reason": reason})


def rule_read_ahead(target: str, device: str | None, read_ahead_kb: int | None) -> Finding:
    """read_ahead_kb below the kernel default starves buffered sequential readers (weights, packed shards)."""
    check = "read-ahead"
    if read_ahead_kb is None:
        return skipped(check, target, "no read_ahead_kb for this filesystem's device")
    data = {"device": device, "read_ahead_kb": read_ahead_kb}
    if read_ahead_kb < READ_AHEAD_MIN_KB:
        where = f"/sys/block/{device}/queue/read_ahead_kb" if device else "the device's read_ahead_kb"
        return Finding(check, target, WARN, f"read_ahead_kb = {read_ahead_kb} on {device or 'its device'}: "
                       "buffered sequential reads issue tiny requests",
                       f"echo 4096 | sudo tee {where}   (persist with a udev rule)", data)
    return Finding(check, target, OK, f"read_ahead_kb = {read_ahead_kb} on {device or 'its device'}", data=data)


def rule_queue_depth(target: str, qd1_bps: float | None, qd32_bps: float | None, block: int = 0,
                     reason: str = "") -> Finding:
    """QD32 read bandwidth ≥ 2× QD1: one request at a time leaves most of the device idle."""
    check = "queue depth"
    if not qd1_bps or not qd32_bps:
        return skipped(check, target, reason or "read probe not run")
    ratio = qd32_bps / qd1_bps
    data = {"qd1_bps": qd1_bps, "qd32_bps": qd32_bps, "ratio": ratio, "block": block}
    detail = f"{block // 1024} KiB random reads: QD1 {fmt_rate(qd1_bps)}, QD32 {fmt_rate(qd32_bps)} ({ratio:.1f}×)"
    if ratio >= QD_RATIO_WARN:
        return Finding(check, target, WARN, detail + ": single-stream readers get a fraction of the device",
                       "Keep many reads in flight: tierio's parallel reader, DataLoader num_workers ≥ 8, or io_uring; "
                       "never one torch.load or read() loop", data)
    return Finding(check, target, OK, detail + ": not queue-depth sensitive", data=data)


def rule_small_files(target: str, files: int | None, small: int = 0, total_bytes: int = 0, truncated: bool = False,
                     reason: str = "") -> Finding:
    """Many files under 1 MB → metadata-bound reads (one open+stat+close per sample)."""
    check = "small files"
    if files is None:
        return skipped(check, target, reason or "not scanned")
    data = {"files": files, "small": small, "total_bytes": total_bytes, "truncated": truncated}
    seen = f"{files:,}{'+' if truncated else ''} files, {small:,} under 1 MB"
    if files and small / files >= SMALL_SHARE and small >= SMALL_WARN_COUNT:
        verdict = ALERT if small >= SMALL_ALERT_COUNT else WARN
        return Finding(check, target, verdict, seen + ": reading is bound by metadata operations, not bandwidth",
                       "Pack the samples into 100 MB–1 GB shards (WebDataset tar or token shards) and read shards "
                       "sequentially", data)
    return Finding(check, target, OK, seen, data=data)


def _await_limit(name: str) -> float:
    return AWAIT_WARN_MS["nvme" if name.startswith("nvme") else "other"]


def rule_device_load(loads: Iterable[DeviceLoad] | None, devices: set[str] | None = None, seconds: float = 0.0,
                     reason: str = "") -> list[Finding]:
    """%util > 80% → alert (the device is the bottleneck); read await above 1 ms (NVMe) or 20 ms → warn.

    ``devices`` narrows the check to the disks under the paths being diagnosed; idle devices are
    summarized in one ok finding.
    """
    check = "device load"
    if loads is None:
        return [skipped(check, "block devices", reason or "no disk statistics on this system")]
    rows = [x for x in loads if (devices is None or x.name in devices)]
    if not rows:
        return [skipped(check, ", ".join(sorted(devices or [])) or "block devices", "no matching block device")]
    out = []
    for x in rows:
        data = {k: getattr(x, k) for k in ("util_pct", "reads_per_s", "writes_per_s", "read_bps", "write_bps",
                                            "r_await_ms", "w_await_ms")}
        detail = (f"%util {x.util_pct:.0f}%, read {fmt_rate(x.read_bps)} at r_await {x.r_await_ms:.2f} ms, "
                  f"write {fmt_rate(x.write_bps)} at w_await {x.w_await_ms:.2f} ms"
                  + (f" over {seconds:.1f} s" if seconds else ""))
        if x.util_pct > UTIL_ALERT:
            out.append(Finding(check, x.name, ALERT, detail + ": saturated",
                               "Spread the load: cache the dataset on more local NVMe drives or add OSTs; if it "
                               "happens during checkpoints, write them asynchronously to local NVMe first", data))
        elif x.reads_per_s >= 1 and x.r_await_ms > _await_limit(x.name):
            out.append(Finding(check, x.name, WARN, detail + f": reads wait longer than {_await_limit(x.name):g} ms",
                               "Find the competing I/O (iotop, iostat -dx 1) and move it off this device, or serve "
                               "hot data from local NVMe", data))
        else:
            out.append(Finding(check, x.name, OK, detail, data=data))
    return out


# ---- timer JSON (tierio.diag.timers) ------------------------------------------------------------

def _stats(summary: dict[str, Any], part: str) -> dict[str, float] | None:
    s = summary.get(part)
    return s if isinstance(s, dict) and "mean" in s else None


def rule_data_wait_variance(target: str, summary: dict[str, Any]) -> Finding:
    """Data-wait P99 / mean > 3× → alert: storage variance (OST contention, NFS locks), not the DataLoader."""
    check = "data-wait variance"
    s = _stats(summary, "data_wait")
    n = int(summary.get("steps", 0))
    if s is None:
        return skipped(check, target, "no data-wait timings in this file")
    if n < MIN_STEPS:
        return skipped(check, target, f"only {n} steps timed; need {MIN_STEPS}+ for a P99")
    ratio = s["p99"] / s["mean"] if s["mean"] > 0 else 0.0
    data = {"mean_s": s["mean"], "p99_s": s["p99"], "ratio": ratio, "steps": n}
    detail = f"data wait mean {fmt_seconds(s['mean'])}, P99 {fmt_seconds(s['p99'])} (P99/mean {ratio:.1f}×)"
    if ratio > WAIT_P99_MEAN:
        return Finding(check, target, ALERT, detail + ": some batches arrive far later than the rest",
                       "Look for filesystem contention: lfs getstripe on the dataset (stripe count 1?), "
                       "lctl get_param osc.*.stats, or cache the dataset on local NVMe", data)
    return Finding(check, target, OK, detail, data=data)


def rule_data_wait_share(target: str, summary: dict[str, Any]) -> Finding:
    """Data wait > 3% of step time → warn: the input pipeline does not keep up."""
    check = "data-wait share"
    s, t = _stats(summary, "data_wait"), _stats(summary, "step")
    if s is None or t is None or not t.get("sum"):
        return skipped(check, target, "no data-wait and step timings in this file")
    share = s["sum"] / t["sum"]
    data = {"share": share}
    detail = f"GPUs wait for data {share:.1%} of the time"
    if share > WAIT_SHARE_WARN:
        return Finding(check, target, WARN, detail + f" (target < {WAIT_SHARE_WARN:.0%})",
                       "Raise DataLoader num_workers (up to 8 per GPU) and prefetch_factor, set pin_memory=True; "
                       "if iostat shows the disk saturated, cache the data on local NVMe", data)
    return Finding(check, target, OK, detail, data=data)


def rule_step_variance(target: str, summary: dict[str, Any]) -> Finding:
    """Step-time P99 / P50 > 3× → alert: almost always filesystem contention, not compute or network."""
    check = "step-time variance"
    s = _stats(summary, "step")
    n = int(summary.get("steps", 0))
    if s is None:
        return skipped(check, target, "no step timings in this file")
    if n < MIN_STEPS:
        return skipped(check, target, f"only {n} steps timed; need {MIN_STEPS}+ for a P99")
    ratio = s["p99"] / s["p50"] if s["p50"] > 0 else 0.0
    data = {"p50_s": s["p50"], "p99_s": s["p99"], "ratio": ratio}
    detail = f"step P50 {fmt_seconds(s['p50'])}, P99 {fmt_seconds(s['p99'])} (P99/P50 {ratio:.1f}×)"
    if ratio > STEP_P99_P50:
        return Finding(check, target, ALERT, detail + ": slow steps point at storage contention",
                       "Check stripe counts (lfs getstripe), OST load (lctl get_param osc.*.stats) and give "
                       "storage traffic its own network; then re-time", data)
    return Finding(check, target, OK, detail, data=data)


def rule_checkpoint_stall(target: str, summary: dict[str, Any]) -> Finding:
    """Checkpoint stall > 1% of step time → alert: saves block training."""
    check = "checkpoint stall"
    s, t = _stats(summary, "checkpoint_stall"), _stats(summary, "step")
    if s is None or t is None or not t.get("sum"):
        return skipped(check, target, "no checkpoint timings in this file (WaitTimer data, or no checkpoints)")
    share = s["sum"] / t["sum"]
    n_ck = int(summary.get("checkpoints", 0))
    data = {"share": share, "stall_s": s["sum"], "checkpoints": n_ck}
    detail = f"{n_ck} checkpoint(s) stalled training {fmt_seconds(s['sum'])} = {share:.2%} of step time"
    if share > CKPT_STALL_ALERT:
        return Finding(check, target, ALERT, detail + f" (target < {CKPT_STALL_ALERT:.0%})",
                       "Save asynchronously (block only for the snapshot into host buffers) and write per-rank "
                       "shards; see `tierio plan --only write`", data)
    return Finding(check, target, OK, detail, data=data)


def timer_findings(target: str, doc: dict[str, Any]) -> list[Finding]:
    """Every timer rule over one JSON document written by WaitTimer or StepTimer."""
    summary = doc.get("summary") if isinstance(doc, dict) else None
    if not isinstance(summary, dict):
        return [skipped("timers", target, "not a tierio timer file (no \"summary\")")]
    out = [rule_data_wait_variance(target, summary), rule_data_wait_share(target, summary),
           rule_step_variance(target, summary)]
    if doc.get("kind") == "tierio.steptimer":
        out.append(rule_checkpoint_stall(target, summary))
    return out
