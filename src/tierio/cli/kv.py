"""`tierio kv`: look into an NVMe KV tier, and run the multi-user prefix-cache demo."""

from __future__ import annotations

from tierio.cli.output import print_json, print_table, progress
from tierio.cli.parsers import action_group, leaf
from tierio.units import human_bytes

EPILOG = """\
examples:
  tierio kv stats /nvme/kv                 what the tier holds: blocks, bytes, chains, damaged records
  tierio kv stats /nvme/kv --verify        also read every block back and check its xxh3
  tierio kv demo --dir /tmp/kv-demo        users sharing a system prompt, DRAM too small, resumed from NVMe
  tierio bench kv --json                   the KV cache against memcpy, fio and recompute
  tierio plan --preset llama3-70b --only kv   how much KV fits in HBM and on NVMe, and the fetch rule

How it works and what every figure means: docs/kv.md.
"""


def cmd_stats(args) -> int:
    from tierio.kv.inspect import inspect_tier

    r = inspect_tier(args.dir, verify=args.verify)
    if args.json:
        print_json(r.to_dict())
        return 1 if r.damaged else 0
    g, lay = r.geometry, r.layout
    rows = [
        ["layout", ", ".join(f"{k}={v}" for k, v in lay.items() if k != "order") or "-"],
        ["block / slot", f"{human_bytes(g.block_bytes)} / {human_bytes(g.slot_bytes)}"],
        ["slabs", f"{g.slabs} × {g.slots_per_slab} slots ({human_bytes(g.slab_bytes)} each)"],
        ["blocks", f"{r.blocks:,} of {g.nslots:,} slots ({r.blocks / g.nslots:.1%})" if g.nslots else "0"],
        ["bytes", f"{human_bytes(r.used_bytes)} of {human_bytes(r.capacity_bytes)}"],
        ["chains", f"{r.chains:,} (blocks whose parent is not in the tier)"],
        ["discarded records", f"{r.discarded}" + (f" ({', '.join(f'{k}: {v}' for k, v in r.reasons.items())})" if r.reasons else "")],
        ["in use by", f"pid {r.owner}" if r.owner else "no process"],
    ]
    if r.verified is not None:
        rows.append(["verified", f"{r.verified:,} blocks match their checksum, {len(r.damaged)} do not"])
    print_table(f"NVMe KV tier {r.directory}", ["", "value"], rows)
    return 1 if r.damaged else 0


def cmd_demo(args) -> int:
    from tierio.demo.kv import ChatDemo, run_demo

    with progress("kv demo: users taking turns", quiet=args.json):
        result = run_demo(ChatDemo(directory=args.dir, users=args.users, turns=args.turns,
                                   system_tokens=args.system_tokens, answer_tokens=args.answer_tokens,
                                   dram_blocks=args.dram_blocks))
    if args.json:
        print_json(result.to_dict())
        return 0
    print_table("tierio kv demo: users sharing a system prompt, multi-turn, DRAM too small for all",
                ["turn", "user", "prompt tokens", "from tierio", "dram / nvme blocks", "same tokens as without"],
                [[t.turn, t.user, t.prompt_tokens, t.cached_tokens, f"{t.dram_blocks} / {t.nvme_blocks}",
                  "yes" if t.identical else "NO"] for t in result.turns])
    for line in result.summary():
        print(line)
    return 0 if all(t.identical for t in result.turns) else 1


def register(sub) -> None:
    kv = action_group(sub, "kv", help="KV-cache tiering: inspect an NVMe tier, run the prefix-cache demo",
                      description="Inspect the NVMe tier of a tierio KV cache, or run the multi-user demo.", epilog=EPILOG)
    q = leaf(kv, "stats", help="what an NVMe KV tier holds (read-only; works while a server uses it)", epilog=EPILOG)
    q.add_argument("dir", metavar="DIR", help="the tier's directory (KVConfig.nvme_dir)")
    q.add_argument("--verify", action="store_true", help="read every block and check its checksum (exit 1 if any fails)")
    q.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    q.set_defaults(handler=cmd_stats)
    q = leaf(kv, "demo", help="users sharing a system prompt, evicted to NVMe, resumed after a restart", epilog=EPILOG)
    q.add_argument("--dir", default=None, help="NVMe tier directory (default: a temporary one, removed afterwards)")
    q.add_argument("--users", type=int, default=4, help="users (default 4)")
    q.add_argument("--turns", type=int, default=3, help="turns per user; the last one runs after a restart (default 3)")
    q.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length (default 512)")
    q.add_argument("--answer-tokens", type=int, default=16, help="tokens generated per turn (default 16)")
    q.add_argument("--dram-blocks", type=int, default=8, help="DRAM budget in blocks, small to force eviction (default 8)")
    q.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    q.set_defaults(handler=cmd_demo)
