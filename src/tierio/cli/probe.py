"""`tierio probe PATH|URL`."""

from __future__ import annotations

import argparse

from tierio.cli.output import print_json, print_table, styled
from tierio.cli.output import say as _say
from tierio.units import fmt_rate, human_bytes, parse_size

EPILOG = """\
examples:
  tierio probe /mnt/nvme/scratch            O_DIRECT vs buffered write/read of 1 GiB
  tierio probe /mnt/lustre/ckpt --size 8GiB  a bigger sample for a parallel filesystem
  tierio probe 's3://bucket/tmp?endpoint=http://127.0.0.1:8333' --json > s3.json
  tierio plan --measured s3.json            size storage with measured bandwidths
  tierio probe --gds /mnt/nvme/weights      GPUDirect Storage readiness (nvidia-fs, cuFile, kvikio), one line
"""


def register(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="measure real write/read bandwidth of a directory or an S3 endpoint",
        description="Measure sequential bandwidth where your data lives: O_DIRECT and buffered I/O for a "
        "directory (page cache dropped before reads), PUT/GET throughput for an S3 URL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="TARGET", nargs="?",
                   help="a directory, file:///path, or s3://bucket/prefix[?endpoint=URL] (optional with --gds)")
    p.add_argument("--size", default=None, help="bytes to move per measurement (default 1GiB for a directory, 256MiB for S3)")
    p.add_argument("--concurrency", default="1,4,16", help="S3 only: comma-separated request concurrencies (default 1,4,16)")
    p.add_argument("--json", action="store_true", help="print JSON (input for `tierio plan --measured`)")
    p.add_argument("--gds", action="store_true", help="report GPUDirect Storage readiness instead of measuring: "
                   "nvidia-fs, cuFile settings, kvikio compatibility mode, whether TARGET's filesystem is served")
    p.set_defaults(handler=run)


def _gds(args) -> int:
    from dataclasses import asdict

    from tierio.diag.gdscheck import record_gds, rule_gds
    from tierio.diag.system import find_mount

    paths = []
    if args.target:
        path = args.target.removeprefix("file://")
        mount = find_mount(path)
        paths.append((path, mount.fs_type if mount else None, mount.options if mount else None))
    finding = rule_gds(record_gds(), paths)
    measured = None
    if args.target and finding.verdict != "skipped":  # a GPU is here: read the same file both ways
        from tierio.diag.probe import probe_gds

        measured = probe_gds(paths[0][0], parse_size(args.size or "256MiB"))
    if args.json:
        print_json({**asdict(finding), "measured": measured.to_dict() if measured else None})
        return 0
    print(f"GPUDirect Storage: {styled(finding.verdict, 'bold')}: {finding.detail}")
    if finding.fix:
        print(f"fix: {finding.fix}")
    if measured is not None:
        by = {r.mode: r.bytes_per_s for r in measured.results}
        print(f"read {human_bytes(measured.results[0].bytes)}: GDS {fmt_rate(by['gds'])}, bounce {fmt_rate(by['bounce'])} "
              f"({by['gds'] / by['bounce']:.2f}x)")
    return 0


def run(args) -> int:
    if args.gds:
        return _gds(args)
    if not args.target:
        from tierio.errors import ConfigError

        raise ConfigError("tierio probe needs a TARGET: a directory or an s3:// URL (or --gds for the GDS report)")
    say = None if args.json else (lambda what: _say(styled(f"probing {what} ...", "dim"), err=True))
    from tierio.diag.probe import probe_directory, probe_s3  # imports numpy and the stores: not for --help

    if args.target.startswith("s3://"):
        conc = tuple(int(c) for c in args.concurrency.split(","))
        report = probe_s3(args.target, parse_size(args.size or "256MiB"), conc, progress=say)
    else:
        path = args.target.removeprefix("file://")
        report = probe_directory(path, parse_size(args.size or "1GiB"), progress=say)
    if args.json:
        print_json(report.to_dict())
        return 0
    rows = [
        (r.mode + (f" x{r.concurrency}" if r.concurrency else ""), r.op, human_bytes(r.bytes), f"{r.seconds:.2f} s", fmt_rate(r.bytes_per_s))
        for r in report.results
    ]
    print_table(f"{report.target} ({report.fs_type})", ["mode", "op", "size", "time", "bandwidth"], rows)
    by = {(r.mode, r.op): r.bytes_per_s for r in report.results}
    if ("direct", "write") in by and by.get(("buffered", "write")):
        print(f"O_DIRECT write is {by['direct', 'write'] / by['buffered', 'write']:.1f}x buffered write + fsync here.")
    for note in report.notes:
        print(f"note: {note}")
    return 0
