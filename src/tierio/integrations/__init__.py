"""Adapters to the frameworks people train with, and metrics export (see docs/integrations.md).

Each adapter is its own module, imported on demand so that its framework stays optional:
``tierio.integrations.lightning`` (PyTorch Lightning), ``tierio.integrations.hf`` (Hugging Face
``Trainer``), ``tierio.integrations.torchtitan`` (torchtitan's checkpointer),
``tierio.integrations.metrics`` (Prometheus, also as ``tierio.metrics``).
"""
