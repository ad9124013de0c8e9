"""The shared tier: blocks written by one node are found, verified and used by another, through a
shared directory or a real S3 server; a damaged or substituted object is a miss."""

from __future__ import annotations

import pytest

from kv_helpers import assert_clean, cache, put_chain, read_back, tokens
from tierio.kv import KVTier
from tierio.kv.tiers.shared import object_key


def _two_nodes(tmp_path, url):
    a = cache(tmp_path / "node-a", dram_blocks=8, admit_uses=1, shared_url=url)
    b = cache(tmp_path / "node-b", dram_blocks=8, admit_uses=1, shared_url=url)
    return a, b


def _share_and_read(tmp_path, url):
    a, b = _two_nodes(tmp_path, url)
    try:
        chains = [a.hash_blocks(tokens(3, seed=j)) for j in range(3)]
        for keys in chains:
            put_chain(a, keys)
        a.flush()  # written down to node a's NVMe, and uploaded
        assert a.stats().counters.uploaded == 9
        hit = b.lookup(chains[0])
        assert (hit.blocks, hit.tiers) == (3, [KVTier.SHARED] * 3)
        assert read_back(b, chains[0]) == (3, [KVTier.SHARED] * 3)
        res = b.prefetch(chains[1]).result()
        assert res.moved == 3
        assert read_back(b, chains[1]) == (3, [KVTier.DRAM] * 3)
        assert b.stats().counters.served_shared == 3
        assert_clean(a)
        assert_clean(b)
        return chains
    finally:
        a.close()
        b.close()


def test_a_shared_directory_carries_blocks_between_nodes(tmp_path):
    shared = tmp_path / "shared"
    chains = _share_and_read(tmp_path, str(shared))
    # a damaged object, and an object holding another block under this one's name: both misses
    victim = shared / object_key(chains[2][0])
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0xFF
    victim.write_bytes(bytes(raw))
    (shared / object_key(chains[0][1])).write_bytes((shared / object_key(chains[0][2])).read_bytes())
    c = cache(tmp_path / "node-c", dram_blocks=8, shared_url=str(shared))
    try:
        assert read_back(c, chains[2]) == (0, [])
        assert read_back(c, chains[0]) == (1, [KVTier.SHARED])
        assert c.stats().counters.integrity_errors == 2
        assert c.prefetch(chains[2]).result().failed >= 1
        assert_clean(c)
    finally:
        c.close()


@pytest.mark.s3
def test_an_s3_bucket_carries_blocks_between_nodes(tmp_path, s3_url):
    _share_and_read(tmp_path, s3_url)
