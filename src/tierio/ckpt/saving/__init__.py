"""Saving: staging a rank's state, overlapped copies, incremental shards, persisting to tier 0."""
