"""The one shape of a capability's options: a frozen dataclass, keyword overrides on top of it,
sizes as ``*_bytes`` fields that take ``int`` or text such as ``"64GiB"``, and old field names
kept as deprecated aliases for one release.

Every capability (``CheckpointOptions``, ``LoadOptions``, ``StreamingOptions``, ``KVConfig`` …)
subclasses ``Options``; its entry point takes ``options=`` plus ``**overrides`` and calls
``Options.resolve``. Convention written down in docs/architecture.md ("One convention")."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

from tierio.errors import ConfigError
from tierio.units import parse_size

O = TypeVar("O", bound="Options")


@dataclass(frozen=True)
class Options:
    """Base of every options record. ``ALIASES`` maps a deprecated keyword to its new field name."""

    ALIASES: ClassVar[dict[str, str]] = {}
    # What the user called, for messages ("unknown CheckpointManager option(s) ..."); default the class name.
    LABEL: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        # Sizes are normalised once, here, so every reader of the options sees plain ints.
        for f in fields(self):
            if f.name.endswith("_bytes"):
                value = getattr(self, f.name)
                if isinstance(value, str):
                    object.__setattr__(self, f.name, parse_size(value))

    def with_overrides(self: O, overrides: dict[str, Any] | None = None, **more: Any) -> O:
        """These options with keyword overrides applied (deprecated names warn and map to the new ones)."""
        given = {**(overrides or {}), **more}
        if not given:
            return self
        known = {f.name for f in fields(self)}
        mapped: dict[str, Any] = {}
        for name, value in given.items():
            new = self.ALIASES.get(name)
            if new is not None and name not in known:
                warnings.warn(f"{self.LABEL or type(self).__name__}: {name!r} is deprecated, use {new!r}",
                              DeprecationWarning, stacklevel=3)
                name = new
            mapped[name] = value
        unknown = sorted(set(mapped) - known)
        if unknown:
            raise ConfigError(f"unknown {self.LABEL or type(self).__name__} option(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return replace(self, **mapped)

    @classmethod
    def resolve(cls: type[O], options: O | None, overrides: dict[str, Any] | None = None) -> O:
        """``options`` (or the defaults) with ``overrides`` applied: what an entry point calls."""
        if options is not None and not isinstance(options, cls):
            raise ConfigError(f"options must be a {cls.__name__}, got {type(options).__name__}")
        return (options if options is not None else cls()).with_overrides(overrides)
