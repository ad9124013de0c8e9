"""The bin-packing of one window of documents into sequences of ``seq_len`` tokens (best-fit and
first-fit decreasing): pure functions on arrays of lengths, which ``plan_packing`` runs window by window."""

from __future__ import annotations

import bisect

import numpy as np


def _groups(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Order of items by decreasing length (ties by position) and the (length, count) groups."""
    # radix-friendly key: a stable argsort of (seq_len - length) in the narrowest dtype
    key_dtype = np.uint16 if seq_len < (1 << 16) else np.uint32
    order = np.argsort((seq_len - lengths).astype(key_dtype), kind="stable")
    counts = np.bincount(lengths, minlength=seq_len + 1)
    present = np.flatnonzero(counts)[::-1]
    return order, [(int(L), int(counts[L])) for L in present]


def bfd_window(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing over one window. Returns (bin of each item, number of bins)."""
    order, groups = _groups(lengths, seq_len)
    S = seq_len
    buckets: list[list[int]] = [[] for _ in range(S + 1)]  # open bins by remaining capacity
    nz: list[int] = []  # sorted capacities (> 0) whose bucket is non-empty
    place_bins: list[int] = []  # bins in placement order ...
    place_k: list[int] = []  # ... and how many consecutive items each received
    nbins = 0
    for L, c in groups:
        rem = c
        moved: list[tuple[int, list[int]]] = []
        i = bisect.bisect_left(nz, L)
        j = i
        while rem and j < len(nz):
            r = nz[j]
            k = r // L
            ids = buckets[r]
            m = len(ids)
            if m * k <= rem:  # every bin of this bucket fills up to r mod L
                rem -= m * k
                place_bins.extend(ids)
                place_k.extend([k] * m)
                moved.append((r - k * L, ids))
                buckets[r] = []
                j += 1
                continue
            nfull, last = divmod(rem, k)
            use = ids[:nfull]
            place_bins.extend(use)
            place_k.extend([k] * nfull)
            moved.append((r - k * L, use))
            taken = nfull
            if last:
                b = ids[nfull]
                place_bins.append(b)
                place_k.append(last)
                moved.append((r - last * L, [b]))
                taken += 1
            buckets[r] = ids[taken:]
            if not buckets[r]:
                j += 1
            rem = 0
        del nz[i:j]
        if rem:  # no open bin fits: open new ones, each taking floor(S / L) items
            k = S // L
            nnew = -(-rem // k)
            new = range(nbins, nbins + nnew)
            nbins += nnew
            last = rem - (nnew - 1) * k
            place_bins.extend(new)
            place_k.extend([k] * (nnew - 1))
            place_k.append(last)
            if nnew > 1:
                moved.append((S - k * L, list(new[:-1])))
            moved.append((S - last * L, [new[-1]]))
        for cap, ids in moved:
            if cap <= 0 or not ids:
                continue  # a full bin is closed for good
            dest = buckets[cap]
            if not dest:
                bisect.insort(nz, cap)
            dest.extend(ids)
    sorted_bins = np.repeat(np.asarray(place_bins, dtype=np.int64), np.asarray(place_k, dtype=np.int64))
    bin_of = np.empty(len(lengths), dtype=np.int64)
    bin_of[order] = sorted_bins
    return bin_of, nbins


def ffd_window(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """First-fit decreasing over one window (bins scanned in creation order)."""
    order, groups = _groups(lengths, seq_len)
    S = seq_len
    caps = np.empty(max(1, int(lengths.sum()) // S + len(groups) + 1), dtype=np.int64)
    nbins = 0
    parts_bins: list[np.ndarray] = []
    parts_k: list[np.ndarray] = []
    for L, c in groups:
        rem = c
        cand = np.flatnonzero(caps[:nbins] >= L)
        if len(cand):
            k = caps[cand] // L
            cs = np.cumsum(k)
            j = int(np.searchsorted(cs, c))
            if j < len(cand):
                used = cand[: j + 1]
                take = k[: j + 1].copy()
                take[j] = c - (int(cs[j - 1]) if j else 0)
            else:
                used, take = cand, k
            caps[used] -= take * L
            rem -= int(take.sum())
            parts_bins.append(used)
            parts_k.append(take)
        if rem:
            k = S // L
            nnew = -(-rem // k)
            if nbins + nnew > len(caps):
                caps = np.resize(caps, 2 * (nbins + nnew))
            take = np.full(nnew, k, dtype=np.int64)
            take[-1] = rem - (nnew - 1) * k
            new = np.arange(nbins, nbins + nnew)
            caps[new] = S - take * L
            nbins += nnew
            parts_bins.append(new)
            parts_k.append(take)
    if not parts_bins:
        return np.empty(0, dtype=np.int64), 0
    sorted_bins = np.repeat(np.concatenate(parts_bins), np.concatenate(parts_k))
    bin_of = np.empty(len(lengths), dtype=np.int64)
    bin_of[order] = sorted_bins
    return bin_of, nbins
