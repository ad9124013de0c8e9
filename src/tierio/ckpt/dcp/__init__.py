"""torch.distributed.checkpoint (DCP) storage on tierio tiers: ``TierioWriter`` and ``TierioReader``.

The writer is ``dcp/writer.py``, the reader ``dcp/reader.py``; ``dcp/engine.py`` drives the
manager's persister, promoter and step book in DCP's thread; ``dcp/ids.py`` reads checkpoint ids.

    with CheckpointManager(tiers) as mgr:
        dcp.save(state, storage_writer=TierioWriter(mgr, step=100))          # or dcp.async_save
        dcp.load(state, storage_reader=TierioReader(mgr))                    # the latest step

    # or as FileSystemWriter/FileSystemReader are called: the writer builds and owns its manager
    with TierioWriter(["/nvme/ckpt", "s3://bucket/run1"]) as writer:
        dcp.save(state, storage_writer=writer, checkpoint_id=100)
    dcp.load(state, storage_reader=TierioReader(), checkpoint_id="/nvme/ckpt/step_000000100")

DCP plans (which rank writes which slice, its resharding planner on load); tierio stores: each
rank writes one safetensors shard of its write items and its record through the manager (staging
buffer, O_DIRECT, xxh3 per chunk, node-local tier 0 published to the first shared tier), and DCP's
coordinator commits the manifest in ``finish`` through the same commit protocol as
``CheckpointManager.save`` (``ckpt.steps.commit``). Promotion to slower tiers and retention follow on
each rank's background thread. The checkpoint is an ordinary tierio checkpoint: every tensor is a
global tensor named by its path, the manifest carries one state tree for the whole job, and
``CheckpointManager.restore`` reads it, as ``TierioReader`` reads checkpoints that
``CheckpointManager.save`` wrote.

No pickle reaches storage: DCP hands non-tensor values over pickled, so the writer takes the value
itself from the planner (``DefaultSavePlanner.lookup_object``) and stores it as JSON (refusing what
JSON cannot hold, like ``save``); the reader gives DCP's planner ``torch.save`` bytes it makes from
that JSON.

``dcp.async_save`` runs ``save`` (and its collectives) on a thread of its own: give it a process
group of its own (``process_group=dist.new_group(backend="gloo")``) so no collective of the
training group runs in the background.
"""

from tierio.ckpt.dcp.ids import place_of, step_of
from tierio.ckpt.dcp.reader import TierioReader
from tierio.ckpt.dcp.writer import TierioWriter

__all__ = ["TierioReader", "TierioWriter", "place_of", "step_of"]
