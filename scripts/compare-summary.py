#!/usr/bin/env python3
"""The table of a scripts/compare-commits.sh run: every ratio of every benchmark, base against head.

Usage: python3 scripts/compare-summary.py OUT [--json]

A ratio is tierio's figure against its peer or the disk's limit measured in the same run (fio,
torch.save, DCP, memcpy), so it carries the disk's state of the moment with it; the table gives
each side's median over the rounds and head against base. Higher ratios are better except the
memory overheads (LOWER_IS_BETTER); "change" is positive
where head is better, whichever way the ratio runs."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LOWER_IS_BETTER = {"rss_overhead", "rss_overhead_excluding_interpreter"}


def load(out: Path) -> dict[str, dict[str, dict[str, list[float]]]]:
    """bench -> ratio -> side -> values over the rounds."""
    got: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for f in sorted(out.glob("*.json")):
        bench, side, _round = f.stem.split(".")
        doc = json.loads(f.read_text())
        for group in ("ratios", "extra_ratios"):
            for k, v in (doc.get(group) or {}).items():
                if isinstance(v, (int, float)) and v == v:  # NaN: a peer that did not run
                    got[bench][k][side].append(float(v))
    return got


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    got = load(Path(argv[0]))
    rows = []
    for bench, ratios in sorted(got.items()):
        for name, sides in sorted(ratios.items()):
            if not sides.get("base") or not sides.get("head"):
                continue
            b, h = statistics.median(sides["base"]), statistics.median(sides["head"])
            lower = name in LOWER_IS_BETTER
            change = (b / h if lower else h / b) - 1 if b and h else float("nan")
            rows.append({"bench": bench, "ratio": name, "base": b, "head": h, "change": change,
                         "rounds": min(len(sides["base"]), len(sides["head"])), "lower_is_better": lower})
    if "--json" in argv:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'bench':8} {'ratio':44} {'base':>9} {'head':>9} {'change':>8}")
    for r in rows:
        print(f"{r['bench']:8} {r['ratio']:44} {r['base']:9.3f} {r['head']:9.3f} {r['change']:+8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
