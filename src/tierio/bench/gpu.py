"""`python -m tierio.bench.gpu`: the accelerator paths measured on one CUDA machine, as JSON.

Each part sets tierio against the plainest way of moving the same bytes on the same machine, in
the same run; rounds alternate the sides and each keeps its best (the first round warms up).

* ``d2h``: the snapshot copy of a save (the ``Stager``: device tensors copied on its side stream
  into a pinned staging buffer) against one cudaMemcpy of the same bytes (a flat device tensor
  copied into the same pinned buffer), and against the PCIe link ``nvidia-smi`` reports.
* ``save``: what ``CheckpointManager.save`` blocks for with the state on the GPU (side-stream
  staging; with ``overlap=True`` also the wait at the next update) against a synchronous copy of the
  state to the host (``.cpu()`` per tensor) and one cudaMemcpy of it (from ``d2h``).
* ``weights``: a safetensors file loaded to the GPU through GPUDirect Storage (where kvikio works;
  the mode that ran is named), through the pinned bounce ring, and by
  ``safetensors.torch.load_file(device="cuda")``; the page cache dropped before each load.
* ``kv``: the KV device tier's get and put against device-to-device ``copy_`` of the same bytes.
* ``nccl``: 2 processes over NCCL save a sharded state and restore it resharded (2+ GPUs only).

Targets (issue 31): snapshot >= 0.8x cudaMemcpy; save() blocking <= 1.2x one cudaMemcpy of the
state; GPU load >= 1.5x safetensors, cold; GDS >= the ring where GDS is not in compatibility mode.
Exit status: 0 measured; 77 without CUDA (nothing to measure); 1 when a part failed (its error in
the JSON). ``--table FILE`` prints the figures of a result file as a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from tierio.bench import common
from tierio.units import parse_size

PARTS = ("d2h", "save", "weights", "kv", "nccl")
SKIP = 77  # the status gpu-check.sh reads as "not run here"
TARGETS = {
    "d2h_snapshot_vs_memcpy": (">=", 0.8),
    "save_blocking_vs_memcpy": ("<=", 1.2),
    "load_vs_safetensors": (">=", 1.5),
    "gds_vs_ring": (">=", 1.0),
}
# PCIe: GT/s per lane by generation, and the share of it that carries data (line encoding)
PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
PCIE_ENCODING = {1: 0.8, 2: 0.8, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tierio.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gpu-bench.json (then stdout has the table; without it, the JSON)")
    p.add_argument("--dir", help="work folder for the weight file and checkpoints (default: a temporary one)")
    p.add_argument("--size", default="2GiB", help="bytes of the state that d2h and save copy (default 2GiB)")
    p.add_argument("--weights-size", default="2GiB", help="bytes of the weight file (default 2GiB)")
    p.add_argument("--kv-size", default="1GiB", help="bytes of KV blocks moved (default 1GiB)")
    p.add_argument("--nccl-size", default="1GiB", help="bytes of the 2-rank state (default 1GiB)")
    p.add_argument("--tensors", type=int, default=32, help="tensors in the state (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per comparison (default 3)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--table", metavar="FILE", help="print the figures of a gpu-bench.json and exit")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        p.error(f"--parts: unknown {unknown or 'empty list'}; choose from {','.join(PARTS)}")
    args.parts = parts
    if args.rounds < 1 or args.tensors < 1:
        p.error("--rounds and --tensors must be at least 1")
    for name in ("size", "weights_size", "kv_size", "nccl_size"):
        try:
            setattr(args, name, parse_size(getattr(args, name)))
        except Exception as exc:  # a typed tierio error or ValueError: either is a usage error here
            p.error(f"--{name.replace('_', '-')}: {exc}")
    return args


def cuda_missing() -> str | None:
    """Why nothing can be measured here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available: no GPU path to measure on this machine"
    return None


def pcie_link() -> dict[str, Any]:
    """The GPU's PCIe link as nvidia-smi reports it, and its theoretical GB/s per direction."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"skipped": "nvidia-smi is not installed"}
    fields = "pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max,name"
    try:
        out = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        gen, width, gen_max, width_max, name = [x.strip() for x in out.splitlines()[0].split(",")]
        link = {"gpu": name, "gen": int(gen), "width": int(width), "gen_max": int(gen_max), "width_max": int(width_max)}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"skipped": f"nvidia-smi gave no PCIe link ({exc})"}
    g, w = link["gen_max"], link["width_max"]  # an idle link runs slower: its maximum is what a copy gets
    if g in PCIE_GTS:
        link["bytes_per_s"] = PCIE_GTS[g] * 1e9 * PCIE_ENCODING[g] * w / 8
    return link


def best_of(runs: dict[str, Any], rounds: int, before: Any = None) -> dict[str, float]:
    """Best seconds per side over ``rounds`` alternated rounds after one warm-up round."""
    samples = common.alternate(runs, rounds + 1, before)
    return {n: min(s[1:]) for n, s in samples.items()}


def synced(fn: Any) -> Any:
    """``fn`` timed from an idle device to its last kernel's end."""
    import torch

    def run() -> float:
        torch.cuda.synchronize()
        _, seconds = common.timed(lambda: (fn(), torch.cuda.synchronize()))
        return seconds
    return run


# -- d2h and save -------------------------------------------------------------------------------
def device_state(size: int, tensors: int) -> dict[str, Any]:
    from tierio.bench.state import make_state

    state = make_state(size, tensors)
    state["tensors"] = {k: v.cuda() for k, v in state["tensors"].items()}
    return state


def bench_d2h(state: dict[str, Any], rounds: int) -> dict[str, Any]:
    import torch

    from tierio.ckpt.saving.stage import Stager
    from tierio.format.shard import plan_shard
    from tierio.io.buffers import HostBuffer

    tensors = state["tensors"]
    layout = plan_shard(tensors)
    buf = HostBuffer(layout.total_bytes)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = buf.tensor()[:nbytes]
    stager = Stager()
    best = best_of({"snapshot": synced(lambda: stager.stage(layout, tensors, buf)),
                    "memcpy": synced(lambda: pinned.copy_(flat, non_blocking=True))}, rounds)
    stager.stage(layout, tensors, buf)
    off = layout.header.data_offset
    for name, t in tensors.items():  # the staged bytes are the tensors' bytes
        b, e = layout.header.tensors[name].begin + off, layout.header.tensors[name].end + off
        if not torch.equal(buf.tensor()[b:e], t.reshape(-1).view(torch.uint8).cpu()):
            raise AssertionError(f"the snapshot of {name} differs from the device tensor")
    link = pcie_link()
    out = {"bytes": nbytes, "pinned": buf.pinned, "snapshot_s": best["snapshot"], "memcpy_s": best["memcpy"],
           "snapshot_bytes_per_s": nbytes / best["snapshot"], "memcpy_bytes_per_s": nbytes / best["memcpy"], "pcie": link}
    out["ratios"] = {"d2h_snapshot_vs_memcpy": common.ratio(best["memcpy"], best["snapshot"])}
    if "bytes_per_s" in link:
        out["pcie_bytes_per_s"] = link["bytes_per_s"]
        out["ratios"]["d2h_snapshot_vs_pcie"] = common.ratio(out["snapshot_bytes_per_s"], link["bytes_per_s"])
        out["ratios"]["d2h_memcpy_vs_pcie"] = common.ratio(out["memcpy_bytes_per_s"], link["bytes_per_s"])
    return out


def bench_save(state: dict[str, Any], work: Path, rounds: int, memcpy_s: float | None) -> dict[str, Any]:
    """Blocking seconds of save() (steady state: the staging buffers exist), with and without overlap."""
    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    out: dict[str, Any] = {}
    for overlap in (False, True):
        key = "overlap" if overlap else "side_stream"
        blocks, waits = [], []
        with CheckpointManager([Tier(str(work / key), retention=KeepLast(1))], min_keep=1, overlap=overlap) as mgr:
            for step in range(1, rounds + 2):
                state["step"] = step
                h, seconds = common.timed(lambda: mgr.save(step, state))
                _, wait = common.timed(mgr.before_update)  # overlap: the copies still running; else nothing
                blocks.append(seconds)
                waits.append(wait)
                h.wait()
        out[f"{key}_save_s"] = min(blocks[1:])
        out[f"{key}_update_wait_s"] = min(waits[1:])
        shutil.rmtree(work / key, ignore_errors=True)
    out["sync_copy_s"] = best_of({"sync": synced(lambda: {k: v.cpu() for k, v in state["tensors"].items()})},
                                 rounds)["sync"]
    out["ratios"] = {"save_blocking_vs_sync_copy": common.ratio(out["side_stream_save_s"], out["sync_copy_s"])}
    if memcpy_s:
        out["ratios"]["save_blocking_vs_memcpy"] = common.ratio(out["side_stream_save_s"], memcpy_s)
    return out


def bench_kv(size: int, rounds: int) -> dict[str, Any]:
    from tierio.bench.kv import IO_LAYOUT, bench_device
    from tierio.kv import BlockLayout

    res = bench_device(size, BlockLayout(**IO_LAYOUT, tokens=256), rounds)
    res["ratios"] = {"kv_device_get_vs_copy": common.ratio(res["memcpy_seconds"], res["get_seconds"]),
                     "kv_device_put_vs_copy": common.ratio(res["memcpy_seconds"], res["put_seconds"])}
    return res


# -- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tierio.bench import gpu_loads

    log = common.logger("gpu")
    work = common.work_dir(args.dir, "gpu")
    res: dict[str, Any] = {"bench": "gpu", "machine": {**common.machine_facts(), "gpus": torch.cuda.device_count(),
                           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}}
    state = None
    try:
        for part in args.parts:
            log(part)
            try:
                if part in ("d2h", "save") and state is None:
                    state = device_state(args.size, args.tensors)
                if part == "d2h":
                    res[part] = bench_d2h(state, args.rounds)
                elif part == "save":
                    res[part] = bench_save(state, work, args.rounds, res.get("d2h", {}).get("memcpy_s"))
                elif part == "weights":
                    res[part] = gpu_loads.bench_weights(args.weights_size, work, args.rounds)
                elif part == "kv":
                    res[part] = bench_kv(args.kv_size, args.rounds)
                else:
                    res[part] = gpu_loads.bench_nccl(args.nccl_size, work)
            except Exception as exc:  # one part failing must not hide the others' figures
                res[part] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                log(f"{part} failed: {exc}")
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {k: v for part in PARTS for k, v in res.get(part, {}).get("ratios", {}).items()}
    res["ratios"] = ratios
    res["targets_met"] = common.check_targets(ratios, TARGETS)
    return res


def table(res: dict[str, Any]) -> list[str]:
    """One line per part: its figures, ratios and targets, or why it did not run."""
    lines = [f"{'figure':<32} {'value':>10}  target"]
    for part in PARTS:
        r = res.get(part)
        if r is None:
            continue
        if "error" in r or "skipped" in r:
            lines.append(f"{part:<32} {'FAILED' if 'error' in r else 'skipped':>10}  {r.get('error') or r['skipped']}")
            continue
        for name, value in r.get("ratios", {}).items():
            op, goal = TARGETS.get(name, ("", ""))
            met = res.get("targets_met", {}).get(name)
            verdict = "" if met is None else (" met" if met else " MISSED")
            lines.append(f"{name:<32} {value:>10}  {op}{goal}{verdict}")
        for name, value in r.items():
            if name.endswith("bytes_per_s") and isinstance(value, float):
                lines.append(f"{part + '.' + name.replace('bytes_per_s', 'GB/s'):<32} {value / 1e9:>10.2f}")
            elif isinstance(value, dict) and "skipped" in value:
                lines.append(f"{part + '.' + name:<32} {'skipped':>10}  {value['skipped']}")
        if "gds_compat_mode" in r:
            lines.append(f"{'weights.gds_mode':<32} {'compat' if r['gds_compat_mode'] else 'GDS':>10}  {r.get('gds_note', '')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.table:
        print("\n".join(table(json.loads(Path(args.table).read_text()))))
        return 0
    why = cuda_missing()
    if why is not None:
        print(why, file=sys.stderr)
        return SKIP
    res = run(args)
    text = json.dumps(res, indent=1, default=str)
    if args.out:  # the file has the figures; the output ends with where it is
        out = Path(args.out) / "gpu-bench.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print("\n".join(table(res)) + f"\nfigures in {out}")
    else:
        print(text)
    return 1 if any(isinstance(res.get(p), dict) and "error" in res[p] for p in PARTS) else 0


if __name__ == "__main__":
    sys.exit(main())
