"""Where a Trainer run stands in its data, so that a resume on another number of processes goes on
at the same global sample: none of the epoch skipped, none repeated.

The Trainer (with Accelerate's seedable sampler, its default) draws one order of the epoch's samples
from the seed and the epoch number alone, cuts it into batches of ``per_device_train_batch_size``
and deals them round-robin to the processes. An optimizer step therefore consumes
``world_size × per_device_train_batch_size × gradient_accumulation_steps`` samples of that order
(the global batch), and on a resume the Trainer skips ``global_step % steps_per_epoch`` steps'
worth of batches on every process. Both only name the same samples as before when the global
batch is the same: then a step is the same samples, the learning-rate schedule the same steps, and
the position carries over on any number of processes. So a checkpoint records its geometry
(:class:`DataPosition`, JSON), and a resume whose global batch differs, or whose skip would land
elsewhere in the epoch (another dataset length), is refused with the setting to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tierio.errors import ConfigError
from tierio.io.untrusted import Fields


@dataclass(frozen=True)
class DataPosition:
    """A run's batch geometry and its step: the samples of the epoch consumed follow from them."""

    world_size: int
    per_device_batch: int
    grad_accum: int
    steps_per_epoch: int
    global_step: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.per_device_batch * self.grad_accum

    @property
    def epoch_samples(self) -> int:
        """Samples of the current epoch's order consumed (the ones a resume skips)."""
        return (self.global_step % self.steps_per_epoch) * self.global_batch

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any, where: str) -> DataPosition:
        f = Fields(doc, f"{where}: data_position")
        return cls(f.int("world_size", lo=1), f.int("per_device_batch", lo=1), f.int("grad_accum", lo=1),
                   f.int("steps_per_epoch", lo=1), f.int("global_step"))


def _geometry(world: int, batch: int, accum: int) -> str:
    return (f"{world} process(es) × per_device_train_batch_size={batch} × gradient_accumulation_steps={accum} = "
            f"{world * batch * accum} samples a step")


def _advice(saved: DataPosition, world: int, batch: int) -> str:
    g = saved.global_batch
    if g % (world * batch) == 0:
        return f"set gradient_accumulation_steps={g // (world * batch)} (keeping per_device_train_batch_size={batch})"
    if g % world == 0:
        return (f"set per_device_train_batch_size × gradient_accumulation_steps = {g // world} "
                f"(e.g. per_device_train_batch_size={g // world}, gradient_accumulation_steps=1)")
    return f"run on a number of processes that divides {g}"


def check_geometry(saved: DataPosition, world: int, batch: int, accum: int, folder: str) -> None:
    """Refuse a resume whose global batch differs from the checkpoint's (ConfigError saying what to set)."""
    if world * batch * accum == saved.global_batch:
        return
    raise ConfigError(
        f"{folder} was saved at global step {saved.global_step} by "
        f"{_geometry(saved.world_size, saved.per_device_batch, saved.grad_accum)}; this run takes "
        f"{_geometry(world, batch, accum)}. A step count names the same samples (and the learning-rate schedule "
        f"the same steps) only with the same global batch: {_advice(saved, world, batch)}. Or pass "
        "TrainingArguments(ignore_data_skip=True) to start the epoch's data over (its samples are then seen twice).")


def check_skip(saved: DataPosition, batches: int, world: int, batch: int, folder: str) -> None:
    """Refuse a mid-epoch skip of ``batches`` per process that does not land on the saved sample."""
    skipped = batches * world * batch
    if skipped == saved.epoch_samples:
        return
    raise ConfigError(
        f"resuming {folder}: the Trainer would skip {skipped} samples of the epoch ({batches} batches on each of "
        f"{world} process(es)), but the checkpoint had consumed {saved.epoch_samples} "
        f"({saved.global_step % saved.steps_per_epoch} of {saved.steps_per_epoch} steps): the epoch no longer has "
        "the same number of steps (another dataset, dataloader_drop_last or batch layout). Resume with the "
        "training data and batch settings of the saved run, or pass TrainingArguments(ignore_data_skip=True) to "
        "start the epoch's data over.")


__all__ = ["DataPosition", "check_geometry", "check_skip"]
