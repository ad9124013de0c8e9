"""Weight loading for serving: safetensors files, model directories and tierio checkpoints, local
or remote, into CPU or GPU tensors at disk bandwidth; a local NVMe cache in front of slow storage."""

from tierio.weights.cache import WeightCache
from tierio.weights.group import load_group
from tierio.weights.into import load_into
from tierio.weights.loader import first_use, inspect, load
from tierio.weights.options import LoadOptions
from tierio.weights.presharded import ShardReport, shard_model
from tierio.weights.sources import ModelSource, resolve
from tierio.weights.stats import LoadIntoResult, LoadStats
from tierio.weights.tp import Replicate, Split, TensorParallel

__all__ = ["load", "load_into", "inspect", "LoadOptions", "LoadStats", "LoadIntoResult", "WeightCache", "ModelSource", "resolve",
           "TensorParallel", "Split", "Replicate", "shard_model", "ShardReport", "first_use", "load_group"]
