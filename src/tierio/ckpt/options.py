"""The options of a CheckpointManager, in one typed record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tierio.io.background import DEFAULT_NICE
from tierio.options import Options

from tierio.ckpt.steps.commit import INLINE_RECORD_BYTES


@dataclass(frozen=True)
class CheckpointOptions(Options):
    """How a CheckpointManager saves, commits and cleans up.

    ``memory_budget_bytes``: cap on staging memory (bytes or text such as "8GB"); ``double_buffer``: two
    staging buffers, so a save can overlap the previous persist; ``promote_bandwidth``: limit on
    writes to slower tiers (bytes/s or text); ``min_keep``: checkpoints retention always leaves;
    ``commit_timeout``: seconds a commit waits for every rank's shard; ``run_id``: this run's name in
    leases and manifests (default: a fresh one, agreed across ranks); ``break_lease``: take over a
    tier another run still leases; ``lease_expires``: seconds a tier's lease may stay unrenewed
    before another run takes it over (default 120, or ``TIERIO_LEASE_EXPIRES``; ``ckpt.steps.lease``);
    ``node``: this rank's node, for node-local tiers (default: the host name; with a process
    group, ranks naming the same node share it); ``ranks_per_node``: without a process group,
    ranks sit on nodes in blocks of this many (default: torchrun's LOCAL_WORLD_SIZE, else one
    node); ``inline_record_bytes``: rank records up to this many bytes together are merged into the
    manifest, larger ones are referenced; ``mtbf``: the job's mean time
    between failures in seconds, which turns on ``CheckpointManager.should_save`` (Young/Daly's
    interval from the measured cost of saves, ``ckpt.saving.interval``); ``overlap``: zero-stall snapshots,
    ``save`` returns before the large tensors are copied and the next update waits for the copy
    (``attach(optimizer)`` or ``before_update()``; the rule the caller keeps: ``ckpt.saving.overlap``);
    ``buddy``: with a node-local tier 0, each rank also sends its part of every step to the rank of
    the same local index on the next node, which keeps it on its tier 0, so that a lost node's
    ranks restore from it before the step reaches the shared tier (``ckpt.promotion.buddy``);
    ``buddy_bandwidth``: limit on what each rank sends to its buddy (bytes/s or text; default the
    ``promote_bandwidth``, 0: no limit);
    ``incremental``: a save writes only the tensors that changed since the last step this manager
    committed, the manifest refers to the earlier shards for the others (``ckpt.saving.incremental``);
    ``numa_node``: place the staging buffers on this NUMA node (``"auto"``: the current GPU's), by
    allocating and first-touching them from its CPUs (``io.numa``); ``stats()["staging_numa"]`` says where;
    ``background_nice``: the niceness added to the threads that persist, checksum, promote and send
    buddy copies behind training, so a contended core goes to the training step first; those
    threads also move bytes in few long calls, so they rarely take the GIL from the step (0: they
    are ordinary threads; ``io.background``); ``persist_process``: the byte loops of that work (the
    shard's write and checksums, the promotion's reads and writes on local and shared filesystems)
    run in a process of its own on staging memory it shares, so they take no GIL from a
    Python-heavy step (``io.offload``)."""

    memory_budget_bytes: int | str | None = None
    double_buffer: bool = False
    promote_bandwidth: float | str | None = None
    min_keep: int = 3
    commit_timeout: float = 600.0
    run_id: str | None = None
    break_lease: bool = False
    lease_expires: float | None = None
    node: str | None = None
    ranks_per_node: int | None = None
    inline_record_bytes: int | str = INLINE_RECORD_BYTES
    mtbf: float | None = None
    overlap: bool = False
    buddy: bool = False
    buddy_bandwidth: float | str | None = None
    incremental: bool = False
    numa_node: int | str | None = None
    background_nice: int = DEFAULT_NICE
    persist_process: bool = True

    LABEL: ClassVar[str] = "CheckpointManager"
    ALIASES: ClassVar[dict[str, str]] = {"memory_budget": "memory_budget_bytes",
                                         "inline_records": "inline_record_bytes"}
