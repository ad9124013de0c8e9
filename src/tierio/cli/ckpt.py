"""`tierio ckpt ls|inspect|verify|promote|gc URL`: look after checkpoints on any tier."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tierio.cli.output import print_json, print_table, progress, say, styled
from tierio.cli.parsers import action_group
from tierio.errors import ConfigError, NotFoundError
from tierio.units import fmt_rate, human_bytes, parse_size

EXAMPLES = """\
URL is a tier: a directory (/mnt/nvme/ckpt, file:///lustre/run1) or s3://bucket/prefix[?endpoint=...].

examples:
  tierio ckpt ls /mnt/nvme/ckpt                      committed checkpoints, newest last
  tierio ckpt inspect /mnt/nvme/ckpt                 the latest manifest: tree, dtypes, sizes
  tierio ckpt inspect /mnt/nvme/ckpt --step 2000 --tensors
  tierio ckpt verify /lustre/run1 --all              re-read every chunk and check its xxh3
  tierio ckpt promote /mnt/nvme/ckpt 's3://ckpt/run1?endpoint=http://127.0.0.1:8333' --step 2000
  tierio ckpt gc /lustre/run1 --keep last:3+every:1000 --dry-run
  tierio ckpt unlock /lustre/run1                    break the lease of a run that died
  tierio ckpt export /lustre/run1 ./hf-model          the whole model as safetensors + index, any world size
  tierio ckpt ls ./tierio-demo/shared-fs --json      the same, for scripts
  tierio ckpt ls /mnt/nvme/ckpt --shared /lustre/run1  a node-local tier: its steps, committed or node-local only

retention for gc: last:N (newest N), every:K (steps divisible by K), within:48h (committed in
the last 48 hours), all (keep everything); join with + (keep what any keeps) or & (what all keep).
"""


_URL = "a tier: a directory, file:///path or s3://bucket/prefix[?endpoint=...]"


def register(sub: argparse._SubParsersAction) -> None:
    cmds = action_group(sub, "ckpt", help="list, inspect, verify, promote and garbage-collect checkpoints on a tier",
                        description="Look after tierio checkpoints on one tier (a directory or an S3 prefix).",
                        epilog=EXAMPLES)

    def action(name: str, help: str, example: str) -> argparse.ArgumentParser:
        a = cmds.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                            epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        a.add_argument("--json", action="store_true", help="print JSON instead of tables")
        return a

    a = action("ls", "list the committed checkpoints on a tier", "tierio ckpt ls /mnt/nvme/ckpt")
    a.add_argument("url", metavar="URL", help=_URL)
    a.add_argument("--shared", metavar="URL", help="with a node-local URL: the shared tier its steps are committed "
                   "on, to mark each step committed there or node-local only")
    a.set_defaults(handler=cmd_ls)

    a = action("inspect", "show one checkpoint's manifest: state tree, tensors, sizes",
               "tierio ckpt inspect /mnt/nvme/ckpt --step 2000 --tensors")
    a.add_argument("url", metavar="URL", help=_URL)
    a.add_argument("--step", type=int, help="the step (default: the latest)")
    a.add_argument("--tensors", action="store_true", help="list every tensor with dtype, shape and chunks")
    a.set_defaults(handler=cmd_inspect)

    a = action("verify", "re-read checkpoints and check every chunk's xxh3",
               "tierio ckpt verify /lustre/run1 --all")
    a.add_argument("url", metavar="URL", help=_URL)
    g = a.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="the step (default: the latest)")
    g.add_argument("--all", action="store_true", help="every committed step, and flag directories without a manifest")
    a.set_defaults(handler=cmd_verify)

    a = action("promote", "copy a committed checkpoint to another tier (verified, manifest last)",
               "tierio ckpt promote /mnt/nvme/ckpt s3://ckpt/run1 --step 2000")
    a.add_argument("src", metavar="SRC", help="the tier to copy from: " + _URL)
    a.add_argument("dst", metavar="DST", help="the tier to copy to (created if a local directory)")
    a.add_argument("--step", type=int, help="the step (default: the latest on SRC)")
    a.add_argument("--all", action="store_true", help="every committed step of SRC that DST lacks")
    a.add_argument("--bandwidth", help="limit the copy rate, e.g. 500MB (bytes per second)")
    a.set_defaults(handler=cmd_promote)

    a = action("gc", "delete checkpoints a retention policy does not keep, and debris of dead writers",
               "tierio ckpt gc /lustre/run1 --keep last:3+every:1000 --dry-run")
    a.add_argument("url", metavar="URL", help=_URL)
    a.add_argument("--keep", required=True, metavar="POLICY", help="retention: last:N, every:K, within:48h, all; join with + or &")
    a.add_argument("--min-keep", type=int, default=3, help="never keep fewer than this many checkpoints (default 3)")
    a.add_argument("--temp-age", type=float, default=0.0, metavar="SECONDS",
                   help="remove leftovers of interrupted writes outside finished steps only once this old "
                        "(default 0: gc holds the tier's lease, so no live tierio writer owns them)")
    a.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    a.set_defaults(handler=cmd_gc)

    a = action("export", "write a checkpoint's model as a Hugging Face style safetensors directory",
               "tierio ckpt export /lustre/run1 ./hf-model --step 2000")
    a.add_argument("url", metavar="URL", help=_URL)
    a.add_argument("out", metavar="OUT", help="the model directory to write")
    a.add_argument("--step", type=int, help="the step (default: the latest)")
    a.add_argument("--prefix", help="export the tensors under this path of the state, e.g. model/ "
                                    "(default: model/ when the checkpoint has it; '' exports every tensor)")
    a.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB)")
    a.set_defaults(handler=cmd_export)

    a = action("unlock", "break a tier's write lease whose run is gone",
               "tierio ckpt unlock /lustre/run1\n\n"
               "A holder that is not provably dead (a process gone on this node) is watched for the lease\n"
               "expiry (TIERIO_LEASE_EXPIRES, default 120 s): a lease that stays unchanged is broken, one\n"
               "that is renewed meanwhile belongs to a live run and is left alone.")
    a.add_argument("url", metavar="URL", help=_URL)
    a.add_argument("--force", action="store_true",
                   help="break the lease at once, even if its holder looks alive (only when you know it is gone)")
    a.set_defaults(handler=cmd_unlock)


# -- helpers -------------------------------------------------------------------------------------


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


@contextmanager
def _store(url: str, *, create: bool = False) -> Iterator[Any]:
    """Open a tier; a local directory that does not exist is an error unless we write to it."""
    from tierio.storage import open_store

    store = open_store(url, create=create) if _is_local(url) else open_store(url)
    try:
        yield store
    finally:
        store.close()


def _latest(store: Any, url: str) -> int:
    from tierio.ckpt.steps.reader import committed_steps

    steps = committed_steps(store)
    if not steps:
        raise NotFoundError(f"no committed checkpoint in {url}; check the URL with 'tierio ckpt ls {url}'")
    return steps[-1]


def _manifest(store: Any, url: str, step: int):
    from tierio.ckpt.steps.reader import read_manifest
    from tierio.format.shard import manifest_key

    if not store.exists(manifest_key(step)):
        raise NotFoundError(f"step {step} has no committed checkpoint in {url}; 'tierio ckpt ls {url}' lists the steps there")
    return read_manifest(store, step)


def _summary(man: Any) -> dict[str, Any]:
    return {
        "step": man.step,
        "time": man.time,
        "world_size": man.world_size,
        "tensors": man.num_tensors,
        "bytes": man.total_bytes,
        "files": man.files,
    }


# -- ls ------------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    from tierio.ckpt import list_checkpoints
    from tierio.ckpt.ops import list_node_parts
    from tierio.ckpt.steps.reader import step_dirs
    from tierio.ckpt.steps.refs import reference_only

    with _store(args.url) as store:
        infos = list_checkpoints(store)
        nodes = list_node_parts(store, args.shared)  # a node-local tier: its steps' parts (it holds no manifest)
        dirs = step_dirs(store)
        held = reference_only(store, dirs)  # shards of deleted steps that incremental checkpoints refer to
        partial = sorted(set(dirs) - {i.step for i in infos} - held - {n.step for n in nodes})
        lease = _lease(store)
    rows = [i.to_dict() for i in infos if i.error is None]
    bad = [{"step": i.step, "problem": i.error} for i in infos if i.error is not None]
    result = {"url": args.url, "checkpoints": rows, "unreadable": bad, "uncommitted": partial,
              "referenced_only": sorted(held), "node_local": [n.to_dict() for n in nodes], "lease": lease}
    if args.json:
        print_json(result)
        return 0
    if nodes:
        _show_node_parts(args.url, result["node_local"], args.shared)
    elif not rows and not bad:
        say(f"no committed checkpoint in {args.url}")
    else:
        noted = any(r["reason"] for r in rows)  # an emergency save is marked; the column only when one is there
        print_table(f"Checkpoints in {args.url}", ["step", "time (UTC)", "ranks", "tensors", "size"] + ["saved for"] * noted,
                    [[r["step"], r["time"][:19].replace("T", " "), r["world_size"], "—" if r["tensors"] is None else r["tensors"],
                      human_bytes(r["bytes"])] + [r["reason"] or ""] * noted for r in rows])
    for b in bad:
        say(styled(f"step {b['step']}: unreadable manifest: {b['problem']}", "yellow"), err=True)
    if partial:
        say(f"{len(partial)} step director{'y' if len(partial) == 1 else 'ies'} without a manifest "
                  f"(uncommitted, never restored): {', '.join(map(str, partial[:10]))}"
                  + (" ..." if len(partial) > 10 else ""), err=True)
    if held:
        say(f"{len(held)} deleted step{'s' if len(held) > 1 else ''} whose shards later checkpoints still refer to "
                  f"(incremental): {', '.join(map(str, sorted(held)[:10]))}" + (" ..." if len(held) > 10 else ""), err=True)
    if lease is not None:
        say(f"write lease: {lease['holder']}" + (f" [stale: {lease['stale']}]" if lease["stale"] else ""), err=True)
    return 0


def _show_node_parts(url: str, parts: list[dict[str, Any]], shared: str | None) -> None:
    """A node-local tier's steps: node-local only until the shared tier holds their manifest."""
    where = {True: "committed (shared)", False: "node-local only", None: "node-local"}
    print_table(f"Steps on the node-local tier {url}", ["step", "ranks here", "size", "where", "saved for"],
                [[p["step"], f"{','.join(map(str, p['ranks']))} of {p['world_size']}", human_bytes(p["bytes"]),
                  where[p["committed"]], p["reason"] or ""] for p in parts if p["error"] is None])
    for p in parts:
        if p["error"] is not None:
            say(styled(f"step {p['step']}: unreadable record: {p['error']}", "yellow"), err=True)
    say("a node-local tier holds no manifest: a step restores from the nodes while every rank's part is on its "
        "node, and is committed once the shared tier holds its manifest"
        + ("" if shared else " (--shared URL marks which)"), err=True)


def _lease(store: Any) -> dict[str, Any] | None:
    """Who leases the tier (a run writing it), as ls shows it."""
    import time

    from tierio.ckpt.steps.lease import LeaseTiming, read_lease
    from tierio.errors import FormatError

    try:
        holder = read_lease(store)
    except FormatError as exc:
        return {"holder": f"unreadable ({exc})", "run": None, "stale": "unreadable"}
    if holder is None:
        return None
    now = time.time()
    return {"holder": holder.describe(now), "run": holder.run, "host": holder.host, "pid": holder.pid,
            "generation": holder.generation, "renewed_age_s": round(now - holder.renewed, 1),
            "stale": holder.hint(now, LeaseTiming.default())}


# -- inspect -------------------------------------------------------------------------------------


def _tree_rows(tree: Any, tensors: dict[str, Any], path: str = "", depth: int = 0) -> list[list[Any]]:
    """Top levels of the state tree with the tensor count and bytes below each node."""
    from tierio.format.statetree import tensor_refs

    rows: list[list[Any]] = []
    if isinstance(tree, dict) and not any(k.startswith("__") for k in tree):
        for k, v in tree.items():
            name = f"{path}/{k}" if path else str(k)  # "/" as in the tensor list (model/weight)
            refs = tensor_refs(v)
            if refs:
                nbytes = sum(tensors[r].nbytes for r in refs if r in tensors)
                rows.append([name, len(refs), human_bytes(nbytes)])
                if depth < 1 and isinstance(v, dict) and len(v) <= 12:
                    rows += _tree_rows(v, tensors, name, depth + 1)
            else:
                text = repr(v) if not isinstance(v, (dict, list)) else f"{type(v).__name__} ({len(v)} items)"
                rows.append([name, "-", text if len(text) <= 40 else text[:37] + "..."])
    return rows


def cmd_inspect(args: argparse.Namespace) -> int:
    from tierio.ckpt import inspect

    with _store(args.url) as store:
        step = args.step if args.step is not None else _latest(store, args.url)
        man = inspect(store, step, records=args.tensors or args.json)
    tensors = {name: t for r in man.ranks for name, t in r.tensors.items()}
    if args.json:
        doc = _summary(man)
        doc["ranks"] = [{"rank": r.rank, "file": r.file, "bytes": r.bytes, "tree": r.tree,
                         "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                                         "chunks": len(t.chunks)} for n, t in r.tensors.items()}}
                        for r in man.ranks]
        print_json(doc)
        return 0
    s = _summary(man)
    by_dtype: dict[str, list[int]] = {}
    for t in tensors.values():
        c = by_dtype.setdefault(t.dtype, [0, 0])
        c[0] += 1
        c[1] += t.nbytes
    print_table(f"Checkpoint step {step} in {args.url}", ["", "value"], [
        ["committed (UTC)", s["time"]], ["ranks", s["world_size"]], ["files", ", ".join(s["files"])],
        ["tensors", s["tensors"]], ["size", human_bytes(s["bytes"])],
        ["dtypes", ", ".join(f"{d} x{c[0]} ({human_bytes(c[1])})" for d, c in sorted(by_dtype.items()))],
    ])
    rank0 = man.ranks[0]
    print_table("State tree (rank 0)", ["key", "tensors", "size / value"], _tree_rows(rank0.tree, rank0.tensors))
    if args.tensors:
        rows = [[n, t.dtype, "x".join(map(str, t.shape)) or "scalar", human_bytes(t.nbytes), len(t.chunks)]
                for r in man.ranks for n, t in r.tensors.items()]
        print_table("Tensors", ["name", "dtype", "shape", "size", "chunks"], rows)
    return 0


# -- verify --------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from tierio.ckpt import verify
    from tierio.ckpt.steps.reader import step_dirs
    from tierio.ckpt.steps.refs import reference_only

    reports = []
    with _store(args.url) as store:
        if args.all:
            dirs = step_dirs(store)
            # committed or not: a directory without a manifest is flagged, unless it holds only shards
            # that committed (incremental) checkpoints refer to
            steps = sorted(set(dirs) - reference_only(store, dirs))
            if not steps:
                raise NotFoundError(f"no checkpoint in {args.url}")
        else:
            step = args.step if args.step is not None else _latest(store, args.url)
            steps = [step]
        with progress("verifying", len(steps), quiet=args.json) as advance:
            for step in steps:
                advance(0, f"step {step}")
                report = verify(store, step)
                if report.copies.get(store.url) == "absent":
                    raise NotFoundError(f"step {step} has no checkpoint in {args.url}")
                reports.append(report)
                advance()
    ok = all(r.ok for r in reports)
    if args.json:
        print_json({"url": args.url, "ok": ok, "steps": [r.to_dict() for r in reports]})
        return 0 if ok else 1
    print_table(f"Verification of {args.url}", ["step", "result", "bytes checked", "problems"],
                [[r.step, "ok" if r.ok else "BAD", human_bytes(r.bytes_checked), len(r.problems)] for r in reports])
    for r in reports:
        for p in r.problems[:20]:
            say(styled(f"step {r.step}", "red"), f": {p.file}" + (f" [{p.chunk}]" if p.chunk else "") + f": {p.message}",
                err=True)
    if not ok:
        say("a bad copy must not be restored from this tier; restore from another tier or an older step", err=True)
    return 0 if ok else 1


# -- promote -------------------------------------------------------------------------------------


def cmd_promote(args: argparse.Namespace) -> int:
    from tierio.ckpt import promote
    from tierio.ckpt.steps.lineage import same_copy
    from tierio.ckpt.steps.commit import read_manifest_bytes
    from tierio.ckpt.steps.reader import committed_steps
    from tierio.format.shard import manifest_key

    if args.step is not None and args.all:
        raise ConfigError("use either --step or --all, not both")
    rate = parse_size(args.bandwidth) if args.bandwidth else None
    if rate is not None and rate <= 0:
        raise ConfigError("--bandwidth must be positive, e.g. 500MB")
    done = []
    with _store(args.src) as src, _store(args.dst, create=True) as dst:
        if args.all:
            steps = [s for s in committed_steps(src) if not dst.exists(manifest_key(s))]
        else:
            steps = [args.step if args.step is not None else _latest(src, args.src)]
            _manifest(src, args.src, steps[0])
        with progress("promoting", len(steps), quiet=args.json) as advance:
            for step in steps:
                advance(0, f"step {step}")
                if same_copy(dst, step, read_manifest_bytes(src, step)):
                    done.append({"step": step, "bytes": 0, "seconds": 0.0, "skipped": "already committed on DST"})
                else:
                    stats = promote(src, dst, step, bandwidth=rate)
                    done.append({"step": step, "bytes": stats.bytes, "seconds": stats.seconds, "skipped": None})
                advance()
    if args.json:
        print_json({"src": args.src, "dst": args.dst, "promoted": done})
        return 0
    if not done:
        say(f"nothing to promote: {args.dst} already holds every checkpoint of {args.src}")
        return 0
    print_table(f"Promoted {args.src} -> {args.dst}", ["step", "size", "time", "rate"], [
        [d["step"], human_bytes(d["bytes"]), f"{d['seconds']:.2f} s" if not d["skipped"] else d["skipped"],
         fmt_rate(d["bytes"] / d["seconds"]) if d["seconds"] else "-"] for d in done])
    return 0


# -- gc ------------------------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace) -> int:
    from tierio.ckpt.ops import collect_garbage
    from tierio.ckpt.steps.retention import parse_retention

    policy = parse_retention(args.keep)
    if args.min_keep < 0:
        raise ConfigError("--min-keep must be >= 0")
    if args.temp_age < 0:
        raise ConfigError("--temp-age must be >= 0 seconds")
    with _store(args.url) as store:
        report = collect_garbage(store, policy, min_keep=args.min_keep, dry_run=args.dry_run, temp_grace=args.temp_age)
    doomed = [r.step for r in report.deleted]
    partial = [r.step for r in report.uncommitted]
    kept = next(iter(report.kept.values()), [])
    result = {"url": args.url, "policy": str(policy), "dry_run": args.dry_run, "deleted": doomed,
              "deleted_uncommitted": partial, "leftovers_removed": None if args.dry_run else report.leftovers,
              "kept": kept, "warnings": report.warnings, "problems": [s.reason for s in report.skipped]}
    if args.json:
        print_json(result)
        return 1 if report.skipped else 0
    # why fewer are deleted than the policy says comes first, not after the count it explains
    for w in report.warnings:
        say(styled("warning", "yellow"), f": {w}", err=True)
    sys.stderr.flush()
    verb = "would delete" if args.dry_run else "deleted"
    floor = (f" (--min-keep {args.min_keep}: never fewer than {args.min_keep})"
             if report.warnings and len(kept) <= args.min_keep else "")
    say(f"retention {policy} on {args.url}: {verb} {len(doomed)} checkpoint(s)"
              + (f" and {len(partial)} uncommitted director{'y' if len(partial) == 1 else 'ies'}" if partial else ""))
    if doomed:
        say(f"  {verb}: steps {', '.join(map(str, doomed))}")
    if report.leftovers:
        say(f"  removed {report.leftovers} leftover(s) of interrupted writes (temp files, uploads)")
    say(f"  kept: steps {', '.join(map(str, kept)) or 'none'}{floor}")
    for s in report.skipped:
        say(styled("error", "red"), f": {s.reason}", err=True)
    sys.stdout.flush()
    return 1 if report.skipped else 0


# -- export --------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from tierio.ckpt.export import export

    limit = parse_size(args.max_shard_size)
    if limit <= 0:
        raise ConfigError("--max-shard-size must be positive, e.g. 5GB")
    with _store(args.url) as store, progress("exporting", quiet=args.json):
        report = export(store, args.out, step=args.step, prefix=args.prefix, max_shard_bytes=int(limit))
    if args.json:
        print_json({"url": args.url, "step": report.step, "out": report.out, "tensors": report.tensors,
                    "bytes": report.bytes, "files": report.files})
        return 0
    say(f"exported step {report.step} of {args.url}: {report.tensors} tensors, {human_bytes(report.bytes)} "
                    f"in {len(report.files) - 1} file(s) and {report.files[-1]} -> {report.out}")
    return 0


# -- unlock --------------------------------------------------------------------------------------


def cmd_unlock(args: argparse.Namespace) -> int:
    from tierio.ckpt.ops import unlock

    with _store(args.url) as store:
        holder = unlock(store, force=args.force)
    if args.json:
        print_json({"url": args.url, "removed": None if holder is None else {"run": holder.run, "host": holder.host,
                                                                               "pid": holder.pid}})
        return 0
    if holder is None:
        say(f"{args.url} has no lease (or only an unreadable one, now removed)")
    else:
        say(f"removed the lease of run {holder.run} (host {holder.host}, pid {holder.pid}) from {args.url}")
    return 0
