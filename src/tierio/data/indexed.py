"""Megatron-LM compatible indexed token datasets: a ``.bin`` of tokens and an ``.idx`` index.

The layout is byte-for-byte Megatron-LM's ``MMIDIDX`` format (version 1), so files written here
are read by ``megatron.core.datasets.indexed_dataset.IndexedDataset`` and the other way round:

    .idx  b"MMIDIDX\\x00\\x00"   9 bytes magic
          <Q version = 1
          <B dtype code        (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
          <Q sequence count    N
          <Q document count    D  (= documents + 1: document_indices starts with 0)
          int32[N]  sequence lengths (tokens)
          int64[N]  sequence pointers (byte offset of each sequence in .bin)
          int64[D]  document indices (sequence index where each document ends, leading 0)
          int8[N]   sequence modes (multimodal datasets only)
    .bin  the tokens of every sequence, back to back, in the dtype above

The reader maps both files; items are zero-copy views of the ``.bin`` mapping. It checks the
whole index against the file sizes before trusting a single pointer, so a truncated or corrupt
pair fails with a FormatError naming the file instead of returning wrong tokens.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.io.checksum import StreamingChecksum
from tierio.io.files import os_error
from tierio.io.publish import PendingFile, finish_publish, publish, recover
from tierio.io.untrusted import parsing
from tierio.data.remote_pair import RemoteOptions, RemotePair, is_remote, open_pair
from tierio.data.idxformat import (  # noqa: F401  (the format's names, importable from here as before)
    DTYPE_CODES,
    HEADER_SIZE,
    IndexHeader,
    MAGIC,
    UINT16_VOCAB_LIMIT,
    VERSION,
    _CODE_OF,
    _Growable,
    bin_path,
    dtype_code,
    idx_path,
    index_parts,
    open_data_file,
    optimal_dtype,
    parse_header,
    read_header,
    strip_suffix,
    write_index,
)


class IndexedDatasetWriter:
    """Stream sequences into ``prefix.bin`` and write ``prefix.idx`` on ``finalize()``.

    Only the index (12 bytes per sequence) is kept in memory; tokens go straight to a temp file.
    The pair is published as one unit (io.publish): both files are written and synced under temp
    names first, so a failure anywhere (a full disk on the index, an exception, a kill) leaves the
    previous pair of that name intact, or the complete new one. Temps that killed builds left
    behind are removed when a writer starts. Use as a context manager: an exception removes the
    partial files.
    """

    def __init__(self, prefix: str | Path, dtype: Any = np.int32, multimodal: bool = False) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject dtypes Megatron cannot name, before writing anything
        self._bin_final, self._idx_final = bin_path(prefix), idx_path(prefix)
        try:
            self._bin_final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, self._bin_final.parent, "creating directory") from exc
        recover(self._idx_final, [self._bin_final, self._idx_final])
        self._bin = PendingFile(self._bin_final)
        self._pending = [self._bin]
        self._f = open(self._bin.fd, "wb", buffering=8 << 20, closefd=False)  # the lock stays with the fd
        self._lengths = _Growable(np.int32)
        self._docs = _Growable(np.int64)
        self._docs.append(0)
        self._modes = _Growable(np.int8) if multimodal else None
        self.tokens = 0
        self._done = False

    # -- adding data ---------------------------------------------------------------------
    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (call ``end_document()`` after the last sequence of a document)."""
        arr = self._as_tokens(tokens)
        self._write(arr)
        self._lengths.append(len(arr))
        if self._modes is not None:
            self._modes.append(mode)

    def end_document(self) -> None:
        self._docs.append(len(self._lengths))

    def add_document(self, tokens: Any, lengths: list[int] | None = None) -> None:
        """Append a document: one sequence, or several when ``lengths`` splits it."""
        arr = self._as_tokens(tokens)
        if lengths is None:
            lengths = [len(arr)]
        if sum(lengths) != len(arr):
            raise ConfigError(f"document lengths {lengths} do not add up to its {len(arr)} tokens")
        self._write(arr)
        self._lengths.extend(np.asarray(lengths, dtype=np.int32))
        if self._modes is not None:
            self._modes.extend(np.zeros(len(lengths), dtype=np.int8))
        self._docs.append(len(self._lengths))

    def add_documents(self, tokens: Any, lengths: Any) -> None:
        """Append many one-sequence documents at once: ``tokens`` concatenated, ``lengths`` each one's
        token count (a whole Parquet batch in one write instead of one call per document)."""
        arr = self._as_tokens(tokens)
        lens = np.asarray(lengths)
        if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
            raise ConfigError(f"document lengths must be a 1-D array of integers, got {lens.dtype} of shape {lens.shape}")
        if lens.size and (int(lens.min()) < 0 or int(lens.max()) > np.iinfo(np.int32).max):
            raise ConfigError("document lengths must be between 0 and 2**31-1 tokens")
        if int(lens.sum(dtype=np.int64)) != len(arr):
            raise ConfigError(f"document lengths add up to {int(lens.sum(dtype=np.int64))} tokens, not the {len(arr)} given")
        self._write(arr)
        base = len(self._lengths)
        self._lengths.extend(lens.astype(np.int32, copy=False))
        if self._modes is not None:
            self._modes.extend(np.zeros(len(lens), dtype=np.int8))
        self._docs.extend(np.arange(base + 1, base + len(lens) + 1, dtype=np.int64))

    def add_index(self, prefix: str | Path) -> None:
        """Append a whole existing dataset (same dtype); its .bin is copied in 8 MiB pieces."""
        other = IndexedDataset(prefix)
        try:
            if other.dtype != self.dtype:
                raise ConfigError(
                    f"cannot merge {other.prefix} ({other.dtype}) into a {self.dtype} dataset: "
                    "every input must have the same token dtype (rebuild with the same vocabulary size)"
                )
            if (other.sequence_modes is not None) != (self._modes is not None):
                raise ConfigError(f"cannot merge {other.prefix}: multimodal and plain datasets do not mix")
            base = len(self._lengths)
            self._lengths.extend(other.sequence_lengths)
            self._docs.extend(other.document_indices[1:] + base)
            if self._modes is not None:
                self._modes.extend(other.sequence_modes)
            flat = other.flat_tokens()
            step = (8 << 20) // self.dtype.itemsize
            for start in range(0, len(flat), step):
                self._write(flat[start : start + step])
        finally:
            other.close()

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ConfigError(f"a sequence must be a 1-D list of token ids, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and self.dtype.kind in "iu" and arr.dtype.kind in "iu":
                info = np.iinfo(self.dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise ConfigError(
                        f"token id {hi if hi > info.max else lo} does not fit {self.dtype} "
                        f"(range {info.min}..{info.max}); build with a larger --vocab-size or dtype int32"
                    )
            elif arr.size and arr.dtype.kind not in "iub":
                raise ConfigError(f"token ids must be integers, got {arr.dtype}")
            arr = arr.astype(self.dtype)
        return arr

    def _write(self, arr: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        try:
            self._f.write(data)
        except OSError as exc:
            raise os_error(exc, self._bin.path, "writing") from exc
        self.tokens += len(arr)

    # -- finishing -----------------------------------------------------------------------
    @property
    def sequences(self) -> int:
        return len(self._lengths)

    @property
    def documents(self) -> int:
        return len(self._docs) - 1

    def finalize(self, dtype: Any = None) -> Path:
        """Finish both files and publish the pair; returns the .idx path.

        ``dtype``: store the tokens in this (narrower) dtype instead, converted in one streaming
        pass before anything is published (every token id must fit it)."""
        if self._done:
            return self._idx_final
        if self._docs.view()[-1] != len(self._lengths):
            self.end_document()  # items added without end_document(): close the last document
        try:
            try:
                self._f.close()  # flushes the buffered tokens
            except OSError as exc:
                raise os_error(exc, self._bin.path, "writing") from exc
            if dtype is not None and np.dtype(dtype) != self.dtype:
                self._convert(np.dtype(dtype))
            idx = PendingFile(self._idx_final)
            self._pending.append(idx)
            modes = self._modes.view() if self._modes is not None else None
            for part in index_parts(self.dtype, self._lengths.view(), self._docs.view(), modes):
                idx.write(part)
            publish([self._bin, idx], self._idx_final)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self._idx_final

    def _convert(self, dtype: np.dtype) -> None:
        """Rewrite the written tokens as ``dtype`` into a new temp (8 MiB pieces), replacing the old temp."""
        dtype_code(dtype)
        out = PendingFile(self._bin_final)
        self._pending.append(out)
        if self.tokens:
            src = np.memmap(self._bin.path, dtype=self.dtype, mode="r", shape=(self.tokens,))
            info = np.iinfo(dtype) if dtype.kind in "iu" else None
            step = (8 << 20) // self.dtype.itemsize
            for start in range(0, self.tokens, step):
                piece = np.asarray(src[start : start + step])
                if info is not None and piece.size and (int(piece.min()) < info.min or int(piece.max()) > info.max):
                    raise ConfigError(f"token ids of {self.prefix} do not fit {dtype}; keep {self.dtype}")
                out.write(piece.astype(dtype))
            del src
        self._bin.discard()
        self._bin, self.dtype = out, dtype

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
        except OSError:
            pass
        for f in self._pending:
            f.discard()

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader of a Megatron ``.bin``/``.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a read-only numpy view of the mapping (no copy);
    ``ds.document(j)`` is every token of document ``j``. Pickles by path, so DataLoader
    workers re-open the mapping instead of copying it.
    """

    def __init__(self, prefix: str | Path, multimodal: bool | None = None, validate: bool = True, *,
                 remote: RemoteOptions | None = None) -> None:
        self.prefix = str(prefix) if is_remote(prefix) else strip_suffix(prefix)
        self._multimodal_arg = multimodal
        self._validate = validate
        self._remote = remote
        self._pair: RemotePair | None = None
        self._open()

    def _open(self) -> None:
        if is_remote(self.prefix):
            self._open_remote()
            return
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        finish_publish(ipath)  # a rebuild interrupted between its two renames: complete it first
        for p in (ipath, bpath):
            if not p.exists():
                raise NotFoundError(f"{p} does not exist: an indexed dataset needs both {ipath.name} and {bpath.name}")
        ifd = open_data_file(ipath, "opening index")
        try:
            bfd = open_data_file(bpath, "opening data file")
            try:
                with parsing(str(ipath)):
                    self._map_index(str(ipath), ifd, str(bpath), os.fstat(bfd).st_size)
                self._bin_map = self._map_bin(bfd)
            finally:
                os.close(bfd)
        finally:
            os.close(ifd)

    def _open_remote(self) -> None:
        """The pair on a store: the index from the node cache, the tokens mapped from it or by ranges."""
        pair = self._pair = open_pair(self.prefix, self._remote)
        try:
            ifd = open_data_file(pair.idx, "opening the cached index")
            try:
                with parsing(f"{pair.url}.idx"):
                    self._map_index(f"{pair.url}.idx", ifd, f"{pair.url}.bin", pair.bin_size)
            finally:
                os.close(ifd)
            if pair.ranges is not None:
                pair.ranges.dtype = self.dtype
                self._bin_map = pair.ranges
            else:
                bfd = open_data_file(pair.bin_path, "opening the cached data file")
                try:
                    self._bin_map = self._map_bin(bfd)
                finally:
                    os.close(bfd)
        except BaseException:
            pair.release()
            raise

    def _map_bin(self, bfd: int) -> np.ndarray:
        # mmap refuses empty files; an empty dataset gets an empty array instead
        size = os.fstat(bfd).st_size
        return np.frombuffer(mmap.mmap(bfd, size, access=mmap.ACCESS_READ), dtype=self.dtype) if size else np.empty(0, self.dtype)

    def _map_index(self, ipath: str, ifd: int, bpath: str, bin_size: int) -> None:
        """Check the index against the .bin's size (sizes first, nothing allocated from a count), then map it."""
        head = parse_header(os.pread(ifd, HEADER_SIZE, 0), ipath)
        n, d = head.sequence_count, head.document_count
        idx_size = os.fstat(ifd).st_size
        body = HEADER_SIZE + n * (4 + 8) + d * 8
        if idx_size < body:
            raise FormatError(
                f"{ipath}: index is {idx_size} bytes but its header announces {n} sequences and {d} document "
                f"entries ({body} bytes); the file is truncated, rebuild it"
            )
        multimodal = self._multimodal_arg
        if multimodal is None:
            multimodal = idx_size == body + n and n > 0
        expected = body + (n if multimodal else 0)
        if idx_size != expected:
            raise FormatError(f"{ipath}: index is {idx_size} bytes, expected {expected}; the file is corrupt or has trailing data")
        self.dtype = head.dtype
        self._idx_map = np.frombuffer(mmap.mmap(ifd, idx_size, access=mmap.ACCESS_READ), dtype=np.uint8)
        buf = self._idx_map
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=d, offset=off)
        off += 8 * d
        self.sequence_modes = np.frombuffer(buf, dtype=np.int8, count=n, offset=off) if multimodal else None

        itemsize = self.dtype.itemsize
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if n else 0
        if bin_size != end:
            what = "truncated" if bin_size < end else "longer than its index says"
            raise FormatError(
                f"{bpath}: data file is {bin_size} bytes but {Path(ipath).name} describes {end} bytes ({what}); "
                "the pair does not belong together or one of them is damaged"
            )
        if self._validate:
            self._check_index(ipath, itemsize)

    def _check_index(self, ipath: str, itemsize: int) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        n = len(lengths)
        if n and int(lengths.min()) < 0:
            raise FormatError(f"{ipath}: negative sequence length in index; the file is corrupt")
        if n:
            expect = np.empty(n, dtype=np.int64)
            expect[0] = 0
            np.cumsum(lengths[:-1], dtype=np.int64, out=expect[1:])
            expect *= itemsize
            if not np.array_equal(expect, pointers):
                bad = int(np.flatnonzero(expect != pointers)[0])
                raise FormatError(f"{ipath}: sequence pointer {bad} is {int(pointers[bad])}, expected {int(expect[bad])}; the index is corrupt")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n or (len(docs) > 1 and bool(np.any(np.diff(docs) < 0))):
            raise FormatError(
                f"{ipath}: document indices must rise from 0 to the sequence count {n}; the index is corrupt"
            )

    # -- pickling by path (DataLoader workers re-map instead of copying) ------------------
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "multimodal": self._multimodal_arg, "validate": False, "remote": self._remote}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._multimodal_arg = state["multimodal"]
        self._validate = state["validate"]
        self._remote = state.get("remote")
        self._pair = None
        self._open()

    def close(self) -> None:
        if self._pair is not None:
            self._pair.release()
        for name in ("_bin_map", "_idx_map"):
            m = getattr(self, name, None)
            mm = getattr(m, "base", None)
            if isinstance(mm, mmap.mmap):
                try:
                    mm.close()
                except (BufferError, ValueError):
                    pass  # a caller still holds a view; the mapping goes with it
        for name in ("sequence_lengths", "sequence_pointers", "document_indices", "sequence_modes", "_bin_map", "_idx_map"):
            self.__dict__.pop(name, None)

    # -- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin_map)

    @property
    def index_bytes(self) -> int:
        return len(self._idx_map)

    def flat_tokens(self) -> np.ndarray:
        """Every token of the dataset as one read-only 1-D view (the .bin mapping itself)."""
        return self._bin_map

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        i %= n
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._bin_map[start : start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        seq = self[i]
        return seq[offset : None if length is None else offset + length]

    def document(self, j: int) -> np.ndarray:
        """All tokens of document ``j`` (its sequences are contiguous in the .bin)."""
        d = self.num_documents
        if not 0 <= j < d:
            raise IndexError(f"document {j} out of range for {d} documents in {self.prefix}")
        a, b = int(self.document_indices[j]), int(self.document_indices[j + 1])
        if a == b:
            return self._bin_map[0:0]
        start = int(self.sequence_pointers[a]) // self.dtype.itemsize
        stop = int(self.sequence_pointers[b - 1]) // self.dtype.itemsize + int(self.sequence_lengths[b - 1])
        return self._bin_map[start:stop]

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (int64), computed from the index without touching the .bin."""
        csum = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=csum[1:])
        return csum[self.document_indices[1:]] - csum[self.document_indices[:-1]]

    def document_offsets(self) -> np.ndarray:
        """Token offset of each document's first token in the flat token array (int64)."""
        csum = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=csum[1:])
        return csum[self.document_indices[:-1]]

    def fingerprint(self) -> str:
        """xxh3 of the index: identifies this dataset for plans and resume states."""
        h = StreamingChecksum()
        h.update(memoryview(self._idx_map))
        return h.hexdigest()

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )
