"""The accelerator tier: an optional slot pool in device memory, above DRAM.

The engine's own KV memory stays the engine's; this is a second, bounded pool the user sizes
(``KVConfig.device_bytes``) for hot blocks: one ``torch.uint8`` tensor on the device, allocated
once when the cache opens and cut into slots like the DRAM pool (no allocation per block). Puts
from device tensors land in it device-to-device, gets from it into device tensors are
device-to-device copies, and blocks leave it for DRAM.

Copies to and from the pool run on a side stream of the device, so a write-down to DRAM does not
queue behind the engine's kernels; each copy first waits for the work the caller had queued on
its own stream when it called (an event recorded then), and is waited for (its own event) before
the call's result is ready, so no transfer ever hands over bytes that are still moving.

``device="cpu"`` makes the pool a host tensor: the same routing, eviction and bookkeeping with no
accelerator, which is how the tier is tested where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tierio.errors import ConfigError
from tierio.kv.config import KVConfig
from tierio.kv.tiers.slots import SlotPool
from tierio.kv.stats import KVTier


class DeviceTier(SlotPool):
    kind = KVTier.DEVICE

    def __init__(self, nslots: int, block_bytes: int, device: Any) -> None:
        import torch

        super().__init__(nslots, block_bytes)
        self.device = device
        self.cuda = device.type == "cuda"
        try:
            self.memory = torch.zeros(self.region_bytes, dtype=torch.uint8, device=device)  # touched once, here
        except (RuntimeError, MemoryError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            raise ConfigError(f"KV cache: a device tier of {self.region_bytes} bytes ({nslots} slots) does not fit "
                              f"on {device} ({exc}); lower device_bytes") from exc
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    @property
    def name(self) -> str:
        return str(self.device)

    def block(self, slot: int) -> Any:
        start, end = self.span(slot)
        return self.memory[start:end]

    def caller_mark(self, buffers: list[Any]) -> Any:
        """On CUDA, when any of ``buffers`` lives on this device: an event recorded on the calling
        thread's current stream, which the call's copies wait for (the caller may still be
        producing a source, or using a destination). None otherwise."""
        if not self.cuda or not any(getattr(getattr(b, "device", None), "type", None) == "cuda" for b in buffers):
            return None
        import torch

        return torch.cuda.current_stream(self.device).record_event()

    @contextmanager
    def copying(self, after: Any = None) -> Iterator[None]:
        """Run the copies made inside on the side stream (CUDA), after ``after`` (an event from
        ``caller_mark``), and wait for them on leaving. Without CUDA it does nothing."""
        if self._stream is None:
            yield
            return
        import torch

        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            yield
            done = self._stream.record_event()
        done.synchronize()  # the stream's work up to this copy: copies other threads queue later are not waited for

    def close(self) -> None:
        """Give the pool's memory back (to torch's caching allocator, where the engine can reuse it)."""
        self.memory = self.memory.new_empty(0)  # a view would keep the whole region alive


def open_device_tier(config: KVConfig, block_bytes: int) -> tuple[DeviceTier | None, str | None]:
    """The device tier ``config`` asks for, or None with the reason to warn about once.

    No budget (or one that holds no block): none, silently. ``device=None`` and no CUDA: none,
    with a note (the same configuration runs on a machine without a GPU). A device named
    explicitly that is not there: ``ConfigError`` (a machine that should have it is misconfigured,
    and silently serving without it would hide that)."""
    nslots = DeviceTier.slots_for(config.device_bytes, block_bytes)
    if nslots == 0:
        return None, None
    if config.device is None:
        torch = _torch()
        if torch is None or not torch.cuda.is_available():
            return None, (f"device_bytes={config.device_bytes} asks for a KV tier in accelerator memory, but CUDA is "
                          "not available: the device tier is off, serving from DRAM and below")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = _named_device(config.device)
    return DeviceTier(nslots, block_bytes, device), None


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _named_device(name: str) -> Any:
    torch = _torch()
    if torch is None:
        raise ConfigError(f"KV cache: device={name!r} needs torch, which is not installed")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"KV cache: device={name!r} is not a torch device name ({exc}); use \"cuda:0\" or "
                          "\"cpu\"") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"KV cache: device={name!r}: the device tier runs on CUDA devices (or \"cpu\" standing in "
                          "for one)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = torch.cuda.current_device() if device.index is None and count else device.index
    if index is None or index >= count:
        raise ConfigError(f"KV cache: device={name!r}, but this process sees {count} CUDA device(s): name one that "
                          "is there, or leave device=None to run without a device tier where CUDA is absent")
    return torch.device("cuda", index)


__all__ = ["DeviceTier", "open_device_tier"]
