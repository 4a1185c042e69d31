"""Hugging Face ``Trainer`` state: ``trainer_state.json`` (the file itself or a ``checkpoint-N`` folder).

The Trainer appends one entry to ``log_history`` every ``logging_steps`` optimizer steps. Entries are read by
what they hold, not by position:

- a *training* entry has ``loss`` (the mean training loss since the previous log), and usually ``grad_norm``,
  ``learning_rate`` (``lr`` in some custom loggers) and ``epoch``: it becomes the record of its ``step``
  (``loss``, ``grad_norm``, ``lr``, ``epoch``);
- an *evaluation* entry has ``eval_*`` keys: ``eval_loss`` becomes ``val_loss`` and every other ``eval_*``
  number is kept under its own name (timings excepted), merged into the record of the same step. An
  evaluation never becomes the training loss;
- the closing summary (``train_loss``, ``train_runtime``, ``total_flos``) is the mean over the whole run and is
  not a step: it is left out.

A training loss of exactly 0.0 beside a non-finite ``grad_norm`` is read as NaN (and listed in ``events``): the
Trainer's ``logging_nan_inf_filter`` (on by default) logs an interval whose every step had a NaN loss that way.

The Trainer writes a NaN or an infinity as a bare ``NaN`` / ``Infinity`` token (Python's ``json`` reads them);
a value written as a string (``"nan"``, ``"inf"``, ``"1e-3"``) is read as the number it names. An entry with
no ``step``, a training entry whose step is not after the previous one (a duplicated log) and a value that is
not a number are each a counted problem (``<file>:entry <i>: <what>``); the rest of the file is read. A file
with evaluation entries only, or no entries, gives no records and one problem saying so.

>>> import json, tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp()) / "checkpoint-20"; d.mkdir()
>>> _ = (d / "trainer_state.json").write_text(json.dumps({"global_step": 20, "log_history": [
...     {"step": 10, "epoch": 0.5, "loss": 2.5, "grad_norm": 1.2, "learning_rate": 1e-4},
...     {"step": 10, "epoch": 0.5, "eval_loss": 2.7, "eval_runtime": 3.1},
...     {"step": 20, "epoch": 1.0, "loss": 2.25, "grad_norm": "nan", "learning_rate": 5e-5},
...     {"step": 20, "epoch": 1.0, "train_loss": 2.4, "train_runtime": 60.0}]}))
>>> r = read(d)
>>> [(x.step, dict(x.metrics)) for x in r.records]    # doctest: +NORMALIZE_WHITESPACE
[(10, {'loss': 2.5, 'grad_norm': 1.2, 'lr': 0.0001, 'epoch': 0.5, 'val_loss': 2.7}),
 (20, {'loss': 2.25, 'grad_norm': nan, 'lr': 5e-05, 'epoch': 1.0})]
>>> sniff((d / "trainer_state.json").read_text()), r.malformed
(True, 0)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stabmon.events import Metric
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.table import StepTable

FORMAT = "hf_trainer"
PRIORITY = 5  # a JSON object with a log_history: nothing else claims it
STATE_FILE = "trainer_state.json"

TRAIN_KEYS: dict[str, str] = {
    "loss": Metric.LOSS,
    "grad_norm": Metric.GRAD_NORM,
    "learning_rate": Metric.LR,
    "lr": Metric.LR,
    "epoch": "epoch",
}
"""Training-entry keys and the metric each becomes (other keys of a training entry are left out)."""
EVAL_PREFIX = "eval_"
EVAL_SKIPPED = frozenset({"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"})
SUMMARY_KEYS = frozenset({"train_loss", "train_runtime", "total_flos"})


def sniff(head: str) -> bool:
    """A JSON object with a ``log_history`` key near its top (the Trainer writes its keys sorted)."""
    return head.lstrip("\ufeff \t\r\n").startswith("{") and '"log_history"' in head


def state_path(path: Path) -> Path:
    """The ``trainer_state.json`` of a checkpoint folder, or the file itself."""
    return path / STATE_FILE if path.is_dir() else path


def read(path: Path, **options: Any) -> ImportResult:
    """Read a ``trainer_state.json`` (or the one in the folder ``path``); ``options`` are ignored."""
    path = state_path(Path(path))
    name = path.name if path.name != STATE_FILE else f"{path.parent.name}/{path.name}"
    steps = StepTable()
    result = ImportResult(FORMAT, steps=steps)
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
        history = state.get("log_history") if isinstance(state, dict) else None
        if not isinstance(history, list):
            raise ValueError("no log_history list")
    except (OSError, ValueError, RecursionError) as exc:
        result.problem(name, f"not a readable trainer_state.json ({str(exc).splitlines()[0][:160]})")
        return result
    last_train: int | None = None
    evals = 0
    for i, entry in enumerate(history):
        where = f"{name}:entry {i}"
        if not isinstance(entry, dict):
            result.problem(where, f"not an object: {str(entry)[:60]!r}")
            continue
        if SUMMARY_KEYS.intersection(entry) and "loss" not in entry:
            continue  # the closing summary, a mean over the run: not a step
        step = _step(entry.get("step"))
        if step is None:
            result.problem(where, f"no usable step ({entry.get('step')!r})")
            continue
        if "loss" in entry:
            if last_train is not None and step <= last_train:
                result.problem(where, f"training step {step} repeats or precedes step {last_train}; skipped")
                continue
            metrics = _numbers(entry, TRAIN_KEYS, result, where)
            if Metric.LOSS not in metrics:
                continue  # its loss was not a number (counted)
            if _nan_filtered(metrics):
                metrics[Metric.LOSS] = math.nan
                result.event(step, f"loss 0.0 with grad_norm {metrics[Metric.GRAD_NORM]}: every step of the "
                                   "interval had a non-finite loss (the Trainer's logging_nan_inf_filter), read as NaN")
            last_train = step
            steps.merge(step, metrics)
        else:
            metrics = _numbers(entry, eval_names(entry), result, where)
            if metrics:
                evals += 1
                steps.merge(step, metrics)
    if last_train is None:
        steps.close()
        empty = ImportResult(FORMAT)
        empty.problems, empty.malformed = result.problems, result.malformed
        empty.problem(name, f"no training entries (no 'loss') among {len(history)} log_history entries "
                            f"({evals} evaluation)")
        return empty
    return result


def eval_names(entry: Mapping[str, Any]) -> dict[str, str]:
    """The evaluation keys of a Trainer log entry (or ``on_evaluate`` metrics) and the metric each becomes.

    >>> eval_names({"eval_loss": 1.0, "eval_accuracy": 0.5, "eval_runtime": 2.0, "epoch": 1.0})
    {'eval_loss': 'val_loss', 'eval_accuracy': 'eval_accuracy'}
    """
    keys = {k: k for k in entry if k.startswith(EVAL_PREFIX) and k not in EVAL_SKIPPED}
    if "eval_loss" in keys:
        keys["eval_loss"] = Metric.VAL_LOSS
    return keys


def _nan_filtered(metrics: Mapping[str, float]) -> bool:
    """Did the Trainer's ``logging_nan_inf_filter`` (on by default) hide a non-finite loss? It replaces each
    non-finite step's loss by the mean of the interval so far, so an interval whose every step was NaN logs a
    loss of exactly 0.0 - next to a non-finite gradient norm."""
    grad = metrics.get(Metric.GRAD_NORM)
    return metrics[Metric.LOSS] == 0.0 and grad is not None and not math.isfinite(grad)


def _step(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw if raw >= 0 else None
    if isinstance(raw, float) and math.isfinite(raw) and raw == int(raw) and raw >= 0:
        return int(raw)
    return None


def _numbers(entry: Mapping[str, Any], keys: Mapping[str, str], result: ImportResult, where: str) -> dict[str, float]:
    """The entry's values of ``keys`` as floats (NaN and infinities kept), each bad value a counted problem."""
    out: dict[str, float] = {}
    for key, metric in keys.items():
        if key not in entry or entry[key] is None:
            continue
        value = _number(entry[key])
        if value is None:
            result.problem(where, f"{key} is not a number: {str(entry[key])[:40]!r}")
            continue
        out[metric] = value
    return out


def _number(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            return None
    return None
