"""The demo: train, checkpoint asynchronously into three tiers, lose the local disk, restore from the
next tier, resume, and prove the resumed run is bit-for-bit the uninterrupted one.

    from tierio.demo import DemoConfig, run_demo
    report = run_demo(DemoConfig(directory="./tierio-demo", seconds=60))
    assert report.bit_exact

Timeline of one run:

1. train steps 1..T with a checkpoint every ``save_every`` steps (never at T itself), each saved
   with ``CheckpointManager.save`` (the step blocks only for the snapshot copy);
2. keep a fingerprint (xxh3 of every tensor) and the losses of this uninterrupted run;
3. measure one synchronous ``torch.save`` + fsync of the same state, for comparison;
4. delete the node-local tier ("the node's NVMe is gone"); a replacement trainer, initialised with
   a different seed, restores the newest checkpoint K < T from the next tier;
5. retrain K+1..T and compare every tensor of the final state and every loss with step 2.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse, urlunparse

import torch

from tierio.bench.common import timed_torch_save
from tierio.demo.data import markov_tokens
from tierio.demo.model import GPTConfig
from tierio.demo.train import TrainConfig, Trainer
from tierio.errors import ConfigError

MARKER = ".tierio-demo"  # marks a directory the demo created, so a rerun may clear it
TIER_NAMES = ("local-nvme", "shared-fs", "archive")

PRESETS: dict[str, GPTConfig] = {
    # ~23 M parameters: fp32 weights + AdamW moments make a ~280 MB checkpoint.
    "default": GPTConfig(vocab=8192, seq_len=64, d_model=512, n_layer=6, n_head=8),
    # A few hundred kB: fast enough for the test suite.
    "quick": GPTConfig(vocab=256, seq_len=16, d_model=32, n_layer=2, n_head=2),
}


@dataclass
class DemoConfig:
    directory: str | Path = "./tierio-demo"
    s3: str | None = None  # an s3:// URL for the archive tier instead of a local directory
    seconds: float = 60.0  # training time budget, used when ``steps`` is None
    steps: int | None = None
    save_every: int | None = None  # None: about six checkpoints over the run
    preset: str = "default"
    threads: int = 2
    seed: int = 0
    # Test hooks that break the resume on purpose, to prove the bit-exact check can fail:
    # "skip-rng" (do not restore the RNG state), "skip-data" (do not restore the data position),
    # "perturb" (change one restored weight by 0.01).
    _fault: str | None = None


@dataclass
class SaveRecord:
    step: int
    blocking_s: float
    persisted_at: float | None = None
    promoted_at: float | None = None
    started_at: float = 0.0


@dataclass
class DemoReport:
    bit_exact: bool
    steps: int
    resumed_from: int
    restored_from: str
    restore_s: float
    state_bytes: int
    model_params: int
    train_s: float
    step_s_mean: float
    step_s_p50: float
    saves: int
    save_every: int
    blocking_s_first: float  # the first save allocates and faults the staging buffers
    blocking_s_mean: float  # later saves (steady state)
    blocking_s_max: float
    sync_save_s: float
    persist_s_mean: float
    promote_s_mean: float
    first_loss: float
    last_loss: float
    tiers: list[dict[str, Any]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    promotion_errors: list[str] = field(default_factory=list)
    directory: str = ""
    manager_stats: dict[str, Any] = field(default_factory=dict)
    restore: dict[str, Any] = field(default_factory=dict)  # the restoring manager's stats()["restore"]

    @property
    def restore_bytes_per_s(self) -> float:
        return self.state_bytes / self.restore_s if self.restore_s else 0.0

    @property
    def restore_vs_tier0_write(self) -> float | None:
        """Restore rate over the rate the first tier was written at (the same disk's write speed)."""
        bw = self.tiers[0].get("bandwidth") if self.tiers else None
        return self.restore_bytes_per_s / bw if bw else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sync_vs_async_blocking"] = self.sync_save_s / self.blocking_s_mean if self.blocking_s_mean else None
        d["restore_bytes_per_s"] = self.restore_bytes_per_s
        d["restore_gb_per_s"] = self.restore_bytes_per_s / 1e9
        d["restore_vs_tier0_write"] = self.restore_vs_tier0_write
        return d


Progress = Callable[[str, dict[str, Any]], None]


def _quiet(event: str, info: dict[str, Any]) -> None:
    pass


# -- tiers ---------------------------------------------------------------------------------------


def _prepare_directory(directory: Path) -> None:
    if directory.exists() and any(directory.iterdir()) and not (directory / MARKER).exists():
        raise ConfigError(
            f"{directory} exists and was not created by 'tierio demo'; "
            "choose an empty or new directory with --dir"
        )
    for name in TIER_NAMES:
        shutil.rmtree(directory / name, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text("created by 'tierio demo'; safe to delete\n")


def _s3_run_url(url: str) -> str:
    """A fresh key prefix under the given S3 URL, so earlier runs' checkpoints are not restored."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc:
        raise ConfigError(f"--s3 needs an s3://bucket/prefix URL, got {url!r}")
    path = u.path.rstrip("/") + f"/tierio-demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    return urlunparse(u._replace(path=path))


def _tier_urls(directory: Path, s3: str | None) -> list[str]:
    urls = [(directory / n).resolve().as_uri() for n in TIER_NAMES]
    if s3:
        urls[2] = _s3_run_url(s3)
    return urls


def _make_tiers(urls: list[str], save_every: int):
    from tierio.ckpt import KeepEvery, KeepLast, Tier

    # Local NVMe holds the newest two; the shared FS the newest three (the recovery tier);
    # the archive every other checkpoint.
    return [
        Tier(urls[0], retention=KeepLast(2)),
        Tier(urls[1], retention=KeepLast(3)),
        Tier(urls[2], retention=KeepEvery(2 * save_every)),
    ]


def _preflight(urls: list[str]) -> None:
    """Fail before training when a tier cannot be reached (missing bucket, dead endpoint, bad path)."""
    from tierio.storage import open_store

    for url in urls:
        store = open_store(url)
        try:
            store.list("step_")
        finally:
            store.close()


def _held_bytes(url: str) -> tuple[int, int]:
    """(checkpoint count, bytes) a tier holds now."""
    from tierio.ckpt.steps.reader import committed_in, step_dirs
    from tierio.storage import open_store

    store = open_store(url)
    try:
        dirs = step_dirs(store)
        steps = committed_in(dirs)
        return len(steps), sum(store.stat(k).size for s in steps for k in dirs[s])
    finally:
        store.close()


# -- measurements --------------------------------------------------------------------------------


def _state_bytes(state: Any) -> int:
    seen: set[int] = set()
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return total


def _watch(record: SaveRecord, handle: Any) -> None:
    """Record when a save is persisted and promoted (the handle's futures call back)."""
    for stage in ("persisted", "promoted"):
        getattr(handle, stage).add_done_callback(lambda _f, attr=f"{stage}_at": setattr(record, attr, time.perf_counter()))


# -- the run -------------------------------------------------------------------------------------


class _Determinism:
    """Fixed threads and deterministic kernels for the run; restores the caller's settings."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __enter__(self) -> None:
        self._saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self._saved[0])
        torch.use_deterministic_algorithms(self._saved[1])


def run_demo(cfg: DemoConfig, progress: Progress = _quiet) -> DemoReport:
    if cfg.preset not in PRESETS:
        raise ConfigError(f"unknown model preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
    if cfg.steps is not None and cfg.steps < 4:
        raise ConfigError("--steps must be at least 4 (checkpoints, then steps to redo after the restore)")
    if cfg.save_every is not None and cfg.save_every < 1:
        raise ConfigError("--save-every must be at least 1")
    if cfg.steps is not None and cfg.save_every is not None and cfg.save_every >= cfg.steps:
        raise ConfigError(f"--save-every {cfg.save_every} leaves no checkpoint before step {cfg.steps}; use a smaller value")
    if cfg.threads < 1:
        raise ConfigError("--threads must be at least 1")
    directory = Path(cfg.directory).expanduser().resolve()
    _prepare_directory(directory)
    with _Determinism(cfg.threads):
        return _run(cfg, directory, progress)


def _run(cfg: DemoConfig, directory: Path, progress: Progress) -> DemoReport:
    from tierio.ckpt import CheckpointManager

    model_cfg = PRESETS[cfg.preset]
    tcfg = TrainConfig(model=model_cfg, batch=4 if cfg.preset != "quick" else 8,
                       data_tokens=400_000 if cfg.preset != "quick" else 20_000)
    # The stream uses at most 512 distinct tokens, so the loss falls visibly within a minute.
    tokens = markov_tokens(min(model_cfg.vocab, 512), tcfg.data_tokens, seed=tcfg.data_seed)
    urls = _tier_urls(directory, cfg.s3)
    _preflight(urls)

    # -- 1. the uninterrupted run, checkpointing as it goes ------------------------------------
    trainer = Trainer(tcfg, tokens, init_seed=cfg.seed)
    every = cfg.save_every
    losses: dict[int, float] = {}
    step_times: list[float] = []
    saves: list[SaveRecord] = []
    handles: list[Any] = []
    mgr = None
    progress("start", {"urls": urls, "state_bytes": model_cfg.state_bytes(), "params": model_cfg.num_params(),
                       "seconds": cfg.seconds, "steps": cfg.steps})
    t_train = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        loss = trainer.train_step()
        step_times.append(time.perf_counter() - t0)
        step = trainer.step
        losses[step] = loss
        elapsed = time.perf_counter() - t_train
        if every is None and step == 3:
            # About six checkpoints over the run, from the measured step time.
            per_step = statistics.median(step_times[1:])
            planned = cfg.steps if cfg.steps is not None else max(8, int(cfg.seconds / per_step))
            every = max(1, planned // 7)
        if mgr is None and every is not None:
            mgr = CheckpointManager(_make_tiers(urls, every))
        if cfg.steps is not None:
            done = step >= cfg.steps
        else:
            # Stop between checkpoints, so the resumed run has steps to redo (and to match).
            redo = min(every - 1, max(1, every // 2)) if every is not None else 0
            done = elapsed >= cfg.seconds and every is not None and step > every and step % every >= redo
        if done:  # the last step is never checkpointed: the resume must recompute steps to prove anything
            progress("step", {"step": step, "loss": loss, "elapsed": elapsed, "every": every})
            break
        if every is not None and step % every == 0:
            rec = SaveRecord(step=step, blocking_s=0.0, started_at=time.perf_counter())
            handle = mgr.save(step, trainer.state())
            rec.blocking_s = time.perf_counter() - rec.started_at
            _watch(rec, handle)
            saves.append(rec)
            handles.append(handle)
            progress("save", {"step": step, "blocking_s": rec.blocking_s, "first": len(saves) == 1})
        progress("step", {"step": step, "loss": loss, "elapsed": elapsed, "every": every})
    train_s = time.perf_counter() - t_train
    if not saves:
        raise ConfigError("the run ended before its first checkpoint; train longer or checkpoint more often")
    final_step = trainer.step
    reference = trainer.fingerprint()
    progress("drain", {})
    mgr.wait()  # every checkpoint committed on every tier (promotion runs in the background)
    promotion_errors = [f"step {h.step}: {h.promoted.exception()}" for h in handles if h.promoted.exception()]
    manager_stats = _jsonable(mgr.stats())
    state_bytes = _state_bytes(trainer.state())
    progress("sync_save", {"state_bytes": state_bytes})
    sync_save_s = timed_torch_save(trainer.state(), directory / TIER_NAMES[0])
    held_before = [_held_bytes(u) for u in urls]
    mgr.close()
    del trainer

    # -- 2. the node loses its local disk --------------------------------------------------------
    shutil.rmtree(directory / TIER_NAMES[0])
    progress("disk_lost", {"path": str(directory / TIER_NAMES[0])})

    # -- 3. a replacement node restores from the next tier and resumes ---------------------------
    resumed = Trainer(tcfg, tokens, init_seed=cfg.seed + 1)  # different init: the restore must overwrite it
    with CheckpointManager(_make_tiers(urls, every)) as mgr2:
        t0 = time.perf_counter()
        tree = mgr2.restore()
        restore_s = time.perf_counter() - t0
        restored_from = urls[mgr2.tiers.index(mgr2.restored_from)]  # the tier as the demo named it
        restore_stats = _jsonable(mgr2.stats()["restore"])
    if cfg._fault == "perturb":
        tree["model"]["blocks.0.fc.weight"].view(-1)[0] += 0.01
    resumed.load_state(tree, restore_rng=cfg._fault != "skip-rng", restore_data=cfg._fault != "skip-data")
    del tree
    resumed_from = resumed.step
    progress("restored", {"step": resumed_from, "from": restored_from, "seconds": restore_s})
    mismatches: list[str] = []
    while resumed.step < final_step:
        loss = resumed.train_step()
        if loss != losses[resumed.step]:
            mismatches.append(f"loss at step {resumed.step}: {loss!r} != {losses[resumed.step]!r}")
        progress("resume_step", {"step": resumed.step, "loss": loss, "target": final_step})
    after = resumed.fingerprint()
    mismatches += [f"{k} differs" for k in reference if after.get(k) != reference[k]]

    persist = [r.persisted_at - r.started_at for r in saves if r.persisted_at]
    promote = [r.promoted_at - r.persisted_at for r in saves if r.promoted_at and r.persisted_at]
    tiers = []
    for i, url in enumerate(urls):
        count, held = held_before[i]
        row: dict[str, Any] = {"tier": i + 2, "role": TIER_NAMES[i], "url": url, "checkpoints": count,
                               "bytes_held": held}
        tiers.append(row)
    _merge_tier_stats(tiers, manager_stats)
    blocking = [r.blocking_s for r in saves]
    steady = blocking[1:] or blocking
    return DemoReport(
        bit_exact=not mismatches,
        steps=final_step,
        resumed_from=resumed_from,
        restored_from=restored_from,
        restore_s=restore_s,
        restore=restore_stats,
        state_bytes=state_bytes,
        model_params=model_cfg.num_params(),
        train_s=train_s,
        step_s_mean=statistics.fmean(step_times),
        step_s_p50=statistics.median(step_times),
        saves=len(saves),
        save_every=every or 0,
        blocking_s_first=blocking[0] if blocking else 0.0,
        blocking_s_mean=statistics.fmean(steady) if steady else 0.0,
        blocking_s_max=max(steady, default=0.0),
        sync_save_s=sync_save_s,
        persist_s_mean=statistics.fmean(persist) if persist else 0.0,
        promote_s_mean=statistics.fmean(promote) if promote else 0.0,
        first_loss=losses[1],
        last_loss=losses[final_step],
        tiers=tiers,
        mismatches=mismatches[:20],
        promotion_errors=promotion_errors[:20],
        directory=str(directory),
        manager_stats=manager_stats,
    )


def _merge_tier_stats(tiers: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Bytes written and bandwidth per tier, from the manager's counters."""
    for row, st in zip(tiers, stats["tiers"]):
        row["bytes_written"] = int(st["bytes_written"])
        if st["bytes_written"] and st["seconds"]:
            row["write_seconds"] = float(st["seconds"])
            row["bandwidth"] = st["bytes_written"] / st["seconds"]


def _jsonable(x: Any) -> Any:
    try:
        return json.loads(json.dumps(x, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
    except (TypeError, ValueError):
        return {}


__all__ = ["DemoConfig", "DemoReport", "PRESETS", "run_demo"]
