"""Lustre layouts: reading them (`lfs getstripe`, `lfs df`) and giving a directory a wide one (`lfs setstripe`).

Every `lfs` call goes through a ``CommandRunner`` (``tierio.io.tools``), so the same code runs
against a real Lustre client or against recorded outputs. A directory's default layout is inherited
by the files and subdirectories created in it later, which is why striping the directory a tier or a
dataset is written to is enough; files already there keep their layout (``lfs migrate`` rewrites them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tierio.errors import ConfigError
from tierio.io.tools import CommandRunner, run_tool
from tierio.options import Options
from tierio.stats import Stats
from tierio.units import MiB, human_bytes

STRIPE_SIZE_BYTES = 4 * MiB   # the stripe size advised for checkpoint and dataset directories
ALL_OSTS = -1


# ---- lfs getstripe ----------------------------------------------------------------------------

@dataclass
class StripeLayout:
    """Stripe layout of one file or directory default, from `lfs getstripe`.

    ``stripe_count`` is the count that governs the bulk of the data: the last component of a
    composite (PFL) layout. -1 means all OSTs; 0 means the filesystem default (usually 1).
    """

    path: str
    is_dir: bool
    stripe_count: int
    stripe_size: int | None = None
    component_counts: list[int] = field(default_factory=list)


def parse_getstripe(text: str, default_path: str = "") -> list[StripeLayout]:
    """Layouts from `lfs getstripe [-d|-R] PATH...` output (plain and composite layouts)."""
    layouts: list[StripeLayout] = []
    path, counts, sizes, is_dir = default_path, [], [], False

    def flush() -> None:
        if counts:
            layouts.append(StripeLayout(path, is_dir, counts[-1], sizes[-1] if sizes else None, list(counts)))

    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw[:1] == "/" or (raw[:1] not in (" ", "\t") and ":" not in line and not line[0].isdigit()):
            flush()
            path, counts, sizes, is_dir = line.rstrip("/") or "/", [], [], False
            continue
        for key, value in re.findall(r"(\w+):\s*(-?\d+)", line):
            if key in ("stripe_count", "lmm_stripe_count"):
                counts.append(int(value))
                if key == "stripe_count":
                    is_dir = True  # `stripe_count: N stripe_size: ...` on one line: a directory default
            elif key in ("stripe_size", "lmm_stripe_size"):
                sizes.append(int(value))
    flush()
    return layouts


# ---- lfs df [-i] ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TargetUsage:
    """One MDT or OST row of `lfs df` (bytes) or `lfs df -i` (inodes/objects)."""

    name: str        # e.g. "scratch-OST0007_UUID"
    kind: str        # "MDT" or "OST"
    total: int
    used: int
    avail: int

    @property
    def used_fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


_DF_ROW = re.compile(r"^(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+%\s+\S*\[(MDT|OST):\d+\]")


def parse_lfs_df(text: str, inodes: bool = False) -> list[TargetUsage]:
    """Targets from `lfs df PATH` (1K blocks, given here in bytes) or `lfs df -i PATH` (inode counts).

    Inactive or unreachable targets print no numbers and are left out; so is the summary line.
    """
    scale = 1 if inodes else 1024
    out = []
    for line in text.splitlines():
        m = _DF_ROW.match(line.strip())
        if m:
            name, total, used, avail, kind = m.groups()
            out.append(TargetUsage(name, kind, int(total) * scale, int(used) * scale, int(avail) * scale))
    return out


# ---- lfs setstripe ----------------------------------------------------------------------------

@dataclass(frozen=True)
class StripeOptions(Options):
    """The layout given to a directory tierio creates on Lustre: ``count`` -1 = every OST.

    ``runner`` runs `lfs`; a recorded cluster's outputs can stand in for it."""

    count: int = ALL_OSTS
    size_bytes: int | str = STRIPE_SIZE_BYTES
    runner: CommandRunner = run_tool


def stripe_options(stripe: str | StripeOptions | None) -> StripeOptions | None:
    """``"auto"`` → the default layout (applied where the directory is on Lustre); ``"off"``/None → none."""
    if stripe is None or stripe == "off":
        return None
    if stripe == "auto":
        return StripeOptions()
    if isinstance(stripe, StripeOptions):
        return stripe
    raise ConfigError(f"stripe={stripe!r}: give \"auto\" (stripe Lustre directories over every OST, 4 MiB), "
                      "\"off\", or a StripeOptions")


@dataclass
class StripeApplied(Stats):
    """What striping a directory did: ``applied`` only when `lfs setstripe` ran and succeeded."""

    directory: str
    lustre: bool = False
    applied: bool = False
    count: int | None = None
    size_bytes: int | None = None
    osts: int | None = None
    command: str = ""
    reason: str = ""     # why nothing was applied, or what was kept

    def line(self) -> str:
        if self.applied:
            return f"striped {self.directory}: {self.command}"
        return f"stripe of {self.directory} left as is: {self.reason}"


def _size_arg(size_bytes: int) -> str:
    return f"{size_bytes // MiB}M" if size_bytes % MiB == 0 else str(size_bytes)


def apply_stripe(directory: str, options: StripeOptions | None = None) -> StripeApplied:
    """Give ``directory`` (which exists) the layout of ``options`` if it is on Lustre and narrower.

    A directory already striped over every OST with at least that stripe size is kept as it is (an
    operator's wider choice wins). Never raises: a failure is the report's reason.
    """
    opts = options or StripeOptions()
    run, size = opts.runner, int(opts.size_bytes)
    got = run(["lfs", "getstripe", "-d", directory])
    df = run(["lfs", "df", directory]) if got.output is not None else got
    if got.output is None or df.output is None:  # either refuses a directory that is not on Lustre
        return StripeApplied(directory, reason=f"not on Lustre ({df.reason or got.reason})")
    current = next(iter(parse_getstripe(got.output, directory)), None)
    osts = sum(t.kind == "OST" for t in parse_lfs_df(df.output)) or None
    report = StripeApplied(directory, lustre=True, osts=osts)
    if current is not None and _wide_enough(current, opts.count, size, osts):
        report.count, report.size_bytes = current.stripe_count, current.stripe_size
        report.reason = (f"already striped over {_count_text(current.stripe_count, osts)} "
                         f"at {human_bytes(current.stripe_size or 0)}")
        return report
    argv = ["lfs", "setstripe", "-c", str(opts.count), "-S", _size_arg(size), directory]
    done = run(argv)
    report.command = " ".join(argv)
    if done.output is None:
        report.reason = done.reason
        return report
    report.applied, report.count, report.size_bytes = True, opts.count, size
    return report


def _wide_enough(layout: StripeLayout, count: int, size: int, osts: int | None) -> bool:
    want = osts if count == ALL_OSTS else count
    wide = layout.stripe_count == ALL_OSTS or (want is not None and layout.stripe_count >= want)
    return wide and (layout.stripe_size or 0) >= size


def _count_text(count: int, osts: int | None) -> str:
    if count == ALL_OSTS:
        return f"all {osts} OSTs" if osts else "all OSTs"
    return f"{count} of {osts} OSTs" if osts else f"{count} OSTs"
