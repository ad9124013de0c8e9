"""Weight loading for serving: safetensors files, model directories and tierio checkpoints, local
or remote, into CPU or GPU tensors at disk bandwidth; a local NVMe cache in front of slow storage."""

from tierio.weights.cache import WeightCache
from tierio.weights.loader import inspect, load, load_into
from tierio.weights.options import LoadOptions
from tierio.weights.sources import ModelSource, resolve
from tierio.weights.stats import LoadIntoResult, LoadStats

__all__ = ["load", "load_into", "inspect", "LoadOptions", "LoadStats", "LoadIntoResult", "WeightCache", "ModelSource", "resolve"]
