"""Deprecated: the transformers KV integration is ``tierio.integrations.hf_kv`` now (docs/kv.md).
Every name is looked up there on first use, so importing this module stays as light as before it
needed torch; each use warns once per name."""

import importlib
import warnings
from typing import Any

_NEW = "tierio.integrations.hf_kv"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    # Lazy on purpose: the integration imports torch and transformers, heavy optional dependencies.
    value = getattr(importlib.import_module(_NEW), name)
    warnings.warn(f"tierio.kv.hf is deprecated, use {_NEW}", DeprecationWarning, stacklevel=2)
    return value
