"""Weight loading for serving: safetensors files, model directories and tierio checkpoints, local
or remote, into CPU or GPU tensors at disk bandwidth; a local NVMe cache in front of slow storage."""

from tierio.weights.cache import WeightCache
from tierio.weights.loader import LoadIntoResult, LoadStats, inspect, load, load_into
from tierio.weights.sources import ModelSource, resolve

__all__ = ["load", "load_into", "inspect", "LoadStats", "LoadIntoResult", "WeightCache", "ModelSource", "resolve"]
