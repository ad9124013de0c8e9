"""On-disk formats: safetensors-compatible shards and JSON manifests."""
