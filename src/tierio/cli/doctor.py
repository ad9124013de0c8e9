"""`tierio doctor`: one verdict and one fix per storage failure mode this node can observe."""

from __future__ import annotations

import argparse

EXAMPLES = """\
examples:
  tierio doctor /lustre/checkpoints /lustre/datasets/web
  tierio doctor /mnt/nvme --timers steps.json        also judge StepTimer/WaitTimer output
  tierio doctor --timers steps.json --no-probe --sample 0   only the timer rules
  tierio doctor /data --iostat --sample 10            sample with `iostat -dx` instead of /proc/diskstats
  tierio doctor /data --json | jq '.findings[] | select(.verdict != "ok")'
  tierio doctor /lustre/ckpt --save node17.json       record on the slow node ...
  tierio doctor --replay node17.json                  ... and judge it anywhere
  tierio doctor --prometheus http://node17:9400/metrics   judge a running job from its metrics

checks: filesystem type, free space (alert at 80% used), mount options (NFS nconnect/rsize/actimeo/RDMA,
LNet, noatime), Lustre stripe count, width against the OSTs and size, OST free-space balance, MDT inodes,
client read size and OST load, O_DIRECT, read_ahead_kb, QD1 vs QD32 read bandwidth, small files, device
%util and await, GPU/NVMe/NIC PCIe and NUMA placement, GPUDirect Storage; from timer JSON or a job's
metrics: data-wait P99/mean > 3x, data wait > 3% of step time, step P99/P50 > 3x, checkpoint stall > 1%.
Exit status: 0 without alerts, 3 when any check alerts. Walk-through: docs/diagnose.md.
"""

_STYLE = {"ok": "green", "warn": "yellow", "alert": "bold red", "skipped": "dim"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="diagnose slow or failing storage: one verdict and one fix per check",
        description="Check the paths that hold checkpoints, datasets or weights, the disks under them, "
                    "and timer files from training, for the storage problems that stall GPUs.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATH", help="directories or files to check (default: .)")
    p.add_argument("--timers", action="append", default=[], metavar="FILE",
                   help="JSON written by StepTimer/WaitTimer.to_json() (repeatable)")
    p.add_argument("--sample", default="3s", metavar="SECONDS", help="disk sampling time (default 3s; 0 = off)")
    p.add_argument("--iostat", action="store_true", help="sample with `iostat -dx` (sysstat) instead of /proc/diskstats")
    p.add_argument("--no-probe", action="store_true", help="skip the O_DIRECT and queue-depth probes (they write a "
                   "32 MiB scratch file)")
    p.add_argument("--no-scan", action="store_true", help="skip counting files under each path")
    p.add_argument("--save", metavar="FILE", help="also save what was observed, to judge it elsewhere with --replay")
    p.add_argument("--replay", metavar="FILE", help="judge a recording saved with --save instead of this node")
    p.add_argument("--prometheus", metavar="URL", help="also judge a running job from its metrics endpoint "
                   "(tierio.metrics.serve(), e.g. http://node17:9400/metrics)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    import json
    import os

    from tierio.cli.output import print_json, print_table, say, styled
    from tierio.diag.doctor import counts, diagnose, load_recording, load_timer_file, record
    from tierio.plan.quantities import parse_duration

    if args.replay:
        rec = load_recording(args.replay)
        rec.timers.extend(load_timer_file(t) for t in args.timers)
    else:
        sample = 0.0 if str(args.sample).strip() in ("0", "0s") else parse_duration(args.sample, "--sample")
        paths = args.paths or ([] if args.timers or args.prometheus else ["."])
        rec = record(paths, args.timers, sample_seconds=sample, probe=not args.no_probe, scan=not args.no_scan,
                     use_iostat=args.iostat, prometheus_url=args.prometheus)
    if args.save:
        tmp = f"{args.save}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec.to_dict(), f, indent=1)
        os.replace(tmp, args.save)
    findings = diagnose(rec)
    tally = counts(findings)
    if args.json:
        print_json({"findings": [asdict(f) for f in findings], "counts": tally})
    else:
        # one table per target (a path is long; as a column it would take the width the details need),
        # the fixes as numbered notes below each: commands to copy stay whole
        targets = list(dict.fromkeys(f.target for f in findings))
        for target in targets:
            print_table(f"tierio doctor: {target}", ["check", "verdict", "detail", "fix"],
                        [[f.check, styled(f.verdict, _STYLE[f.verdict]), f.detail, f.fix]
                         for f in findings if f.target == target])
        say(", ".join(f"{n} {v}" for v, n in tally.items()))
    return 3 if tally["alert"] else 0
