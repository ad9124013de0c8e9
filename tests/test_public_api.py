"""The public API of ckpt, weights, data and kv follows one convention (docs/architecture.md, "One
convention for every capability"): an options dataclass with keyword overrides where a call has many
knobs, sizes as ``*_bytes`` that take ``"64KiB"``, one handle type, reports with ``to_dict()``, and
no public name that means two things in two capabilities."""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import inspect
import re
import typing
import warnings

import pytest

from tierio.handle import Handle
from tierio.options import Options

CAPABILITIES = ("ckpt", "weights", "data", "kv")
MAX_PARAMS = 6  # beyond an options object and its **overrides
# Parameters that are the options object itself (or the overrides applied to it).
OPTION_PARAMS = {"options", "config", "settings", "overrides"}
# A name a capability may share with another only where it means the same thing in both:
# ``inspect`` describes, read-only, what a location holds (a checkpoint directory, a model).
SHARED_MEANING = {"inspect"}
# Parameter names that hold a size in bytes but do not say so (counts such as batch_size are not sizes).
UNITLESS_SIZE = re.compile(r"(^|_)(size|budget|limit|capacity)$")
COUNTS = {"world_size", "vocab_size", "batch_size", "block_size", "block_tokens", "group_size"}


def unitless_size(name: str, annotation: object) -> bool:
    """A byte size under a name that hides its unit (a float ``budget`` is a fraction, not a size)."""
    text = str(annotation)
    return name not in COUNTS and bool(UNITLESS_SIZE.search(name)) and "float" not in text and "bool" not in text
REPORT_SUFFIXES = ("Stats", "Report", "Info", "Result")


def public(cap: str) -> list[tuple[str, object]]:
    mod = importlib.import_module(f"tierio.{cap}")
    return [(name, getattr(mod, name)) for name in mod.__all__]


def everything() -> list[tuple[str, str, object]]:
    return [(cap, name, obj) for cap in CAPABILITIES for name, obj in public(cap)]


def is_record(obj: object) -> bool:
    """A dataclass whose constructor is its fields (options, reports, keys): checked as data, not as a call."""
    return isinstance(obj, type) and dataclasses.is_dataclass(obj)


def call_params(obj: object) -> list[inspect.Parameter]:
    target = obj.__init__ if isinstance(obj, type) else obj
    params = list(inspect.signature(target).parameters.values())
    return [p for p in params if p.name not in ("self", "cls")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in OPTION_PARAMS]


def callables() -> list:
    """Every public call (function or class with a constructor of its own), as test params."""
    out = []
    for cap, name, obj in everything():
        if is_record(obj) or isinstance(obj, typing.NewType) or (
                isinstance(obj, type) and issubclass(obj, (enum.Enum, Exception))):
            continue  # data, a named value type (kv's BlockKey) or an enum: not a call with knobs
        if isinstance(obj, type) and (obj.__init__ is object.__init__ or obj.__module__ == "builtins"
                                      or any(b.__module__ == "builtins" and b is not object for b in obj.__mro__[1:])):
            continue  # no constructor of its own, or a value type such as a bytes key
        if callable(obj):
            out.append(pytest.param(cap, name, obj, id=f"{cap}.{name}"))
    return out


@pytest.mark.parametrize("cap,name,obj", callables())
def test_calls_take_few_parameters_beyond_options(cap, name, obj):
    params = call_params(obj)
    assert len(params) <= MAX_PARAMS, (
        f"tierio.{cap}.{name} takes {len(params)} parameters besides its options "
        f"({', '.join(p.name for p in params)}); move the knobs into an options dataclass")


@pytest.mark.parametrize("cap,name,obj", callables())
def test_call_sizes_are_bytes_and_take_text(cap, name, obj):
    for p in call_params(obj):
        assert not unitless_size(p.name, p.annotation), f"tierio.{cap}.{name}({p.name}=…): name sizes *_bytes"
        if p.name.endswith("_bytes"):
            assert "str" in str(p.annotation), f"tierio.{cap}.{name}({p.name}) must accept text such as '64KiB'"


def options_classes() -> list[tuple[str, str, type]]:
    return [(cap, name, obj) for cap, name, obj in everything()
            if isinstance(obj, type) and issubclass(obj, Options)]


def test_every_capability_has_an_options_class():
    have = {cap for cap, _, _ in options_classes()}
    assert have == set(CAPABILITIES), f"no Options subclass exported by {sorted(set(CAPABILITIES) - have)}"


@pytest.mark.parametrize("cap,name,cls", options_classes(), ids=lambda v: v if isinstance(v, str) else "")
def test_option_sizes_take_text(cap, name, cls):
    for f in dataclasses.fields(cls):
        assert not unitless_size(f.name, f.type), f"{name}.{f.name}: name sizes *_bytes"
        if f.name.endswith("_bytes"):
            assert "str" in str(f.type), f"{name}.{f.name} must be declared to take text such as '64KiB'"
            # The parsing Options does for every *_bytes field (apart from the class's own checks,
            # which may want other fields set with it).
            opts = copy.copy(cls())
            object.__setattr__(opts, f.name, "64KiB")
            Options.__post_init__(opts)
            assert getattr(opts, f.name) == 64 * 1024, f"{name}.{f.name}='64KiB' was not read as 65536"


@pytest.mark.parametrize("cap,name,cls", options_classes(), ids=lambda v: v if isinstance(v, str) else "")
def test_options_refuse_unknown_and_map_old_names(cap, name, cls):
    from tierio.errors import ConfigError

    with pytest.raises(ConfigError, match="no_such_knob"):
        cls().with_overrides(no_such_knob=1)
    for old, new in cls.ALIASES.items():
        value = getattr(cls(), new)
        with pytest.warns(DeprecationWarning, match=old):
            assert getattr(cls().with_overrides({old: value}), new) == value


def test_reports_have_to_dict():
    for cap, name, obj in everything():
        if isinstance(obj, type) and name.endswith(REPORT_SUFFIXES):
            assert callable(getattr(obj, "to_dict", None)), f"tierio.{cap}.{name} has no to_dict()"


def test_background_work_is_a_handle():
    handles = [(cap, name, obj) for cap, name, obj in everything()
               if isinstance(obj, type) and (name.endswith("Handle") or name == "Pending")]
    assert handles, "no handle type exported"
    for cap, name, obj in handles:
        assert issubclass(obj, Handle), f"tierio.{cap}.{name} is not a tierio.handle.Handle"


def test_no_public_name_means_two_things():
    seen: dict[str, str] = {}
    for cap, name, _ in everything():
        if name in seen and name not in SHARED_MEANING:
            pytest.fail(f"{name!r} is public in both tierio.{seen[name]} and tierio.{cap}")
        seen.setdefault(name, cap)


@pytest.mark.parametrize("cap,old,new", [("kv", "Tier", "KVTier"), ("data", "Manifest", "ShardManifest")])
def test_renamed_names_still_import_with_a_warning(cap, old, new):
    mod = importlib.import_module(f"tierio.{cap}")
    assert old not in mod.__all__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(mod, old) is getattr(mod, new)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
