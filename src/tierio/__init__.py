"""tierio: the storage and I/O layer of AI training and serving."""

from tierio._version import __version__

__all__ = ["__version__"]
