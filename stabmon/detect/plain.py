"""Detector statistics as plain values: what a checkpoint holds of a detector loads with
``torch.load(weights_only=True)``, and loading it runs no code.

:func:`dump` writes a detector's statistics (river's running statistics, windows, counters) as numbers, strings,
lists and dicts, tagged where the type matters (``{"~": "deque", "v": [...], "maxlen": 50}``); an object is
written as its attributes, and only a class on the allow list (:data:`CLASSES`) can be written or read back.
river's compiled statistics are written as their constructor arguments and the bytes of their own state, which
their own code parses back (numbers, never code). :func:`load` reads it back: nothing in it can name a function
to call or a class off the list. A type that is not plain and not on the list is a ``TypeError`` when the
state is written, so a new detector cannot add an unreadable state silently (the contract suite writes and reads
every detector's).

>>> from collections import deque
>>> import river.stats
>>> m = river.stats.EWMean(0.5); m.update(2.0); m.update(4.0)
>>> state = dump({"window": deque([1.0, 2.0], maxlen=3), "pair": (1, "a"), "mean": m})
>>> state["window"], state["pair"]
({'~': 'deque', 'v': [1.0, 2.0], 'maxlen': 3}, {'~': 'tuple', 'v': [1, 'a']})
>>> back = load(state); back["window"], back["pair"], back["mean"].get() == m.get()
(deque([1.0, 2.0], maxlen=3), (1, 'a'), True)
"""

from __future__ import annotations

import collections
import importlib
from typing import Any

TAG = "~"

CLASSES: tuple[str, ...] = (
    "river.stats.ewmean.EWMean",
    "river.stats.ewvar.EWVar",
    "river.stats.mean.Mean",
    "river.stats.var.Var",
    "river.stats.quantile.Quantile",
    "river.stats.quantile.RollingQuantile",
    "river.stats.iqr.IQR",
    "river.stats.iqr.RollingIQR",
    "river.drift.page_hinkley.PageHinkley",
    "stabmon.detect.window.Cadence",
    "stabmon.detect.window.Noise",
)
"""The Python classes whose objects a detector's statistics may hold (written as their attributes)."""

COMPILED: tuple[str, ...] = (
    "river._river_rust.stats.RsEWMean",
    "river._river_rust.stats.RsEWVar",
    "river._river_rust.stats.RsQuantile",
    "river._river_rust.stats.RsRollingQuantile",
    "river._river_rust.stats.RsIQR",
    "river._river_rust.stats.RsRollingIQR",
)
"""river's compiled statistics: written as their constructor arguments and their own state bytes."""

_PLAIN = (type(None), bool, int, float, str, bytes)
MAX_ARG = 10_000_000
"""The largest constructor argument (a window length) a compiled statistic is rebuilt with."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_CACHE: dict[str, type | None] = {}


def _class(name: str, allowed: tuple[str, ...]) -> Any:
    """The allowed class ``name`` (imported from its module; nothing else is ever imported)."""
    if name not in allowed:
        raise ValueError(f"detector state names class {name!r}, which is not on stabmon's allow list")
    if name not in _CACHE:
        module, _, qualname = name.rpartition(".")
        try:
            _CACHE[name] = getattr(importlib.import_module(module), qualname)
        except (ImportError, AttributeError):
            _CACHE[name] = None
    cls = _CACHE[name]
    if cls is None:
        raise ValueError(f"detector state names class {name!r}, which this installation does not have")
    return cls


def dump(obj: Any) -> Any:
    """``obj`` as plain values (see the module docstring); ``TypeError`` for a type it cannot write."""
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, list):
        return [dump(x) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: dump(v) for k, v in obj.items()}
        return {TAG: "dict", "v": [[dump(k), dump(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {TAG: "tuple", "v": [dump(x) for x in obj]}
    if isinstance(obj, (set, frozenset)):
        return {TAG: type(obj).__name__, "v": [dump(x) for x in obj]}
    if isinstance(obj, collections.deque):
        return {TAG: "deque", "v": [dump(x) for x in obj], "maxlen": obj.maxlen}
    name = _name(type(obj))
    if name in COMPILED:
        return {TAG: "compiled", "cls": name, "args": dump(obj.__getnewargs__()), "state": obj.__getstate__()}
    if name in CLASSES:
        attrs = {}
        for key, value in vars(obj).items():
            if getattr(value, "__self__", None) is obj and hasattr(value, "__func__"):
                attrs[key] = {TAG: "method", "name": value.__func__.__name__}  # a method of its own (river's)
            else:
                attrs[key] = dump(value)
        return {TAG: "object", "cls": name, "v": attrs}
    raise TypeError(f"cannot write a {name} as plain detector state (add its class to stabmon.detect.plain)")


def load(data: Any) -> Any:
    """What :func:`dump` wrote, back as objects; ``ValueError`` for anything else."""
    if isinstance(data, _PLAIN):
        return data
    if isinstance(data, list):
        return [load(x) for x in data]
    if not isinstance(data, dict):
        raise ValueError(f"detector state holds a {type(data).__name__}, which stabmon never writes")
    tag = data.get(TAG)
    if tag is None:
        return {k: load(v) for k, v in data.items()}
    if tag == "dict":
        return {load(k): load(v) for k, v in data["v"]}
    if tag == "tuple":
        return tuple(load(x) for x in data["v"])
    if tag == "set":
        return {load(x) for x in data["v"]}
    if tag == "frozenset":
        return frozenset(load(x) for x in data["v"])
    if tag == "deque":
        maxlen = data["maxlen"]
        return collections.deque((load(x) for x in data["v"]), maxlen=None if maxlen is None else int(maxlen))
    if tag == "compiled":
        cls = _class(str(data["cls"]), COMPILED)
        args = load(data["args"])
        state = data["state"]
        if not isinstance(args, tuple) or not isinstance(state, bytes) or not all(
                isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a) <= MAX_ARG for a in args):
            raise ValueError(f"detector state: malformed {cls.__name__}")
        obj = cls(*args)
        try:
            obj.__setstate__(state)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # river's parser panics (pyo3's PanicException) on bytes it did not write
            raise ValueError(f"detector state: {cls.__name__}'s bytes do not parse ({type(exc).__name__})") from None
        return obj
    if tag == "object":
        cls = _class(str(data["cls"]), CLASSES)
        obj = cls.__new__(cls)
        methods = {}
        for key, value in data["v"].items():
            if isinstance(value, dict) and value.get(TAG) == "method":
                methods[key] = str(value["name"])
            else:
                setattr(obj, key, load(value))
        for key, method in methods.items():
            if method.startswith("__") or not callable(getattr(cls, method, None)):
                raise ValueError(f"detector state: {cls.__name__} has no method {method!r}")
            setattr(obj, key, getattr(obj, method))
        return obj
    raise ValueError(f"detector state holds an unknown tag {tag!r}")
