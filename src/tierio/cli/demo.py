"""`tierio demo`: train, checkpoint to three tiers, lose the local disk, restore, resume bit-exact."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from tierio.cli.output import print_json, print_table, say, styled
from tierio.units import fmt_rate, human_bytes

EXAMPLES = """\
examples:
  tierio demo                          about a minute: ~280 MB checkpoints into ./tierio-demo/
  tierio demo --seconds 20             a shorter run
  tierio demo --quick --json           a tiny model in seconds, summary as JSON
  tierio demo --dir /mnt/nvme/demo     put the three tier directories elsewhere
  tierio demo --s3 's3://bucket/demo?endpoint=http://127.0.0.1:8333'
                                       archive tier on a real S3 endpoint (credentials from AWS_*)

what it does:
  1. trains a small GPT-style model on synthetic tokens on the CPU, checkpointing asynchronously
     (save() blocks only for the snapshot copy) into local-nvme/ -> shared-fs/ -> archive/
  2. measures a synchronous torch.save + fsync of the same state for comparison
  3. deletes local-nvme/ (the node lost its disk) and restores from the next tier
  4. resumes and checks that the result equals the uninterrupted run bit for bit (exit 1 if not)

afterwards:
  tierio ckpt ls ./tierio-demo/shared-fs        the checkpoints the demo left behind
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train, checkpoint asynchronously to 3 tiers, lose a disk, restore, resume bit-exact",
        description="Train a small GPT on CPU with asynchronous tiered checkpoints, simulate the loss of "
        "the node's local disk, restore from the next tier and prove the resumed run is bit-exact.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dir", default="./tierio-demo", help="where the tier directories go (default ./tierio-demo)")
    p.add_argument("--s3", metavar="URL", help="s3://bucket/prefix[?endpoint=...] for the archive tier")
    p.add_argument("--seconds", type=float, default=60.0, help="training time budget (default 60)")
    p.add_argument("--steps", type=int, help="train exactly this many steps instead of --seconds")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps (default: about 6 checkpoints)")
    p.add_argument("--quick", action="store_true", help="tiny model, 24 steps: finishes in seconds")
    p.add_argument("--threads", type=int, default=2, help="torch threads, fixed for determinism (default 2)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from tierio.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        directory=args.dir, s3=args.s3, seconds=args.seconds, steps=args.steps,
        save_every=args.save_every, threads=args.threads, seed=args.seed,
        preset="quick" if args.quick else "default",
    )
    if args.quick and args.steps is None:
        cfg.steps, cfg.save_every = 24, cfg.save_every or 5
    err = Console(stderr=True, highlight=False)
    with DemoProgress(err) as progress:
        report = run_demo(cfg, progress)
    data = report.to_dict()
    if args.json:
        print_json(data)
    else:
        print_summary(data)
    return 0 if report.bit_exact and not report.promotion_errors else 1


class DemoProgress:
    """A live progress bar on a terminal; a few plain lines when stderr is a file or a pipe."""

    def __init__(self, err: Console) -> None:
        self.err = err
        self.live = err.is_terminal
        self.bar: Progress | None = None
        self.task: Any = None
        self.by_steps = False
        self.total = 1.0
        self.last_line = -1

    def __enter__(self) -> DemoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def say(self, *parts: str | Text) -> None:
        """A line of plain text (paths from data are never read as markup) and ``styled`` pieces."""
        line = Text.assemble(*parts)
        (self.bar.console if self.bar is not None else self.err).print(line, overflow="fold")

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        getattr(self, f"on_{event}", lambda i: None)(info)

    def on_start(self, i: dict[str, Any]) -> None:
        params = f"{i['params'] / 1e6:.1f} M" if i["params"] >= 1e6 else f"{i['params']:,}"
        self.say(styled("tierio demo", "bold"), f": GPT with {params} parameters, "
                 f"~{human_bytes(i['state_bytes'])} per checkpoint")
        for name, url in zip(("local NVMe", "shared FS", "archive"), i["urls"]):
            self.say(f"  tier {name:<10} {url}")
        self.by_steps = i["steps"] is not None
        self.total = float(i["steps"] if self.by_steps else i["seconds"])
        if self.live:
            self.bar = Progress(
                TextColumn("[progress.description]{task.description}"), BarColumn(),
                TextColumn("step {task.fields[step]:>5}  loss {task.fields[loss]:>7}  {task.fields[note]}"),
                TimeElapsedColumn(), console=self.err, transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("training", total=self.total, step=0, loss="-", note="")

    def on_step(self, i: dict[str, Any]) -> None:
        done = i["step"] if self.by_steps else i["elapsed"]
        if self.bar is not None:
            self.bar.update(self.task, completed=min(done, self.total), step=i["step"], loss=f"{i['loss']:.3f}")
        else:
            tenth = int(10 * done / self.total) if self.total else 10
            if tenth > self.last_line:
                self.last_line = tenth
                self.say(f"  step {i['step']:>5}  loss {i['loss']:.3f}  ({i['elapsed']:.0f} s)")

    def on_save(self, i: dict[str, Any]) -> None:
        note = f"checkpoint {i['step']}: blocked {i['blocking_s'] * 1e3:.0f} ms"
        if i.get("first"):
            note += " (first save: allocates staging buffers)"
        if self.bar is not None:
            self.bar.update(self.task, note=note)
        else:
            self.say(f"  {note}")

    def on_drain(self, i: dict[str, Any]) -> None:
        self._stop()
        self.say("waiting for the last promotions to reach every tier ...")

    def on_sync_save(self, i: dict[str, Any]) -> None:
        self.say(f"measuring a synchronous torch.save + fsync of the same {human_bytes(i['state_bytes'])} ...")

    def on_disk_lost(self, i: dict[str, Any]) -> None:
        self.say(styled("simulated failure", "bold red"), f": the node's local disk is gone (deleted {i['path']})")

    def on_restored(self, i: dict[str, Any]) -> None:
        self.say(f"restored step {i['step']} from {i['from']} in {i['seconds']:.2f} s; resuming ...")


def print_summary(d: dict[str, Any]) -> None:
    print_table("Training", ["", "value"], [
        ["model parameters", f"{d['model_params'] / 1e6:.1f} M" if d["model_params"] >= 1e6 else f"{d['model_params']:,}"],
        ["checkpoint size", human_bytes(d["state_bytes"])],
        ["steps", d["steps"]],
        ["step time (mean / median)", f"{d['step_s_mean'] * 1e3:.0f} ms / {d['step_s_p50'] * 1e3:.0f} ms"],
        ["loss (first -> last)", f"{d['first_loss']:.3f} -> {d['last_loss']:.3f}"],
    ])
    ratio = d.get("sync_vs_async_blocking")
    print_table("Checkpoint cost to training", ["", "value"], [
        ["checkpoints", f"{d['saves']} (every {d['save_every']} steps)"],
        ["tierio save() blocking, first save", f"{d['blocking_s_first'] * 1e3:.1f} ms (allocates staging)"],
        ["tierio save() blocking, later (mean / max)",
         f"{d['blocking_s_mean'] * 1e3:.1f} ms / {d['blocking_s_max'] * 1e3:.1f} ms"],
        ["torch.save + fsync, blocking", f"{d['sync_save_s'] * 1e3:.1f} ms"],
        ["synchronous / tierio", f"{ratio:.1f}x" if ratio else "-"],
        ["background persist to local tier (mean)", f"{d['persist_s_mean']:.2f} s"],
        ["background promotion to slower tiers (mean)", f"{d['promote_s_mean']:.2f} s"],
    ])
    rows = []
    for t in d["tiers"]:
        bw = t.get("bandwidth")
        kind = "s3" if t["url"].startswith("s3://") else "dir"
        rows.append([f"{t['tier']} {t['role']} ({kind})", t["checkpoints"], human_bytes(t["bytes_held"]),
                     human_bytes(t["bytes_written"]) if t.get("bytes_written") is not None else "-",
                     fmt_rate(bw) if bw else "-"])
    print_table("Tiers (before the failure)", ["tier", "checkpoints", "held", "written", "write rate"], rows)
    bw = d["state_bytes"] / d["restore_s"] if d["restore_s"] else 0
    print_table("Recovery", ["", "value"], [
        ["lost", "tier 2 local-nvme (deleted)"],
        ["restored from", next((f"tier {t['tier']} {t['role']}" for t in d["tiers"] if t["url"] == d["restored_from"]),
                               d["restored_from"])],
        ["restored step", d["resumed_from"]],
        ["restore time", f"{d['restore_s']:.2f} s ({fmt_rate(bw)})"],
        ["restore rate / local-nvme write rate", f"{d['restore_vs_tier0_write']:.2f}" if d.get("restore_vs_tier0_write") else "-"],
        ["steps redone", d["steps"] - d["resumed_from"]],
        ["bit-exact with the uninterrupted run", "yes" if d["bit_exact"] else "NO"],
    ])
    if d["bit_exact"]:
        say(styled("OK", "green"), ": the resumed run matches the uninterrupted run bit for bit "
                  "(every parameter, optimizer moment, RNG state and loss).")
    else:
        say(styled("FAILED", "red"), ": the resumed run differs from the uninterrupted run:")
        for m in d["mismatches"][:10]:
            say(f"  {m}")
    for e in d.get("promotion_errors", []):
        say(styled("promotion failed", "red"), f": {e}")
    shared = next((t["url"] for t in d["tiers"] if t["role"] == "shared-fs"), None)
    if shared:
        say(f"inspect the checkpoints: tierio ckpt ls {shared}")
    sys.stdout.flush()
