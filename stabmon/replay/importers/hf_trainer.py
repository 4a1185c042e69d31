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

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

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
    if not path.is_file():
        why = "a folder without a trainer_state.json" if path.is_dir() else "no such file" if not path.exists() \
            else "not a regular file"
        result.problem(name, f"not a readable trainer_state.json ({why})")
        return result
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, after the entries are read
    except OSError as exc:
        result.problem(name, f"not a readable trainer_state.json ({exc.strerror or exc})")
        return result
    with fh:
        return _read_history(entries(fh), result, steps, name)


def entries(fh: BinaryIO) -> Iterator[Any]:
    """The ``log_history`` entries of a ``trainer_state.json`` opened in binary, one at a time (ijson's C
    backend; memory bounded by one entry). The bare ``NaN`` / ``Infinity`` tokens the Trainer writes, and numbers
    no parser should be trusted with (an integer part of 19 digits or more, an exponent of 3 digits or more),
    reach the entries as strings (:class:`NumberGuard`), which :func:`_number` reads."""
    import ijson

    return ijson.items(NumberGuard(fh), "log_history.item", use_float=True)  # type: ignore[no-any-return]


class NumberGuard:
    """A binary file whose JSON values ``NaN``, ``Infinity``, ``-Infinity``, integers of 19+ digits and numbers
    with a 3+-digit exponent are read as strings (quoted). ijson knows no NaN token, its integers stop at 64
    bits (a 19-digit one ends the whole parse, "integer overflow"), and a 5,001-digit one crashed its C backend
    outright. A value is recognised in a value position (after ``:``, ``,`` or ``[``), chunk by chunk: the
    part after a chunk's last ``,`` waits for the next chunk.

    >>> import io
    >>> g = NumberGuard(io.BytesIO(b'{"a": NaN, "b": [-Infinity, 1.5, ' + b"9" * 20 + b', 1e400], "c": "x:NaN"}'))
    >>> g.read()
    b'{"a": "NaN", "b": ["-Infinity", 1.5, "99999999999999999999", "1e400"], "c": "x:NaN"}'
    """

    CHUNK = 1 << 20
    _VALUE = re.compile(rb'(?<=[:,\[])(\s*)(NaN|-?Infinity|-?\d{19,}(?:\.\d*)?(?:[eE][+-]?\d+)?'
                        rb'|-?\d+(?:\.\d*)?[eE][+-]?\d{3,})(?=\s*[,}\]])')

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self._out = b""
        self._carry = b""
        self._before = b""  # the byte before the carry (a value's left context)
        self._done = False

    def read(self, size: int = -1) -> bytes:
        while not self._done and (size < 0 or len(self._out) < size):
            data = self.raw.read(self.CHUNK)
            text = self._carry + data
            if not data:
                self._done, cut = True, len(text)
            else:
                cut = text.rfind(b",") + 1
                if cut == 0:  # no comma yet: one long value, read on
                    self._carry = text
                    continue
            guarded = self._VALUE.sub(rb'\1"\2"', self._before + text[:cut])[len(self._before):]
            self._out += guarded
            self._before, self._carry = text[cut - 1:cut], text[cut:]
        if size < 0:
            size = len(self._out)
        out, self._out = self._out[:size], self._out[size:]
        return out


def _read_history(history: Iterator[Any], result: ImportResult, steps: StepTable, name: str) -> ImportResult:
    """The records of the ``log_history`` entries, as they are read."""
    last_train: int | None = None
    evals = count = 0
    try:
        for entry in history:
            count += 1
            last_train, evals = _entry(entry, count - 1, name, result, steps, last_train, evals)
    except Exception as exc:  # noqa: BLE001 - ijson's errors: what was read so far stays, the rest is one problem
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        result.problem(name, f"stops being a readable trainer_state.json after {count} entries ({first})")
    if last_train is None:
        steps.close()
        empty = ImportResult(FORMAT)
        empty.problems, empty.malformed = result.problems, result.malformed
        empty.problem(name, f"no training entries (no 'loss') among {count} log_history entries "
                            f"({evals} evaluation)")
        return empty
    return result


def _entry(entry: Any, i: int, name: str, result: ImportResult, steps: StepTable, last_train: int | None,
           evals: int) -> tuple[int | None, int]:
    """One ``log_history`` entry into ``steps``; (the last training step, evaluation entries) after it."""
    where = f"{name}:entry {i}"
    if not isinstance(entry, dict):
        result.problem(where, f"not an object: {str(entry)[:60]!r}")
        return last_train, evals
    if SUMMARY_KEYS.intersection(entry) and "loss" not in entry:
        return last_train, evals  # the closing summary, a mean over the run: not a step
    step = _step(entry.get("step"))
    if step is None:
        result.problem(where, f"no usable step ({entry.get('step')!r})")
        return last_train, evals
    if "loss" in entry:
        if last_train is not None and step <= last_train:
            result.problem(where, f"training step {step} repeats or precedes step {last_train}; skipped")
            return last_train, evals
        metrics = _numbers(entry, TRAIN_KEYS, result, where)
        if Metric.LOSS not in metrics:
            return last_train, evals  # its loss was not a number (counted)
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
    return last_train, evals


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
            result.problem(where, f"{key} is not a number (or beyond float range): {str(entry[key])[:40]!r}")
            continue
        out[metric] = value
    return out


_INFINITY = frozenset({"inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})


def _number(raw: Any) -> float | None:
    """A float, or None for what is not a number, or is one beyond float range (``1e400``, a 401-digit
    integer: the Trainer never writes one, so it is a bad value, not an infinity)."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        try:
            return float(raw)
        except OverflowError:
            return None
    if isinstance(raw, float):
        return raw
    if isinstance(raw, str):
        text = raw.strip()
        try:
            value = float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) or text.lower() in _INFINITY or value != value else None
    return None
