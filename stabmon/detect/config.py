"""Validated detector configuration and ``name.param=value`` overrides.

Each detector owns a small frozen dataclass of parameters. Every field carries a one-line check in its
metadata; :func:`build` turns a plain mapping (YAML, JSON, CLI) into the dataclass and raises one-line
``ValueError`` s that name the dotted field path, e.g. ``detectors.spike.alpha must be in (0, 1), got 1.5``.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Demo:
...     alpha: float = param(0.1, open_unit, "the EW fading factor")
>>> build(Demo, {"alpha": 0.3}, "detectors.demo").alpha
0.3
>>> build(Demo, {"alpha": 1.5}, "detectors.demo")
Traceback (most recent call last):
ValueError: detectors.demo.alpha must be in (0, 1), got 1.5
>>> apply_overrides({"spike": {"alpha": 0.1}}, ["spike.z_threshold=5", "detector.spike.enabled=false"])
{'spike': {'alpha': 0.1, 'z_threshold': 5, 'enabled': False}}
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar, get_type_hints, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class CrossChecked(Protocol):
    """A settings dataclass with checks across its fields (each field's own check is in its metadata)."""

    def validate(self, path: str) -> None: ...
Check = tuple[Callable[[Any], bool], str]

open_unit: Check = (lambda v: 0.0 < v < 1.0, "must be in (0, 1)")
positive: Check = (lambda v: v > 0, "must be > 0")
non_negative: Check = (lambda v: v >= 0, "must be >= 0")
at_least_one: Check = (lambda v: v >= 1, "must be >= 1")
at_least_two: Check = (lambda v: v >= 2, "must be >= 2")
above_one: Check = (lambda v: v > 1.0, "must be > 1")
any_value: Check = (lambda v: True, "")
non_empty: Check = (lambda v: len(v) > 0, "must not be empty")


def param(default: Any, check: Check = any_value, doc: str = "") -> Any:
    """A dataclass field with a validation rule and a docstring (tuples/lists become immutable tuples)."""
    if isinstance(default, list):
        default = tuple(default)
    return dataclasses.field(default=default, metadata={"check": check, "doc": doc})


@dataclasses.dataclass(frozen=True)
class DetectorConfig:
    """The settings every detector has; each detector's config extends it (and may change its defaults).
    A detector exempt from grace (``Detector.grace_exempt``) scores during its grace period too.

    >>> DetectorConfig(metrics=("loss",)).grace_period, DetectorConfig().evidence
    (0, 16)
    """

    enabled: bool = param(True, doc="run this detector")
    metrics: tuple[str, ...] = param((), non_empty, "metrics watched (globs allowed)")
    grace_period: int = param(0, non_negative, "start-of-training steps (observations after enter_grace) learned "
                              "before scoring starts")
    evidence: int = param(16, at_least_one, "length of the (step, value) evidence window")


def _coerce(value: Any, hint: Any, path: str) -> Any:
    hint_s = str(hint)
    if hint is bool or hint_s == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"{path} must be true or false, got {value!r}")
    if hint is int or hint_s == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
            raise ValueError(f"{path} must be an integer, got {value!r}")
        return int(value)
    if hint is float or hint_s == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number, got {value!r}")
        return float(value)
    if hint is str or hint_s == "str":
        if not isinstance(value, str):
            raise ValueError(f"{path} must be a string, got {value!r}")
        return value
    if "tuple" in hint_s:  # tuple[str, ...]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{path} must be a list of metric names, got {value!r}")
        return tuple(value)
    return value


def build(cls: type[T], raw: Mapping[str, Any] | None, path: str) -> T:
    """Validate ``raw`` against the dataclass ``cls``; unknown keys and bad values raise one-line
    ValueErrors."""
    if raw is not None and not isinstance(raw, Mapping):
        raise ValueError(f"{path} must be a mapping of settings, got {raw!r}")
    raw = dict(raw or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"{path}.{unknown[0]} is not a known setting (known: {', '.join(sorted(fields))})")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        value = raw.get(name, f.default)
        value = _coerce(value, hints[name], f"{path}.{name}")
        check, desc = f.metadata.get("check", any_value)
        if not check(value):
            raise ValueError(f"{path}.{name} {desc}, got {value!r}")
        values[name] = value
    obj = cls(**values)
    if isinstance(obj, CrossChecked):  # settings that must agree with each other
        obj.validate(path)
    return obj


def parse_value(text: str) -> Any:
    """``"5"`` -> 5, ``"0.2"`` -> 0.2, ``"true"`` -> True, ``'["loss"]'`` -> ["loss"], else the string."""
    low = text.strip().lower()
    if low in {"true", "yes", "on"}:
        return True
    if low in {"false", "no", "off"}:
        return False
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()


def _split(item: str) -> tuple[list[str], str]:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like detector.param=value")
    key, value = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if parts and parts[0] in {"detector", "detectors"}:
        parts = parts[1:]
    if len(parts) != 2:
        raise ValueError(f"override {item!r} must name detector.param, e.g. spike.z_threshold=5")
    return parts, value


def apply_overrides(
    cfg: Mapping[str, Any] | None, items: Iterable[str] | Mapping[str, Any]
) -> dict[str, Any]:
    """A copy of ``cfg`` with ``detector.param=value`` overrides applied (strings, or a mapping of them)."""
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (cfg or {}).items()}
    pairs: list[tuple[list[str], Any]] = []
    if isinstance(items, Mapping):
        for key, value in items.items():
            parts, _ = _split(f"{key}=")
            pairs.append((parts, parse_value(value) if isinstance(value, str) else value))
    else:
        for item in items:
            parts, text = _split(item)
            pairs.append((parts, parse_value(text)))
    for (name, key), value in pairs:
        section = out.setdefault(name, {})
        if not isinstance(section, dict):
            raise ValueError(f"detectors.{name} must be a mapping, got {section!r}")
        section[key] = value
    return out


MAX_THRESHOLDS_BYTES = 1 << 20
"""A thresholds file is a few settings: a larger one is refused."""


def load_thresholds(path: str | Any) -> list[str]:
    """The ``detector.param=value`` overrides of a thresholds file: what ``stabmon tune --out`` writes
    (``detectors: {spike: {z_threshold: 7}}``; the ``detectors:`` level may be left out), for ``--thresholds`` and
    ``Monitor(thresholds=...)``. Errors are one line naming the file.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "tuned.yaml"
    >>> _ = f.write_text("detectors:\\n  spike: {z_threshold: 7.5}\\n  drift: {enabled: false}\\n")
    >>> load_thresholds(f)
    ['drift.enabled=false', 'spike.z_threshold=7.5']
    >>> _ = f.write_text("spike: 3\\n")
    >>> load_thresholds(f)
    Traceback (most recent call last):
    ValueError: thresholds: ...tuned.yaml: spike must map parameters to values, got 3
    """
    import os

    import yaml

    name = os.fspath(path)
    try:
        with open(name, "rb") as fh:
            raw = fh.read(MAX_THRESHOLDS_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"thresholds: cannot read {name}: {exc.strerror or exc}") from None
    if len(raw) > MAX_THRESHOLDS_BYTES:
        raise ValueError(f"thresholds: {name} is larger than {MAX_THRESHOLDS_BYTES} bytes: not a thresholds file")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"thresholds: {name} is no YAML mapping ({str(exc).splitlines()[0]})") from None
    if isinstance(data, Mapping) and set(data) == {"detectors"}:
        data = data["detectors"]
    if not isinstance(data, Mapping) or not data:
        raise ValueError(f"thresholds: {name} must map detectors to their parameters (as `stabmon tune --out` "
                         "writes it)")
    items = []
    for detector, params in sorted(data.items(), key=lambda kv: str(kv[0])):
        if not isinstance(params, Mapping):
            raise ValueError(f"thresholds: {name}: {detector} must map parameters to values, got {params!r}")
        for key, value in sorted(params.items(), key=lambda kv: str(kv[0])):
            items.append(f"{detector}.{key}={json.dumps(value)}")
    return items
