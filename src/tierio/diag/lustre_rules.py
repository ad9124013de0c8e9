"""Doctor rules for the rest of the Lustre protocol: stripe width against the OST count, stripe size,
free space over the OSTs, inodes on the MDTs, and what the client statistics say.

Like ``tierio.diag.rules``: pure functions from recorded `lfs`/`lctl` output to one verdict and one fix.
"""

from __future__ import annotations

from tierio.diag.lustre_stats import ClientStats
from tierio.diag.rules import ALERT, OK, WARN, Finding, skipped
from tierio.io.lustre import STRIPE_SIZE_BYTES, StripeLayout, TargetUsage
from tierio.plan.quantities import fmt_bytes
from tierio.units import human_bytes

OST_FULL_ALERT = 0.90        # used fraction of one OST: writes striped onto it fail first
OST_SPREAD_WARN = 0.20       # fullest OST minus emptiest, in used fraction
INODES_ALERT = 0.80          # used fraction of an MDT's inodes
OBJECTS_WARN = 0.80          # used fraction of an OST's objects
SMALL_READ_BYTES = 1 << 20   # mean client read below this: metadata- and RPC-bound
MIN_READS = 1_000            # fewer reads than this say nothing about a job's read size
OST_HOT_RATIO = 3.0          # bytes through the busiest OST / mean over OSTs


def rule_stripe_width(path: str, layouts: list[StripeLayout], osts: int | None) -> Finding:
    """A stripe count above 1 but below the OST count → warn: a file gets count/OSTs of the bandwidth.

    Counts 0 and 1 are the ``lustre striping`` rule's alert; -1 is every OST."""
    check = "lustre stripe width"
    if not osts:
        return skipped(check, path, "OST count unknown (no `lfs df` output)")
    partial = [x for x in layouts if 1 < x.stripe_count < osts]
    data = {"osts": osts, "partial": [(x.path, x.stripe_count) for x in partial]}
    if partial:
        x = partial[0]
        return Finding(check, path, WARN,
                       f"{x.path} stripes over {x.stripe_count} of {osts} OSTs: a file gets "
                       f"{x.stripe_count}/{osts} = {x.stripe_count / osts:.0%} of the filesystem's bandwidth",
                       f"lfs setstripe -c -1 -S 4m {x.path}   (rewrite existing files with lfs migrate -c -1)", data)
    counts = sorted({x.stripe_count for x in layouts})
    return Finding(check, path, OK, f"stripe counts {', '.join(map(str, counts))} on {osts} OSTs "
                   "(-1 = all; counts 0 and 1 are judged under lustre striping)", data=data)


def rule_stripe_size(path: str, layouts: list[StripeLayout]) -> Finding:
    """A directory default stripe size below 4 MiB → warn: checkpoint and dataset shards are written in
    large sequential blocks, and 1 MiB stripes cut each into four times as many OST requests."""
    check = "lustre stripe size"
    dirs = [x for x in layouts if x.is_dir and x.stripe_size]
    if not dirs:
        return skipped(check, path, "no directory layout recorded (the path is a file, or lfs gave none)")
    small = [x for x in dirs if x.stripe_size < STRIPE_SIZE_BYTES]
    data = {"stripe_sizes": sorted({x.stripe_size for x in dirs})}
    if small:
        x = small[0]
        return Finding(check, path, WARN,
                       f"directory {x.path} gives new files {human_bytes(x.stripe_size)} stripes: a 64 MiB shard write "
                       f"is {64 * (1 << 20) // x.stripe_size} OST pieces instead of 16",
                       f"lfs setstripe -c -1 -S 4m {x.path}   (new files; lfs migrate -S 4m rewrites old ones)", data)
    return Finding(check, path, OK, f"stripe size {human_bytes(dirs[0].stripe_size)} (≥ 4 MiB)", data=data)


def rule_ost_balance(path: str, targets: list[TargetUsage]) -> Finding:
    """An OST ≥ 90% full → alert (writes striped onto it fail with ENOSPC while `df` still shows room);
    fullest minus emptiest > 20 points → warn (new stripes pile onto the emptier OSTs)."""
    check = "OST free space"
    osts = [t for t in targets if t.kind == "OST"]
    if not osts:
        return skipped(check, path, "no OST rows in `lfs df` output")
    full, empty = max(osts, key=lambda t: t.used_fraction), min(osts, key=lambda t: t.used_fraction)
    spread = full.used_fraction - empty.used_fraction
    data = {"osts": len(osts), "fullest": full.name, "fullest_used": full.used_fraction,
            "emptiest_used": empty.used_fraction, "spread": spread}
    detail = (f"{len(osts)} OSTs, fullest {full.name} {full.used_fraction:.0%} used "
              f"({fmt_bytes(full.avail)} free), emptiest {empty.used_fraction:.0%}")
    move = (f"lfs find {path} --ost {_index(full.name)} --size +1G | lfs_migrate -y   "
            "(moves large files off the full OST); delete old checkpoints")
    if full.used_fraction >= OST_FULL_ALERT:
        return Finding(check, path, ALERT, detail + ": a write striped onto it fails with ENOSPC first", move, data)
    if spread > OST_SPREAD_WARN:
        return Finding(check, path, WARN, detail + f": {spread:.0%} apart, new stripes pile onto the emptier OSTs",
                       move, data)
    return Finding(check, path, OK, detail, data=data)


def _index(name: str) -> str:
    part = name.rsplit("-", 1)[-1].removesuffix("_UUID")
    return str(int(part[3:], 16)) if part[:3] in ("OST", "MDT") and part[3:] else name


def rule_lustre_inodes(path: str, targets: list[TargetUsage]) -> Finding:
    """MDT inodes ≥ 80% used → alert (creates fail: a checkpoint writes files on every save);
    OST objects ≥ 80% → warn."""
    check = "lustre inodes"
    if not targets:
        return skipped(check, path, "no MDT/OST rows in `lfs df -i` output")
    worst = max(targets, key=lambda t: t.used_fraction)
    data = {"target": worst.name, "kind": worst.kind, "used_fraction": worst.used_fraction,
            "free": worst.avail}
    detail = f"{worst.name}: {worst.used_fraction:.0%} of {worst.total:,} inodes used ({worst.avail:,} free)"
    fix = ("Pack small samples into 100 MB–1 GB shards and delete old checkpoint steps (tierio ckpt gc); "
           "ask the admins for another MDT (DNE) if the namespace keeps growing")
    if worst.kind == "MDT" and worst.used_fraction >= INODES_ALERT:
        return Finding(check, path, ALERT, detail + ": file creates fail when they run out", fix, data)
    if worst.kind == "OST" and worst.used_fraction >= OBJECTS_WARN:
        return Finding(check, path, WARN, detail + ": object creates on this OST fail when they run out", fix, data)
    return Finding(check, path, OK, detail, data=data)


def rule_client_reads(stats: list[ClientStats]) -> Finding:
    """Mean read through a Lustre mount under 1 MiB (over ≥ 1,000 reads) → warn: each read is an RPC round trip."""
    check, target = "lustre read size", "lustre client"
    llite = [s for s in stats if s.kind == "llite" and "read_bytes" in s.counters]
    if not llite:
        return skipped(check, target, "no llite read_bytes counters in `lctl get_param llite.*.stats`")
    s = max(llite, key=lambda x: x.counters["read_bytes"].samples)
    c = s.counters["read_bytes"]
    data = {"mount": s.name, "reads": c.samples, "bytes": c.total, "mean_bytes": c.mean}
    detail = f"{s.name}: {c.samples:,} reads, mean {human_bytes(c.mean)}"
    if c.samples >= MIN_READS and c.mean < SMALL_READ_BYTES:
        return Finding(check, target, WARN, detail + ": small reads pay an RPC round trip each",
                       "Read in large blocks: pack samples into shards read sequentially, and keep many reads in "
                       "flight (tierio's parallel reader issues 8 MiB requests)", data)
    return Finding(check, target, OK, detail, data=data)


def rule_ost_load(stats: list[ClientStats]) -> Finding:
    """One OST carrying > 3× the mean bytes of this client's OSTs → alert: a hotspot (narrow stripes)."""
    check, target = "OST load", "lustre client"
    osc = [s for s in stats if s.kind == "osc"]
    total = sum(s.bytes_moved() for s in osc)
    if len(osc) < 2 or not total:
        return skipped(check, target, "fewer than 2 OSTs with traffic in `lctl get_param osc.*.stats`")
    hot = max(osc, key=lambda s: s.bytes_moved())
    mean = total / len(osc)
    ratio = hot.bytes_moved() / mean
    data = {"hot_ost": hot.name, "hot_bytes": hot.bytes_moved(), "mean_bytes": mean, "ratio": ratio, "osts": len(osc)}
    detail = (f"{hot.name} moved {fmt_bytes(hot.bytes_moved())}, {ratio:.1f}× the mean "
              f"{fmt_bytes(mean)} of {len(osc)} OSTs")
    if ratio > OST_HOT_RATIO:
        return Finding(check, target, ALERT, detail + ": one OST serializes this client's I/O",
                       "Find the narrow files (lfs getstripe on the checkpoint and dataset directories) and restripe "
                       "them: lfs setstripe -c -1 -S 4m DIR; lfs migrate -c -1 FILE", data)
    return Finding(check, target, OK, detail, data=data)
