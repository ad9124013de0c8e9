"""Copying a save's tensors into staging buffers (``Stager``): the one step both a plain save
(``ckpt.saving.job``) and a save copied behind the caller (``ckpt.saving.overlap``) share."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from tierio.format.shard import ShardLayout, stage_into
from tierio.io.buffers import HostBuffer


class Stager:
    """Copies tensors into staging buffers: CPU tensors with torch's parallel copy, CUDA tensors on
    a side stream (one per manager, made on first use)."""

    def __init__(self) -> None:
        self._stream = None

    def stage(self, layout: ShardLayout, tensors: dict[str, torch.Tensor], buf: HostBuffer,
              names: Collection[str] | None = None, header: bool = True, after: Any = None) -> None:
        """Stage ``names`` (default all) and the header. A device copy starts after ``after`` (a CUDA
        event recorded where the tensors were produced; default: the calling thread's stream)."""
        stream = None
        if any(t.is_cuda for n, t in tensors.items() if names is None or n in names) and torch.cuda.is_available():
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            stage_into(layout, tensors, buf.tensor(), stream, names, header)
        if stream is not None:
            stream.synchronize()
