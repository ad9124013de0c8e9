"""The places a KV block can live, each a fixed set of equal slots cut once from memory or disk:
``device`` (an optional pool in accelerator memory), ``dram`` (host memory), ``slab`` (local NVMe
slab files, with their on-disk index in ``slabindex``) and ``shared`` (objects in a tierio store).
``slots`` holds the free-slot bookkeeping they share. Tiers move bytes; which block is where is the
ledger's (``tierio.kv.ledger``)."""
