"""Exact strided reads (io.gather): every piece lands byte for byte, on a disk by O_DIRECT (native
AIO and threads) widened only to the logical block, on tmpfs buffered and exactly; the bytes
counted are the requests as asked; a tensor-parallel rank read exactly equals the whole model cut."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tierio.io.gather import gather, logical_block
from tierio.io.pagecache import evict
from tierio.weights import LoadStats, Split, TensorParallel, load

SHM = Path("/dev/shm")


def _dirs(tmp_path: Path) -> list[tuple[Path, bool]]:
    """(directory, on a block device) pairs: the test's directory, and tmpfs where there is one."""
    out = [(tmp_path, os.path.exists(f"/sys/dev/block/{os.major(os.stat(tmp_path).st_dev)}:"
                                     f"{os.minor(os.stat(tmp_path).st_dev)}"))]
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        d = SHM / f"tierio-gather-{os.getpid()}-{tmp_path.name}"
        d.mkdir()
        out.append((d, False))
    return out


def _widened(pieces: np.ndarray, block: int) -> int:
    """Bytes of the pieces widened to ``block``, pieces sharing a block counted once (by hand)."""
    covered: set[int] = set()
    for off, n, _ in pieces.tolist():
        covered.update(range(off // block, -(-(off + n) // block)))
    return len(covered) * block


@pytest.mark.parametrize("use_aio", [True, False])
def test_gather_lands_every_piece_and_counts_the_requests(tmp_path, use_aio):
    rng = np.random.default_rng(7)
    size = (1 << 20) + 777
    data = rng.integers(0, 256, size, dtype=np.uint8)
    # rows of a dim-1 slice at an offset off the 512-byte grid, irregular pieces (some sharing a
    # block, one larger than a scratch batch), and a piece that ends with the file
    rows = np.array([(1003 + i * 8192 + 2048, 2048, i * 2048) for i in range(100)], dtype=np.int64)
    offs = np.sort(rng.choice(size - 3000, 60, replace=False))
    lens = np.minimum(rng.integers(1, 3000, 60), np.diff(np.append(offs, size - 700)))
    loose = np.stack([offs, lens, np.cumsum(lens) - lens], 1).astype(np.int64)
    big = np.array([[5, size - 900, 0]], dtype=np.int64)
    tail = np.array([[size - 700, 700, 0]], dtype=np.int64)
    for d, on_disk in _dirs(tmp_path):
        try:
            f = d / "blob"
            data.tofile(f)
            for pieces in (rows, loose, big, tail):
                evict(f)  # cold: the disk path reads by O_DIRECT
                dest = np.zeros(int(pieces[:, 1].sum()), np.uint8)
                got = gather(f, pieces, dest, use_aio=use_aio)
                want = np.concatenate([data[o : o + n] for o, n, _ in pieces.tolist()])
                assert np.array_equal(dest, want), (d, pieces[:3])
                if on_disk and got.direct:
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        block = logical_block(fd)
                    finally:
                        os.close(fd)
                    assert got.requested_bytes == _widened(pieces, block)
                else:
                    assert not got.direct and got.requested_bytes == int(pieces[:, 1].sum())
            if on_disk:
                assert gather(f, rows, np.zeros(204800, np.uint8), use_aio=use_aio).requested_bytes <= 1.25 * 204800
        finally:
            if d != tmp_path:
                for p in d.iterdir():
                    p.unlink()
                d.rmdir()


def test_gather_names_the_file_when_it_is_shorter_than_the_pieces(tmp_path):
    f = tmp_path / "short"
    np.zeros(5000, np.uint8).tofile(f)
    with pytest.raises(Exception, match=r"short.*truncated"):
        gather(f, np.array([[4096, 2000, 0]], dtype=np.int64), np.zeros(2000, np.uint8))


def test_a_rank_read_exactly_equals_the_whole_model_cut(tmp_path):
    """Row-parallel (dim 1) and fused q/k/v (three ranges along dim 0) slices, read exactly
    (slice_gap_bytes=0) on a disk and on tmpfs, equal the whole tensors cut by hand."""
    g = torch.Generator().manual_seed(3)
    t = {"o": torch.randn(64, 1024, generator=g).to(torch.bfloat16),      # rows of 2 KiB, pieces of 512 B
         "down": torch.randn(48, 3584, generator=g).to(torch.bfloat16),   # pieces of 1792 B, off the 512 grid
         "qkv": torch.randn(96 + 2 * 32, 40, generator=g).to(torch.bfloat16),
         "norm": torch.randn(1000)}
    rules = [("^(o|down)$", Split(1)), ("^qkv$", Split(0, (96, 32, 32)))]
    for d, _ in _dirs(tmp_path):
        try:
            save_file(t, str(d / "m.safetensors"))
            for rank in range(4):
                evict(d / "m.safetensors")
                st = LoadStats()
                got = load(d / "m.safetensors", shard=TensorParallel(rank, 4, rules), slice_gap_bytes=0, stats=st)
                want = {"o": t["o"][:, rank * 256 : (rank + 1) * 256], "down": t["down"][:, rank * 896 : (rank + 1) * 896],
                        "qkv": torch.cat([t["qkv"][rank * 24 : (rank + 1) * 24], t["qkv"][96 + rank * 8 : 96 + (rank + 1) * 8],
                                          t["qkv"][128 + rank * 8 : 128 + (rank + 1) * 8]]),
                        "norm": t["norm"]}
                for k, v in want.items():
                    assert torch.equal(got[k], v.contiguous()), (d, rank, k)
                useful = sum(v.numel() * v.element_size() for v in want.values())
                # each of the 64 + 48 + 3 strided pieces widened by less than 512 B at either end, the
                # replicated norm's range started on the 4 KiB grid (the 4 KiB grid would read all of o)
                assert useful <= st.bytes < useful + 115 * 1024 + 4096, (d, rank, st.bytes, useful)
        finally:
            if d != tmp_path:
                (d / "m.safetensors").unlink()
                d.rmdir()


def test_native_aio_reads_pieces_and_reports_a_misaligned_one_as_its_own_error(tmp_path):
    """io.aio: aligned O_DIRECT reads land where asked; one off the block grid fails alone with
    -EINVAL (what io.gather takes as the file system wanting 4 KiB), the others still land."""
    from tierio.io import aio
    from tierio.io.buffers import HostBuffer, address_of

    if not aio.available():
        pytest.skip("no native AIO on this machine")
    data = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
    f = tmp_path / "aio"
    data.tofile(f)
    try:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        buf = HostBuffer(3 * 4096, pin=False)
        base = address_of(buf.array)
        offsets = np.array([0, 8192, 4096 + 3], dtype=np.int64)
        got = aio.thread_context(8).read(fd, offsets, np.full(3, 4096), base + np.arange(3, dtype=np.uint64) * 4096)
    finally:
        os.close(fd)
    assert got.tolist()[:2] == [4096, 4096] and got[2] == -errno.EINVAL
    assert np.array_equal(buf.array[:4096], data[:4096]) and np.array_equal(buf.array[4096:8192], data[8192:12288])
