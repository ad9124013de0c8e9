"""DataLoader with production settings, its pinned-memory cost, and exact resumption.

Defaults, and why:

* ``num_workers = min(cores per accelerator, 8)``: enough processes to decode and copy while
  the accelerator computes; beyond ~8 per device the returns vanish and host memory grows.
* ``pin_memory`` where CUDA exists: page-locked batches copy to the device asynchronously
  (``.to(device, non_blocking=True)``) at full PCIe speed.
* ``prefetch_factor = 4``: each worker keeps four batches ready, absorbing storage jitter.
* ``persistent_workers``: workers (and their open files, mappings and caches) survive epochs.
* ``drop_last``: every step has the same shape; no recompilation, no ragged last step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tierio import events
from tierio.data.options import LoaderOptions
from tierio.errors import ConfigError
from tierio.stats import Stats
from tierio.units import parse_size


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover
        return 0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass
class LoaderSettings(Stats):
    """What ``loader_settings`` chose for this machine (``loader_kwargs()`` for a DataLoader)."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    persistent_workers: bool
    drop_last: bool
    accelerators: int
    cores: int

    def loader_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory, "drop_last": self.drop_last}
        if self.num_workers > 0:
            kw["prefetch_factor"] = self.prefetch_factor
            kw["persistent_workers"] = self.persistent_workers
        return kw


def loader_settings(options: LoaderOptions | None = None, **overrides: Any) -> LoaderSettings:
    """The production settings for this machine (override any LoaderOptions field by keyword)."""
    o = LoaderOptions.resolve(options, overrides)
    num_workers, prefetch_factor = o.num_workers, o.prefetch_factor
    acc = _cuda_devices() if o.accelerators is None else o.accelerators
    cores = _cores() if o.cores is None else o.cores
    if num_workers is None:
        num_workers = max(1, min(cores // max(1, acc), 8))
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
    if prefetch_factor < 1:
        raise ConfigError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
    pin = (acc > 0) if o.pin_memory is None else o.pin_memory
    return LoaderSettings(num_workers, pin, prefetch_factor if num_workers else None,
                          o.persistent_workers and num_workers > 0, o.drop_last, acc, cores)


def pinned_memory_estimate(batch_bytes: int | str, settings: LoaderSettings) -> dict[str, int]:
    """Host memory the loader holds, from the bytes of one collated batch.

    Workers keep up to ``num_workers * prefetch_factor`` batches ready in shared memory; the
    pin-memory thread copies each into page-locked memory before the loop takes it, so up to
    that many plus the one in use can be pinned at once.
    """
    batch_bytes = parse_size(batch_bytes)
    in_flight = max(1, settings.num_workers) * (settings.prefetch_factor or 1) if settings.num_workers else 1
    pinned = (in_flight + 1) * batch_bytes if settings.pin_memory else 0
    return {"batch_bytes": batch_bytes, "batches_in_flight": in_flight, "shared_bytes": in_flight * batch_bytes,
            "pinned_bytes": pinned}


def build_loader(dataset: Any, batch_size: int, *, collate_fn: Callable | None = None, shuffle: bool = False,
                 seed: int = 0, settings: LoaderSettings | None = None, ring: bool = True, **overrides: Any):
    """A ``torch.utils.data.DataLoader`` with the production settings (``overrides`` win).

    For a TokenWindowDataset with workers the loader is wrapped so that workers fill a shared
    BatchRing in place (``ring=False`` turns that off); iteration yields the same batches. A
    StreamingDataset without a per-sample ``transform`` or ``collate_fn`` hands the DataLoader
    whole batches taken from its shards (``StreamingDataset.iter_batches``): no per-sample
    collation, the same batches.
    """
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    s = settings or loader_settings()
    kw = s.loader_kwargs()
    kw.update(overrides)
    if kw.get("num_workers", 0) == 0:  # single-process loading: these options do not apply
        kw.pop("prefetch_factor", None)
        kw.pop("persistent_workers", None)
    else:
        kw.setdefault("prefetch_factor", s.prefetch_factor or 4)
        kw.setdefault("persistent_workers", True)
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise ConfigError("an iterable dataset orders itself (e.g. StreamingDataset(shuffle=True)); do not pass shuffle")
        if getattr(dataset, "batch_size", batch_size) != batch_size:
            raise ConfigError(
                f"the dataset interleaves batches of {dataset.batch_size} between workers but the loader uses "
                f"{batch_size}: construct it with batch_size={batch_size}"
            )
    elif shuffle:
        kw["generator"] = torch.Generator().manual_seed(seed)
    from tierio.data.streaming import StreamingDataset
    from tierio.data.window import TokenWindowDataset, collate_windows

    if isinstance(dataset, StreamingDataset) and collate_fn is None and dataset.transform is None:
        drop_last = bool(kw.pop("drop_last", False))  # the dataset drops a short batch: the loader gets whole ones
        return StreamLoader(dataset.batched(drop_last), kw)

    from tierio.data.blend import BlendedDataset

    windows = isinstance(dataset, TokenWindowDataset) or getattr(dataset, "seq_len", None) is not None and isinstance(
        dataset, BlendedDataset)
    if collate_fn is None and (windows or isinstance(dataset, BlendedDataset)):
        collate_fn = collate_windows  # whole batches pass through
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle if not isinstance(dataset, IterableDataset) else None,
                        collate_fn=collate_fn, **kw)
    if windows and ring and kw.get("num_workers", 0) > 0 and collate_fn is collate_windows:
        from tierio.data.ring import BatchRing

        slots = int(kw.get("prefetch_factor") or 2) + 2  # in flight per worker + the one in use + one spare
        br = BatchRing(kw["num_workers"], slots, (dataset.seq_len + 1,), batch_size)
        dataset.use_ring(br)
        return RingLoader(loader, br, pin=bool(kw.get("pin_memory")))
    return loader


# Batches in flight per worker are at least this many bytes (up to SMALL_BATCH_PREFETCH_MAX batches).
# A batch of 64 x 2 KiB samples takes ~0.1 ms to gather: four in flight are gone within one
# scheduler time slice, so when the cores are shared a worker that is not scheduled for a slice
# stalls the loop. Slots are allocated once and reused, so depth costs only this shared memory.
SMALL_BATCH_PREFETCH_BYTES = 4 << 20
SMALL_BATCH_PREFETCH_MAX = 64


def small_batch_prefetch(batch_bytes: int) -> int:
    """Batches in flight per worker so that they hold SMALL_BATCH_PREFETCH_BYTES (capped)."""
    return max(1, min(SMALL_BATCH_PREFETCH_MAX, SMALL_BATCH_PREFETCH_BYTES // max(1, batch_bytes)))


# loader options BatchWorkers honours; with any other the DataLoader runs the workers
_BATCH_WORKER_OPTIONS = {"num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "timeout",
                         "worker_init_fn", "multiprocessing_context"}


def _stop_dataloader_workers(loader: Any) -> None:
    """Stop a torch DataLoader's worker processes, if it has any running (the next ``iter()`` starts new ones)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


class StreamLoader:
    """Whole batches of a StreamingDataset as tensors (what ``build_loader`` gives for one).

    Without workers the batches come straight from the dataset in this process: a DataLoader in
    between would only add its per-batch bookkeeping. With workers, ``BatchWorkers`` processes
    write the fixed-size fields into a FieldRing and the loop receives slot numbers over a pipe
    (the DataLoader's own hand-off costs more per batch than taking the batch); a loader option
    only the DataLoader has (e.g. ``pin_memory_device``) makes it a DataLoader over the batches
    (``batch_size=None``) whose workers fill the same ring."""

    def __init__(self, stream: Any, loader_kwargs: dict[str, Any]) -> None:
        from torch.utils.data import DataLoader

        from tierio.data.ring import FieldRing
        from tierio.data.workers import BatchWorkers, WorkerOptions

        self.stream = stream
        self.pin = bool(loader_kwargs.get("pin_memory"))
        workers = int(loader_kwargs.get("num_workers", 0))
        self.ring: FieldRing | None = None
        self.loader: Any = None
        self.workers: BatchWorkers | None = None
        if workers > 0:
            fields = stream.ring_fields()
            prefetch = int(loader_kwargs.get("prefetch_factor") or 2)
            fast = set(loader_kwargs) <= _BATCH_WORKER_OPTIONS
            if fields:
                if fast:
                    prefetch = max(prefetch, small_batch_prefetch(FieldRing.slot_bytes(fields, stream.batch_size)))
                # in flight + the one in use + a spare
                self.ring = FieldRing(workers, prefetch + 2, fields, stream.batch_size)
            stream.use_ring(self.ring)
            if fast:
                self.workers = BatchWorkers(stream, self.ring, WorkerOptions(
                    workers, prefetch, bool(loader_kwargs.get("persistent_workers", True)),
                    float(loader_kwargs.get("timeout", 0) or 0), loader_kwargs.get("worker_init_fn"),
                    loader_kwargs.get("multiprocessing_context")))
            else:
                self.loader = DataLoader(stream, batch_size=None, **loader_kwargs)

    @property
    def persistent_workers(self) -> bool:
        if self.workers is not None:
            return self.workers.options.persistent
        return bool(getattr(self.loader, "persistent_workers", False))

    def shutdown(self) -> None:
        """Stop the worker processes (the next ``iter()`` starts new ones)."""
        if self.workers is not None:
            self.workers.shutdown()
        _stop_dataloader_workers(self.loader)

    def __iter__(self):
        from tierio.data.ring import RingBatch

        source = self.workers if self.workers is not None else self.loader
        if source is None:
            for batch in self.stream:
                yield _as_tensors(batch, self.pin)
            return
        for batch in source:
            if isinstance(batch, RingBatch):  # pinned copies free the slot at once
                batch = _as_tensors(self.ring.materialize(batch), self.pin)  # type: ignore[union-attr]
            elif self.workers is not None:  # no free slot: the batch came whole (a DataLoader converts it)
                batch = _as_tensors(batch, self.pin)
            yield batch

    def __len__(self) -> int:
        return len(self.stream)


def _as_tensors(batch: dict[str, Any], pin: bool) -> dict[str, Any]:
    import torch

    def one(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(v)
        elif isinstance(v, list):
            return [one(x) for x in v]
        return v.pin_memory() if pin and isinstance(v, torch.Tensor) else v

    return {k: one(v) for k, v in batch.items()}


class RingLoader:
    """A DataLoader whose workers fill a shared BatchRing; yields the same dicts as without it."""

    def __init__(self, loader, ring, pin: bool) -> None:
        self.loader = loader
        self.ring = ring
        self.pin = pin

    def __iter__(self):
        from tierio.data.ring import RingRef
        from tierio.data.window import window_batch

        for batch in self.loader:
            if isinstance(batch, RingRef):
                t = self.ring.materialize(batch)
                if self.pin:
                    t = t.pin_memory()  # the copy frees the slot at once
                batch = window_batch(t)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        for v in batch.values():
            if hasattr(v, "shape") and len(v.shape) > 0:
                return int(v.shape[0])
        for v in batch.values():
            if isinstance(v, (list, tuple)):  # a variable-size field: one array per sample
                return len(v)
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if hasattr(first, "shape") and len(first.shape) > 0:
            return int(first.shape[0])
        return len(batch)
    raise ConfigError("cannot tell the batch size of this batch type; return dicts or tuples of tensors")


class StatefulLoader:
    """A DataLoader over a dataset with a global position (StreamingDataset, TokenWindowDataset,
    PackedDataset, BlendedDataset) that knows where it is.

    ``state_dict()`` returns the position in the epoch that every rank reached together (epoch and
    the samples of the epoch's order consumed, ``tierio.data.position``) as plain JSON-able data;
    ``load_state_dict()`` restarts the workers there, with any number of workers or ranks. Iterate
    it like the DataLoader it wraps; each ``iter()`` is one epoch.
    """

    def __init__(self, dataset: Any, batch_size: int, *, collate_fn: Callable | None = None,
                 settings: LoaderSettings | None = None, **overrides: Any) -> None:
        if getattr(dataset, "batch_size", batch_size) != batch_size:
            raise ConfigError(f"construct the dataset with batch_size={batch_size} (it has {dataset.batch_size})")
        self.dataset = dataset
        self.batch_size = batch_size
        self._collate = collate_fn
        self._settings = settings
        self._overrides = overrides
        self._loader = None
        self.epoch = dataset.split.epoch
        self.position = 0  # samples this rank received since the dataset's split began
        self._in_epoch = False

    def _persistent(self) -> bool:
        if self._loader is None:
            return False
        return bool(getattr(self._loader, "persistent_workers", False))

    def __iter__(self):
        if self._in_epoch:  # the previous epoch was abandoned part-way: persistent workers moved on
            self.epoch, self.position = self.epoch + 1, 0
            self._drop_loader()
        if self._loader is None or not self._persistent():
            # the dataset is pickled into fresh workers: tell it where to start
            self.dataset.resume(self.epoch, self.position)
            self.position = 0
            if self._loader is None:
                self._loader = build_loader(self.dataset, self.batch_size, collate_fn=self._collate,
                                            settings=self._settings, **self._overrides)
        self._in_epoch = True
        for batch in events.timed(self._loader, "StatefulLoader"):
            self.position += _batch_len(batch)
            yield batch
        self._in_epoch = False
        from torch.utils.data import IterableDataset

        if not isinstance(self.dataset, IterableDataset) and not self.dataset.split.fresh:
            self._drop_loader()  # map-style workers hold the resumed split: the next epoch is whole again
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict(consumed=self.position, epoch=self.epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self.epoch, self.position = self.dataset.split.epoch, 0
        self._in_epoch = False
        self._drop_loader()

    def _drop_loader(self) -> None:
        loader, self._loader = self._loader, None
        if isinstance(loader, StreamLoader):
            loader.shutdown()
        else:
            _stop_dataloader_workers(loader)
