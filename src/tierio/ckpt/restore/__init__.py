"""Restoring: which step and copy, the restore plan, resharding, mapped tensors."""
