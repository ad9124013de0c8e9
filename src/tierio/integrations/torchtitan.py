"""torchtitan: its checkpointer saving into and resuming from tierio tiers.

    from tierio.integrations.torchtitan import TierioCheckpointManager

    # in the job's config (torchtitan.trainer.Trainer.Config), in place of CheckpointManager.Config:
    checkpoint=TierioCheckpointManager.Config(enable=True, interval=500, async_mode="async",
                                              tiers=["/nvme/ckpt", "s3://bucket/run1"])

``TierioCheckpointManager`` is torchtitan's DCP ``CheckpointManager`` with tierio's DCP storage
(``tierio.ckpt.dcp``) under its ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` calls: torchtitan
still decides what to save and when (``interval``, the last step, model-only steps, exclusions);
each ``step-N`` it saves is tierio step N, written to the first tier, committed, then promoted to
the slower tiers behind training and kept by tierio's retention (``keep_latest_k`` as
``KeepLast``). With ``async_mode="async"`` DCP copies the state into CPU memory and the write runs
behind training too. A resume loads the newest committed step (all ranks take rank 0's choice), on
any number of processes: tierio's DCP reader gives DCP's planner every saved chunk of a DTensor, so
FSDP2 state reshards to the new mesh. Without a committed step on the tiers, torchtitan's own first
start runs unchanged (``step-N`` folders it wrote itself in ``checkpoint.folder``,
``initial_load_path``, Hugging Face weights, or a fresh start).

Preemption (``preemption=True``, off by default): tierio's signal handlers
(``tierio.ckpt.preempt.Preemption``) are installed when the checkpointer is built. torchtitan's
trainer calls ``save(curr_step)`` at every step; once the ranks agree on a step after SIGTERM or
SIGUSR1 (through the process group's TCPStore), ``save`` of that step waits for an asynchronous
save in flight, saves the step synchronously through DCP with ``reason="emergency: SIGTERM"``,
waits until it is committed within ``preempt_grace_seconds`` and exits the process with 143. The
requeued job resumes from it like from any other step.

Two options cannot be honoured and are refused with a ``ConfigError`` when the config is made:
``async_mode="async_with_pinned_mem"`` (DCP saves in another process, where the tierio manager of
this one cannot follow) and ``last_save_in_hf=True`` (a Hugging Face export written past the tiers).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tierio.ckpt import CheckpointManager as TierioManager
from tierio.ckpt import KeepLast, Tier
from tierio.ckpt.dcp import TierioReader, TierioWriter
from tierio.ckpt.preempt import Preemption
from tierio.ckpt.tier import as_tier
from tierio.dist import release_group
from tierio.errors import ConfigError, NotFoundError
from tierio.integrations.checkpoints import check_manager_options

from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

_STEP_ID = re.compile(r"step-(\d+)")  # torchtitan's checkpoint ids: {folder}/step-N


PINNED = ("checkpoint.async_mode='async_with_pinned_mem' runs DCP's save in a separate process, where the tierio "
          "CheckpointManager of this one (its leases, commits, promotion and retention) cannot follow; use "
          "async_mode='async' (DCP copies the state into CPU memory, then tierio writes, commits and promotes behind "
          "training) or 'disabled' (training waits for the write to the first tier only)")
TO_HF = ("checkpoint.last_save_in_hf=True writes the last step as Hugging Face safetensors through torch's "
         "HuggingFaceStorageWriter, past the tierio tiers; set last_save_in_hf=False (the last step is then a tierio "
         "checkpoint like the others) and export it afterwards: `tierio ckpt export TIER OUT --prefix ''` writes "
         "safetensors shards with torchtitan's names, which its state dict adapter converts")


def refuse_unsupported(config: Any) -> None:
    """Raise ``ConfigError`` for a torchtitan checkpoint option tierio cannot honour, naming it."""
    if config.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
        raise ConfigError(PINNED)
    if config.last_save_in_hf:
        raise ConfigError(TO_HF)


def tierio_step(checkpoint_id: str | os.PathLike[str]) -> int:
    """The tierio step of torchtitan's checkpoint id (``.../step-N`` → N)."""
    m = _STEP_ID.fullmatch(os.path.basename(os.fspath(checkpoint_id).rstrip("/")))
    if m is None:
        raise ConfigError(f"checkpoint id {os.fspath(checkpoint_id)!r} is not torchtitan's '<folder>/step-N'")
    return int(m.group(1))


class TierioCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` saving into and loading from tierio ``tiers`` (see the
    module's docstring). Built by torchtitan from :class:`TierioCheckpointManager.Config`, with
    the same arguments as the stock one; ``tierio`` is the tierio ``CheckpointManager`` it saves
    through (None when checkpointing is disabled)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        tiers: list[Any] = field(default_factory=list)
        """tierio tiers, fastest first: paths, URLs or ``tierio.ckpt.Tier``; empty: the checkpoint folder alone."""

        manager_options: dict[str, Any] = field(default_factory=dict)
        """``tierio.ckpt.CheckpointManager`` keywords (``memory_budget_bytes``, ``promote_bandwidth``, ...)."""

        preemption: bool = False
        """On SIGTERM or SIGUSR1, save the step the ranks agree on at once, wait until it is committed, then exit (143)."""

        preempt_grace_seconds: float = 60.0
        """How long that emergency save may take from the signal: the scheduler's grace period less a margin."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            refuse_unsupported(self)
            check_manager_options(self.manager_options)

    tierio: TierioManager | None = None
    preemption: Preemption | None = None  # config.preemption: the signal handlers, installed at construction
    _group: Any = None  # a gloo group of our own: the step agreement and the tierio manager's collectives

    def __init__(self, config: Config, **components: Any) -> None:
        refuse_unsupported(config)
        super().__init__(config, **components)
        if not self.enable:
            return
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        retention = KeepLast(self.keep_latest_k) if self.keep_latest_k > 0 else None
        tiers = [as_tier(t) for t in (getattr(config, "tiers", None) or [self.folder])]
        # keep_latest_k is torchtitan's retention: a tier given without a policy of its own gets it
        tiers = [Tier(t.url, retention, t.scope) if t.retention is None else t for t in tiers]
        options = {"min_keep": self.keep_latest_k} if self.keep_latest_k > 0 else {}
        options.update(check_manager_options(getattr(config, "manager_options", None) or {}))
        self.tierio = TierioManager(tiers, process_group=self._group, **options)
        if getattr(config, "preemption", False):
            self.preemption = Preemption(self.tierio, grace_seconds=config.preempt_grace_seconds)

    # -- saving -------------------------------------------------------------------------------------
    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """torchtitan's save of ``curr_step`` (at every step); with ``preemption``, the emergency
        save instead when this is the step the ranks agreed on after a signal (it exits)."""
        if self.preemption is not None and self.enable and self.preemption.requested(curr_step):
            self._save_for_preemption(curr_step)
        return super().save(curr_step, last_step)

    @torch.no_grad()
    def _save_for_preemption(self, step: int) -> None:
        """The emergency save of ``step``: after the save in flight, synchronous, committed within
        the grace period; then the process exits (``Preemption.finish``)."""
        assert self.preemption is not None and self.tierio is not None
        self.preemption.begin(step)
        self.maybe_wait_for_saving()
        writer = TierioWriter(self.tierio, step=step, reason=self.preemption.reason)
        dcp.save(self._flattened_model_states_sd(), storage_writer=writer)
        self.preemption.finish(step, writer.handle.committed)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """Save ``state_dict`` as the tierio step of ``checkpoint_id`` (``.../step-N``) through
        ``TierioWriter``; ``async_mode="async"`` returns DCP's future of the write and commit."""
        if to_hf or async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:  # refused with the config; a subclass may still ask
            raise ConfigError(TO_HF if to_hf else PINNED)
        assert self.tierio is not None
        writer = TierioWriter(self.tierio, step=tierio_step(checkpoint_id))
        ret = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        else:
            dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _should_purge(self) -> bool:
        return False  # tierio's retention keeps keep_latest_k steps on every tier, after each commit

    # -- loading ------------------------------------------------------------------------------------
    def newest_step(self) -> int:
        """The newest step committed on the tiers (-1: none), rank 0's answer on every rank, so
        that all ranks load the same step even where listings differ for a moment (S3)."""
        assert self.tierio is not None
        steps = self.tierio.steps()
        chosen = [steps[-1] if steps else -1]
        if self._group is not None and dist.get_world_size(self._group) > 1:
            dist.broadcast_object_list(chosen, src=0, group=self._group)
        return int(chosen[0])

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        assert self.tierio is not None
        found = self.newest_step() if step == -1 else step
        if found == -1 or (step != -1 and step not in self.tierio.steps()):
            if step != -1 and not filesystem.isdir(self._create_checkpoint_id(step)):
                raise NotFoundError(f"checkpoint.load_step={step}: step {step} is committed on none of the tiers "
                                    f"({', '.join(self.tierio.tiers)}) and {self._create_checkpoint_id(step)} does not "
                                    f"exist; committed steps: {self.tierio.steps() or 'none'}")
            # nothing of ours to resume: torchtitan's own folders, initial_load_path, HF weights or a fresh start
            return super()._load(step)
        logger.info(f"Loading tierio step {found} from {', '.join(self.tierio.tiers)}.")
        begin = time.monotonic()
        states = self._states_to_load(model_only=found == 0)  # torchtitan's step 0 is a model-only seed
        dcp.load(states, storage_reader=TierioReader(self.tierio, found))
        if MODEL in self.states:  # the model's entries are flattened into states, as torchtitan's dcp_load does
            self.states[MODEL].load_state_dict(states)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    # -- shutdown -----------------------------------------------------------------------------------
    def _close(self) -> None:
        """Wait for the save in flight, then for every step's commit and promotion (a background
        failure is raised here), and release the tiers."""
        try:
            self.maybe_wait_for_saving()
        finally:
            super()._close()
            if self.tierio is not None:
                self.tierio.close()
            release_group(self._group)
            self._group = None


__all__ = ["TierioCheckpointManager", "refuse_unsupported", "tierio_step"]
