"""A Lustre-shaped command runner: `lfs` and `lctl` answered the way a Lustre client answers them,
over a real directory tree that stands in for the Lustre mount.

No Lustre exists here. Layouts are kept the way Lustre keeps them for new files: a directory's default
layout is set with `lfs setstripe` and inherited below it; a path without one has the filesystem
default (stripe count 1, 1 MiB). A file reports the layout its directory has when asked (the tests
create files only after striping). `lfs df` and `lctl get_param` answer with
outputs recorded in the format real clients print (tests/data/doctor/lustre/)."""

from __future__ import annotations

import os
from pathlib import Path

from tierio.io.tools import ToolRun

DATA = Path(__file__).parent / "data" / "doctor" / "lustre"
DEFAULT_LAYOUT = (1, 1 << 20)


class FakeLustre:
    def __init__(self, mount: str | Path, df: str = "lfs_df_96osts.txt", df_inodes: str = "lfs_df_i_healthy.txt",
                 lctl: str = "lctl_stats_healthy.txt") -> None:
        self.mount = os.path.realpath(mount)
        self.outputs = {"df": (DATA / df).read_text(), "df -i": (DATA / df_inodes).read_text(),
                        "lctl": (DATA / lctl).read_text()}
        self.layouts: dict[str, tuple[int, int]] = {}   # directory -> (count, size) set by setstripe
        self.calls: list[list[str]] = []

    def _on_lustre(self, path: str) -> bool:
        real = os.path.realpath(path)
        return real == self.mount or real.startswith(self.mount + "/")

    def layout(self, path: str) -> tuple[int, int]:
        """What a file or directory created at ``path`` now gets: the nearest ancestor's default."""
        p = os.path.realpath(path)
        while True:
            if p in self.layouts:
                return self.layouts[p]
            if p == self.mount or p == "/":
                return DEFAULT_LAYOUT
            p = os.path.dirname(p)

    def __call__(self, argv: list[str]) -> ToolRun:
        self.calls.append(list(argv))
        tool, *args = argv
        if tool == "lctl":
            return ToolRun(self.outputs["lctl"])
        if tool != "lfs" or not args:
            return ToolRun(None, f"{tool} not found")
        path = args[-1]
        if not os.path.exists(path):
            return ToolRun(None, f"{' '.join(argv)} failed: {path}: No such file or directory")
        if not self._on_lustre(path):
            return ToolRun(None, f"{' '.join(argv)} failed: {path}: not on a Lustre filesystem")
        if args[0] == "df":
            return ToolRun(self.outputs["df -i" if "-i" in args else "df"])
        if args[0] == "getstripe":
            count, size = self.layout(path)
            return ToolRun(f"stripe_count:  {count} stripe_size:   {size} pattern:       raid0 stripe_offset: -1\n")
        if args[0] == "setstripe" and os.path.isdir(path):
            opts = dict(zip(args[1:-1:2], args[2:-1:2]))
            size = opts.get("-S", "1M")
            self.layouts[os.path.realpath(path)] = (int(opts.get("-c", "1")), _size(size))
            return ToolRun("")
        return ToolRun(None, f"{' '.join(argv)} failed: unsupported here")


def _size(text: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1].lower(), 1)
    return int(text.rstrip("kKmMgG")) * mult
