"""Checkpoint size by component, and what writing it costs.

All sizes are bytes, times seconds, bandwidths bytes per second, money in the currency of
``gpu_hour_cost``. Every function is pure: same inputs, same figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierio.errors import ConfigError
from tierio.plan.model import dtype_bytes

OPTIMIZERS = ("adamw", "adam", "sgd", "none")


@dataclass(frozen=True)
class Parallelism:
    """How the job is laid out: ``world_size`` GPUs = tp × pp × dp; ZeRO shards over dp."""

    world_size: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 3
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be a whole number of at least 1, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {self.world_size} is not divisible by tensor × pipeline parallel "
                f"{self.tp} × {self.pp} = {self.tp * self.pp}: choose a world size that is a multiple of it")
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            raise ConfigError(
                f"world size {self.world_size} is not a whole number of nodes of {self.gpus_per_node} GPUs: "
                "fix --gpus or --gpus-per-node")

    @property
    def dp(self) -> int:
        """Data-parallel degree (the group ZeRO shards over)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        return max(1, -(-self.world_size // self.gpus_per_node))


@dataclass(frozen=True)
class Component:
    """One part of the training state: ``bytes_per_param`` × params, sharded over dp or not."""

    name: str
    bytes_total: float
    bytes_per_param: float
    zero_sharded: bool
    note: str = ""


@dataclass(frozen=True)
class CheckpointSize:
    """Checkpoint size, whole and per rank.

    ``bytes_total`` counts each unique byte once. ``per_rank_held`` is what the largest rank
    holds; ``per_rank_written`` is what the busiest rank writes when every unique byte is written
    once, by the rank that owns it (replicated state by data-parallel rank 0).
    """

    components: list[Component] = field(default_factory=list)
    bytes_total: float = 0.0
    per_rank_held: float = 0.0
    per_rank_written: float = 0.0
    world_size: int = 1

    @property
    def bytes_per_param(self) -> float:
        return sum(c.bytes_per_param for c in self.components)


def checkpoint_size(params: float, par: Parallelism, optimizer: str = "adamw", weight_dtype: str = "bf16",
                    include_grads: bool = True, misc_bytes: float = 0.0) -> CheckpointSize:
    """Size of a full training checkpoint.

    Per parameter (mixed precision, AdamW): weights in ``weight_dtype`` (2 B for bf16), fp32
    master weights (4 B), Adam first moment m (4 B) and second moment v (4 B), gradients in
    ``weight_dtype`` (2 B) = 16 B/param. ``misc_bytes`` (RNG, step, LR schedule) is added once.
    ZeRO stage 1 shards the optimizer state (master, m, v) over dp, stage 2 also the gradients,
    stage 3 also the weights; tensor and pipeline parallelism always split everything.
    """
    if params <= 0:
        raise ConfigError(f"parameter count must be more than zero, got {params!r}")
    if misc_bytes < 0:
        raise ConfigError(f"misc state size must be zero or more, got {misc_bytes!r}")
    opt = optimizer.lower()
    if opt not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    wb = dtype_bytes(weight_dtype)
    stage = par.zero_stage
    parts: list[tuple[str, float, bool, str]] = [
        (f"model weights ({weight_dtype})", wb, stage >= 3, f"{wb:g} B × params"),
    ]
    if opt != "none":
        if wb < 4:  # mixed precision keeps an fp32 master copy; fp32 training does not need one
            parts.append(("optimizer: fp32 master weights", 4, stage >= 1, "4 B × params"))
        if opt in ("adamw", "adam"):
            parts.append(("optimizer: Adam m (fp32)", 4, stage >= 1, "first moment, 4 B × params"))
            parts.append(("optimizer: Adam v (fp32)", 4, stage >= 1, "second moment, 4 B × params"))
        else:
            parts.append(("optimizer: momentum (fp32)", 4, stage >= 1, "4 B × params"))
        if include_grads:
            parts.append((f"gradients ({weight_dtype})", wb, stage >= 2, "kept for gradient accumulation"))
    components = [Component(n, b * params, b, s, note) for n, b, s, note in parts]
    if misc_bytes:
        components.append(Component("misc (RNG, step, LR)", misc_bytes, 0.0, True, "added once"))
    mp = par.tp * par.pp
    held = sum(c.bytes_total / mp / (par.dp if c.zero_sharded else 1) for c in components)
    written = sum(c.bytes_total / par.world_size if c.zero_sharded else c.bytes_total / mp for c in components)
    total = sum(c.bytes_total for c in components)
    return CheckpointSize(components, total, held, written, par.world_size)


@dataclass(frozen=True)
class WriteCost:
    """One way of writing a checkpoint: how long training stops, and what that costs."""

    strategy: str
    blocking_s: float          # seconds the GPUs wait per checkpoint
    background_s: float        # seconds of writing that overlap training (async only)
    overhead: float            # blocking_s / seconds of training between checkpoints
    gpu_hours_per_ckpt: float
    cost_per_ckpt: float
    gpu_hours_per_day: float
    cost_per_day: float
    note: str = ""


def interval_seconds(interval_steps: float, step_s: float) -> float:
    """Training seconds between two checkpoints = steps between checkpoints × step time."""
    if interval_steps <= 0 or step_s <= 0:
        raise ConfigError("checkpoint interval and step time must both be more than zero")
    return interval_steps * step_s


def stall_cost(blocking_s: float, gpus: int, interval_s: float, gpu_hour_cost: float) -> tuple[float, float, float, float, float]:
    """(overhead fraction, GPU-h per checkpoint, money per checkpoint, GPU-h per day, money per day).

    overhead = blocking / interval; GPU-hours = blocking × GPUs / 3600 s/h;
    checkpoints per day = 86,400 s / interval.
    """
    overhead = blocking_s / interval_s
    gh = blocking_s * gpus / 3600.0
    per_day = 86400.0 / interval_s
    return overhead, gh, gh * gpu_hour_cost, gh * per_day, gh * per_day * gpu_hour_cost


def write_costs(size: CheckpointSize, par: Parallelism, *, single_writer_bw: float, storage_bw: float,
                node_bw: float, snapshot_bw: float, interval_s: float, gpu_hour_cost: float,
                snapshot_s: float | None = None, async_window_s: float | None = None) -> list[WriteCost]:
    """Blocking time and cost of three ways to write ``size``.

    * single writer: every byte goes through one writer (gather to rank 0, one file):
      total / single_writer_bw.
    * sharded: every rank writes its own shard at once; limited by the storage's aggregate
      bandwidth and by each node's link: max(total / storage_bw, node bytes / node_bw).
    * async: training waits only for the copy into host staging buffers
      (per-rank bytes / snapshot_bw, or ``snapshot_s`` when given); the sharded write runs in
      the background and must finish within the async window and before the next checkpoint.
    """
    for name, bw in (("single-writer", single_writer_bw), ("storage", storage_bw), ("node", node_bw),
                     ("snapshot", snapshot_bw)):
        if bw <= 0:
            raise ConfigError(f"{name} bandwidth must be more than zero")
    single = size.bytes_total / single_writer_bw
    node_bytes = size.per_rank_written * min(par.gpus_per_node, par.world_size)
    sharded = max(size.bytes_total / storage_bw, node_bytes / node_bw)
    snap = snapshot_s if snapshot_s is not None else size.per_rank_written / snapshot_bw
    out = []
    for strategy, blocking, background, note in (
        ("single writer", single, 0.0, "all bytes through one writer"),
        ("sharded", sharded, 0.0,
         "per-rank files; storage-bound" if size.bytes_total / storage_bw >= node_bytes / node_bw
         else "per-rank files; node-link-bound"),
        ("async", snap, sharded, _async_note(sharded, async_window_s, interval_s)),
    ):
        overhead, gh, money, gh_day, money_day = stall_cost(blocking, par.world_size, interval_s, gpu_hour_cost)
        out.append(WriteCost(strategy, blocking, background, overhead, gh, money, gh_day, money_day, note))
    return out


def _async_note(background_s: float, window_s: float | None, interval_s: float) -> str:
    if background_s > interval_s:
        return "snapshot; write outlasts the interval: saves would queue"
    if window_s is not None and background_s > window_s:
        return f"snapshot; write misses the {window_s:g} s window"
    return "snapshot; write fits the window" if window_s is not None else "snapshot + background write"


# -- the commit's metadata load --------------------------------------------------------------------
INLINE_RECORD_BYTES = 256 << 10  # tierio.ckpt.steps.commit merges rank records into the manifest up to this
RECORD_BYTES_PER_TENSOR = 190.0  # a record's JSON per tensor slice (name, dtype, shapes, range, xxh3, tree leaf)
REF_BYTES_PER_RANK = 140.0  # a manifest line naming one rank's record
LIST_PAGE = 1000  # keys per listing request on S3


@dataclass(frozen=True)
class CommitLoad:
    """What one checkpoint asks of the shared tier's metadata service (files, listings, requests),
    following tierio's commit protocol: each rank writes its shard and its record; the committer
    polls one listing of the step directory until every record is there, then writes the manifest;
    the other ranks poll for the manifest. Counts are per checkpoint for the whole job."""

    ranks: int
    tensors_per_rank: int
    mode: str  # "inline" (records merged into the manifest and removed) or "referenced"
    record_bytes: float
    manifest_bytes: float
    files_created: int  # on the shared tier: shards, records (kept when referenced), the manifest
    listing_polls: int  # the committer's looks at the step directory while it waits
    listing_requests: int  # each look costs ceil(files / 1000) requests on S3 (one readdir on a filesystem)
    requests: dict[str, int] = field(default_factory=dict)  # PUT, GET, HEAD, LIST, DELETE (S3 terms)
    requests_per_rank: float = 0.0


def _polls(wait_s: float, first: float, most: float) -> int:
    """Looks a poll loop makes while waiting ``wait_s`` (delay grows by half from ``first`` to ``most``)."""
    n, t, d = 1, 0.0, first
    while t < wait_s:
        t += d
        d = min(d * 1.5, most)
        n += 1
    return n


def commit_load(ranks: int, tensors_per_rank: int, shard_bytes: float, *, part_bytes: float = 64 * 2**20,
                spread_s: float = 5.0, inline_limit: int = INLINE_RECORD_BYTES) -> CommitLoad:
    """The metadata load of committing one checkpoint of ``ranks`` shards of ``shard_bytes`` holding
    ``tensors_per_rank`` tensor slices each. ``spread_s``: time between the first and the last rank's
    shard being durable (the committer and the other ranks poll meanwhile); ``part_bytes``: S3
    multipart part size."""
    if ranks < 1 or tensors_per_rank < 0 or shard_bytes < 0 or spread_s < 0:
        raise ConfigError("commit load needs ranks >= 1 and non-negative tensor counts, sizes and times")
    record = 400.0 + RECORD_BYTES_PER_TENSOR * tensors_per_rank
    inline = record * ranks <= inline_limit
    manifest = record * ranks if inline else 300.0 + REF_BYTES_PER_RANK * ranks
    polls = _polls(spread_s, 0.005, 0.25)
    files_in_step = 2 * ranks + 1
    pages = -(-files_in_step // LIST_PAGE)
    parts = max(1, -(-int(shard_bytes) // int(part_bytes)))
    shard_puts = 1 if parts == 1 else parts + 2  # a single PUT, or create + parts + complete
    rank_polls = _polls(spread_s, 0.005, 0.5) - 1  # HEADs of the manifest by each other rank
    if ranks == 1:  # one rank commits its own entry: no record, no waiting
        requests = {"PUT": shard_puts + 1, "GET": 0, "HEAD": 0, "LIST": 0, "DELETE": 0}
        return CommitLoad(1, tensors_per_rank, "inline", record, record, 2, 0, 0, requests, float(shard_puts + 1))
    requests = {
        "PUT": ranks * (shard_puts + 1) + 1,
        # merged records are read (but the committer's own) and removed; each other rank reads the manifest once
        "GET": (ranks - 1 if inline else 0) + (ranks - 1),
        "HEAD": (ranks - 1) * rank_polls,
        "LIST": polls * pages,
        "DELETE": ranks if inline else 0,
    }
    return CommitLoad(ranks, tensors_per_rank, "inline" if inline else "referenced", record, manifest,
                      ranks * (1 if inline else 2) + 1, polls, polls * pages, requests,
                      sum(requests.values()) / ranks)


def tensors_per_rank(layers: int, optimizer: str = "adamw", weight_dtype: str = "bf16") -> int:
    """Tensor slices one rank saves when every tensor is sharded over all ranks (ZeRO-3 / FSDP):
    ~9 per transformer layer (attention q, k, v, o; MLP gate, up, down; two norms) plus embeddings,
    final norm and head, times the optimizer's copies (fp32 master, Adam m and v)."""
    model = 9 * layers + 3
    copies = 1
    if optimizer.lower() != "none":
        copies += 1 if dtype_bytes(weight_dtype) < 4 else 0
        copies += 2 if optimizer.lower() in ("adamw", "adam") else 1
    return model * copies
