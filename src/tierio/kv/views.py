"""Callers hand blocks over as numpy arrays, torch tensors (CPU or accelerator) or plain buffers;
the tiers move bytes. These helpers turn one into the other without copying, and copy between
host memory and an accelerator where a block lives on one.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from tierio.errors import ConfigError


def is_device_tensor(buf: Any) -> bool:
    """A torch tensor that lives outside host memory (CUDA and the like)."""
    device = getattr(buf, "device", None)
    return device is not None and getattr(device, "type", "cpu") != "cpu" and hasattr(buf, "detach")


def host_bytes(buf: Any, nbytes: int, what: str, *, writable: bool) -> np.ndarray:
    """A flat uint8 view (no copy) of the first ``nbytes`` of a host buffer: numpy array, CPU torch
    tensor, memoryview, bytes or bytearray. It must be contiguous and at least ``nbytes`` long."""
    if hasattr(buf, "detach"):  # torch.Tensor (CPU): view as bytes first, numpy has no bfloat16
        t = buf.detach()
        if not t.is_contiguous():
            raise ConfigError(f"{what} is a non-contiguous tensor; pass a contiguous one (tensor.contiguous())")
        import torch

        arr = t.reshape(-1).view(torch.uint8).numpy()
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ConfigError(f"{what} is a non-contiguous array; pass a contiguous one (np.ascontiguousarray)")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
        except TypeError as exc:
            raise ConfigError(f"{what} is not a buffer ({type(buf).__name__}): pass a numpy array, a tensor or bytes") from exc
    if arr.size < nbytes:
        raise ConfigError(f"{what} holds {arr.size} bytes; a block is {nbytes} bytes")
    if writable and not arr.flags.writeable:
        raise ConfigError(f"{what} is read-only; gets need a writable destination")
    return arr[:nbytes]


def device_bytes(t: Any, nbytes: int, what: str):
    """A flat uint8 view of an accelerator tensor (contiguous, at least ``nbytes``)."""
    import torch

    if not t.is_contiguous():
        raise ConfigError(f"{what} is a non-contiguous tensor; pass a contiguous one")
    flat = t.detach().reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ConfigError(f"{what} holds {flat.numel()} bytes; a block is {nbytes} bytes")
    return flat[:nbytes]


def split(out: Any, count: int, nbytes: int, what: str) -> list[Any]:
    """``count`` per-block buffers: ``out`` is either a sequence of them or one buffer holding the
    blocks back to back (then it is sliced, not copied)."""
    if isinstance(out, (list, tuple)):
        if len(out) < count:
            raise ConfigError(f"{what}: {len(out)} buffers for {count} blocks")
        return list(out[:count])
    if is_device_tensor(out):
        flat = device_bytes(out, count * nbytes, what)
        return [flat[i * nbytes:(i + 1) * nbytes] for i in range(count)]
    flat = host_bytes(out, count * nbytes, what, writable=False)
    return [flat[i * nbytes:(i + 1) * nbytes] for i in range(count)]


def torch_bytes(buf: Any, nbytes: int, what: str, *, writable: bool):
    """A flat torch.uint8 view (no copy) of any caller buffer: a device tensor as it is, anything
    in host memory through ``host_bytes``."""
    if is_device_tensor(buf):
        return device_bytes(buf, nbytes, what)
    import torch

    arr = host_bytes(buf, nbytes, what, writable=writable)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():  # torch warns that it cannot protect read-only memory: it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def copy_out(dst: Any, src: Any, what: str) -> None:
    """Copy one block out of a tier's slot ``src`` into a caller's buffer (host or accelerator).
    ``src`` is a numpy view of host memory, or a torch view of a device tier's pool (its copies
    run inside ``DeviceTier.copying``)."""
    if not isinstance(src, np.ndarray):
        torch_bytes(dst, src.numel(), what, writable=True).copy_(src, non_blocking=True)
        return
    if isinstance(dst, np.ndarray):  # already checked (host_bytes): the common case, kept cheap
        np.copyto(dst, src)
        return
    if is_device_tensor(dst):
        import torch

        # Host tiers are pinned where CUDA exists, so this copy can run without staging.
        device_bytes(dst, src.size, what).copy_(torch.from_numpy(src), non_blocking=False)
        return
    np.copyto(host_bytes(dst, src.size, what, writable=True), src)  # numpy releases the GIL for the copy


def copy_in(dst: Any, src: Any, what: str) -> None:
    """Copy one block from a caller's buffer (host or accelerator) into a tier's slot ``dst``
    (a numpy view of host memory, or a torch view of a device tier's pool)."""
    if not isinstance(dst, np.ndarray):
        dst.copy_(torch_bytes(src, dst.numel(), what, writable=False), non_blocking=True)
        return
    if isinstance(src, np.ndarray):
        np.copyto(dst, src)
        return
    if is_device_tensor(src):
        import torch

        torch.from_numpy(dst).copy_(device_bytes(src, dst.size, what), non_blocking=False)
        return
    np.copyto(dst, host_bytes(src, dst.size, what, writable=False))


__all__ = ["copy_in", "copy_out", "device_bytes", "host_bytes", "is_device_tensor", "split", "torch_bytes"]
