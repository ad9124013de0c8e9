"""The storage doctor: record what one node can observe about some paths, then judge it with the rules.

``record()`` touches the machine (mountinfo, statvfs, /proc/diskstats, sysfs, ``lfs``, a short
O_DIRECT probe, a file scan); ``diagnose()`` is pure and turns a ``Recorded`` into findings, so a
capture from a slow cluster can be judged anywhere.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from tierio.diag import lustre_rules, rules
from tierio.diag.gdscheck import GdsFacts, record_gds, rule_gds
from tierio.diag.live import live_findings, scrape
from tierio.diag.lustre_stats import LCTL_ARGV, parse_lctl_stats
from tierio.diag.mount_rules import rule_mount_options
from tierio.diag.parse import diskstats_delta, is_whole_disk, parse_diskstats, parse_iostat
from tierio.diag.rules import Finding
from tierio.diag.topology import record_topology, rule_topology, topology_from_dicts, topology_to_dicts
from tierio.diag.system import DISKSTATS, FileScan, block_device, find_mount, read_text, scan_files, space
from tierio.io.lustre import parse_getstripe, parse_lfs_df
from tierio.io.tools import CommandRunner, run_tool
from tierio.errors import FormatError, NotFoundError
from tierio.io.untrusted import read_json_file


@dataclass
class PathFacts:
    """What was recorded about one path. ``*_reason`` says why a fact is missing."""

    path: str
    fs_type: str | None = None
    mount_point: str | None = None
    total_bytes: int | None = None
    avail_bytes: int | None = None
    device: str | None = None
    read_ahead_kb: int | None = None
    odirect: bool | None = None
    odirect_reason: str = ""
    qd1_bps: float | None = None
    qd32_bps: float | None = None
    qd_block: int = 0
    qd_reason: str = ""
    files: FileScan | None = None
    files_reason: str = ""
    stripe_text: str | None = None
    stripe_reason: str = ""
    file_sizes: dict[str, int] = field(default_factory=dict)
    mount_options: str | None = None
    mount_source: str = ""
    lfs_df_text: str | None = None          # `lfs df PATH`: OST and MDT space
    lfs_df_inodes_text: str | None = None   # `lfs df -i PATH`: inodes and objects
    lfs_df_reason: str = ""


@dataclass
class Recorded:
    """Everything the rules need, captured once."""

    paths: list[PathFacts] = field(default_factory=list)
    diskstats_before: str | None = None
    diskstats_after: str | None = None
    sample_seconds: float = 0.0
    iostat_text: str | None = None
    iostat_reason: str = ""    # why `iostat` was asked for but not used
    disk_reason: str = ""
    timers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lctl_text: str | None = None             # `lctl get_param llite.*.stats osc.*.stats`
    lctl_reason: str = ""
    topology: list[dict[str, Any]] | None = None   # GPUs, NVMe drives, NICs: PCIe path and NUMA node
    gds: dict[str, Any] | None = None               # GdsFacts: driver, nvidia-fs, cuFile settings, kvikio
    prometheus_url: str | None = None               # a running job's metrics endpoint, and what it answered
    prometheus_text: str | None = None
    prometheus_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "tierio.doctor.recording", "version": 1, **asdict(self)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "<recording>") -> Recorded:
        """Rebuild a recording saved with ``tierio doctor --save``; FormatError when it is not one."""
        if not isinstance(doc, dict) or doc.get("kind") != "tierio.doctor.recording":
            raise FormatError(f"{source} is not a doctor recording: write one with `tierio doctor PATH --save FILE`")
        try:
            paths = []
            for p in doc.get("paths", []):
                p = dict(p)
                if p.get("files") is not None:
                    f = dict(p["files"])
                    f["largest"] = [tuple(x) for x in f.get("largest", [])]
                    p["files"] = FileScan(**f)
                paths.append(PathFacts(**p))
            fields = {k: doc[k] for k in ("diskstats_before", "diskstats_after", "sample_seconds", "iostat_text",
                                          "iostat_reason", "disk_reason", "lctl_text", "lctl_reason", "topology", "gds",
                                          "prometheus_url", "prometheus_text", "prometheus_reason")
                      if k in doc}
            timers = [(str(n), d) for n, d in doc.get("timers", [])]
            if fields.get("topology") is not None:
                fields["topology"] = topology_to_dicts(topology_from_dicts(fields["topology"]))  # checked here
            if fields.get("gds") is not None:
                fields["gds"] = GdsFacts(**fields["gds"]).to_dict()
            return cls(paths=paths, timers=timers, **fields)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise FormatError(f"{source}: malformed doctor recording ({exc})") from None


def diagnose(rec: Recorded) -> list[Finding]:
    """Judge a recording: per path, then the devices under those paths, then the Lustre client, then timer files."""
    out: list[Finding] = []
    for p in rec.paths:
        out.extend(path_findings(p))
    if rec.iostat_reason:
        out.append(rules.skipped("iostat", "block devices", rec.iostat_reason +
                                 ("; sampled /proc/diskstats instead" if rec.diskstats_after else "")))
    out.extend(device_findings(rec))
    if rec.lctl_text is not None:
        stats = parse_lctl_stats(rec.lctl_text)
        out += [lustre_rules.rule_client_reads(stats), lustre_rules.rule_ost_load(stats)]
    elif rec.lctl_reason:
        out.append(rules.skipped("lustre client", "lustre client", rec.lctl_reason))
    if rec.topology is not None:
        out.extend(rule_topology(topology_from_dicts(rec.topology), {p.device for p in rec.paths if p.device}))
    if rec.gds is not None:
        out.append(rule_gds(GdsFacts(**rec.gds), [(p.path, p.fs_type, p.mount_options) for p in rec.paths]))
    for name, doc in rec.timers:
        out.extend(rules.timer_findings(name, doc))
    if rec.prometheus_text is not None:
        out.extend(live_findings(rec.prometheus_text, rec.prometheus_url or "metrics"))
    elif rec.prometheus_reason:
        out.append(rules.skipped("live metrics", rec.prometheus_url or "metrics", rec.prometheus_reason))
    return out


def path_findings(p: PathFacts) -> list[Finding]:
    out = [rules.rule_fs_type(p.path, p.fs_type), rules.rule_free_space(p.path, p.total_bytes, p.avail_bytes),
           rule_mount_options(p.path, p.fs_type, p.mount_options, p.mount_source, p.device)]
    if p.stripe_text is not None:
        out.append(rules.rule_lustre_stripe(p.path, parse_getstripe(p.stripe_text, p.path), p.file_sizes))
    else:
        reason = p.stripe_reason or (f"not a Lustre filesystem ({p.fs_type})" if p.fs_type else "not Lustre")
        out.append(rules.rule_lustre_stripe(p.path, None, reason=reason))
    if p.fs_type == "lustre":
        out.extend(lustre_path_findings(p))
    out.append(rules.rule_odirect(p.path, p.odirect, p.odirect_reason))
    out.append(rules.rule_read_ahead(p.path, p.device, p.read_ahead_kb))
    out.append(rules.rule_queue_depth(p.path, p.qd1_bps, p.qd32_bps, p.qd_block, p.qd_reason))
    if p.files is not None:
        out.append(rules.rule_small_files(p.path, p.files.files, p.files.small, p.files.total_bytes,
                                          p.files.truncated))
    else:
        out.append(rules.rule_small_files(p.path, None, reason=p.files_reason))
    return out


def lustre_path_findings(p: PathFacts) -> list[Finding]:
    """Stripe width and size against the OSTs, free space over the OSTs, inodes (a Lustre path only)."""
    layouts = parse_getstripe(p.stripe_text, p.path) if p.stripe_text else []
    targets = parse_lfs_df(p.lfs_df_text) if p.lfs_df_text else None
    osts = sum(t.kind == "OST" for t in targets or []) or None
    out = [lustre_rules.rule_stripe_width(p.path, layouts, osts) if layouts
           else rules.skipped("lustre stripe width", p.path, p.stripe_reason or "no layout recorded"),
           lustre_rules.rule_stripe_size(p.path, layouts)]
    reason = p.lfs_df_reason or "lfs df not recorded"
    out.append(lustre_rules.rule_ost_balance(p.path, targets) if targets is not None
               else rules.skipped("OST free space", p.path, reason))
    out.append(lustre_rules.rule_lustre_inodes(p.path, parse_lfs_df(p.lfs_df_inodes_text, inodes=True))
               if p.lfs_df_inodes_text is not None else rules.skipped("lustre inodes", p.path, reason))
    return out


def device_findings(rec: Recorded) -> list[Finding]:
    devices = {p.device for p in rec.paths if p.device}
    if rec.iostat_text is not None:
        loads = parse_iostat(rec.iostat_text)
        seconds = 0.0
    elif rec.diskstats_before is not None and rec.diskstats_after is not None:
        loads = diskstats_delta(parse_diskstats(rec.diskstats_before), parse_diskstats(rec.diskstats_after),
                                rec.sample_seconds)
        seconds = rec.sample_seconds
    else:
        return rules.rule_device_load(None, reason=rec.disk_reason)
    if not devices:  # network filesystems only, or no path given: look at every whole disk that did work
        busy = [x for x in loads if is_whole_disk(x.name) and (x.reads_per_s or x.writes_per_s or x.util_pct)]
        devices = {x.name for x in busy} or {x.name for x in loads if is_whole_disk(x.name)}
    return rules.rule_device_load(loads, devices, seconds)


def load_recording(path: str) -> Recorded:
    """Read a recording written by ``tierio doctor --save FILE``."""
    doc = read_json_file(path, missing=f"write a recording with `tierio doctor PATH --save {path}`")
    return Recorded.from_dict(doc, path)


def load_timer_file(path: str) -> tuple[str, dict[str, Any]]:
    """Read a JSON file written by WaitTimer/StepTimer.to_json()."""
    doc = read_json_file(path, missing=f"write a timer file with StepTimer().to_json('{path}')",
                         what="give a file written by WaitTimer/StepTimer.to_json()")
    if not isinstance(doc, dict) or not str(doc.get("kind", "")).startswith("tierio.") or "summary" not in doc:
        raise FormatError(f"{path} is not a tierio timer file: write it with WaitTimer/StepTimer.to_json()")
    return path, doc


def record(paths: list[str], timer_files: list[str] | None = None, sample_seconds: float = 3.0, probe: bool = True,
           scan: bool = True, use_iostat: bool = False, runner: CommandRunner = run_tool,
           prometheus_url: str | None = None) -> Recorded:
    """Observe this node. The disk sample runs first so the doctor's own probes do not load the disks.

    ``runner`` runs `lfs` and `lctl` (a recorded cluster's outputs can stand in for them);
    ``prometheus_url``: a running job's metrics endpoint, scraped once."""
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise NotFoundError(f"{missing[0]} does not exist: give directories that hold checkpoints, datasets or weights")
    timers = [load_timer_file(t) for t in timer_files or []]
    rec = Recorded(timers=timers, prometheus_url=prometheus_url)
    if prometheus_url:
        rec.prometheus_text, rec.prometheus_reason = scrape(prometheus_url)
    if use_iostat:
        run = run_tool(["iostat", "-dx", "1", str(max(2, int(round(sample_seconds)) + 1))],
                       timeout=sample_seconds + 30)
        rec.iostat_text, rec.iostat_reason = run.output, run.reason
    if rec.iostat_text is None and sample_seconds > 0:
        before = read_text(DISKSTATS)
        if before is None:
            rec.disk_reason = "no /proc/diskstats on this system"
        else:
            t0 = time.monotonic()
            time.sleep(sample_seconds)
            rec.diskstats_after = read_text(DISKSTATS)
            rec.diskstats_before, rec.sample_seconds = before, time.monotonic() - t0
    elif rec.iostat_text is None:
        rec.disk_reason = "disk sampling turned off (--sample 0)"
    for path in paths:
        rec.paths.append(record_path(path, probe=probe, scan=scan, runner=runner))
    if paths:  # a timers-only run judges the loop, not the node
        rec.topology = topology_to_dicts(record_topology())
        rec.gds = record_gds().to_dict()
    if any(p.fs_type == "lustre" for p in rec.paths):
        run = runner(LCTL_ARGV)
        rec.lctl_text, rec.lctl_reason = run.output, run.reason
    return rec


def record_lustre(facts: PathFacts, runner: CommandRunner = run_tool) -> None:
    """The path's layout (and its largest files'), and the OSTs' and MDTs' space and inodes."""
    path = facts.path
    is_dir = os.path.isdir(path)
    run = runner(["lfs", "getstripe", "-d", path] if is_dir else ["lfs", "getstripe", path])
    facts.stripe_text, facts.stripe_reason = run.output, run.reason
    big = [p for s, p in (facts.files.largest if facts.files else []) if s >= rules.LARGE_FILE_BYTES]
    if run.output is not None and big and is_dir:
        more = runner(["lfs", "getstripe", *big])
        if more.output:
            facts.stripe_text = f"{path}\n{run.output}\n{more.output}"
    df, df_i = runner(["lfs", "df", path]), runner(["lfs", "df", "-i", path])
    facts.lfs_df_text, facts.lfs_df_inodes_text = df.output, df_i.output
    facts.lfs_df_reason = df.reason or df_i.reason


def record_path(path: str, probe: bool = True, scan: bool = True, runner: CommandRunner = run_tool) -> PathFacts:
    from tierio.diag.odirect import odirect_supported, queue_depth_probe

    path = os.path.abspath(path)
    facts = PathFacts(path)
    mount = find_mount(path)
    if mount is not None:
        facts.fs_type, facts.mount_point = mount.fs_type, mount.mount_point
        facts.mount_options, facts.mount_source = mount.options, mount.source
    sp = space(path)
    if sp is not None:
        facts.total_bytes, facts.avail_bytes = sp
    dev = block_device(path)
    facts.device, facts.read_ahead_kb = dev.name, dev.read_ahead_kb
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    if scan:
        facts.files = scan_files(path)
        facts.file_sizes = {p: s for s, p in facts.files.largest}
    else:
        facts.files_reason = "file scan turned off (--no-scan)"
    if facts.fs_type == "lustre":
        record_lustre(facts, runner)
    if not probe:
        facts.odirect_reason = facts.qd_reason = "probes turned off (--no-probe)"
    elif not os.access(directory, os.W_OK):
        facts.odirect_reason = facts.qd_reason = f"{directory} is not writable: cannot place a scratch file"
    else:
        direct = odirect_supported(directory)
        facts.odirect, facts.odirect_reason = direct.supported, direct.reason
        if direct.supported:
            qd = queue_depth_probe(directory)
            facts.qd1_bps, facts.qd32_bps, facts.qd_block, facts.qd_reason = qd.qd1_bps, qd.qd32_bps, qd.block, qd.reason
        else:
            facts.qd_reason = "needs O_DIRECT (buffered reads would measure the page cache)"
    return facts


def counts(findings: list[Finding]) -> dict[str, int]:
    c = Counter(f.verdict for f in findings)
    return {v: c.get(v, 0) for v in rules.VERDICTS}
