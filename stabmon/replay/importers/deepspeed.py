"""DeepSpeed engine logs (DeepSpeed-Chat style training scripts).

Two shapes are read:

- **Engine log** (supervised fine-tuning): ``[Rank 0] step=N, skipped=K, lr=[...]`` every ``steps_per_print``
  steps, ``timer.py`` throughput lines, ``ppl: X`` after each evaluation, and one
  ``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: A, reducing to B`` line per skipped
  step. DeepSpeed counts skipped steps in ``global_steps``, so every step 1..N gets a record with ``overflow``
  0 or 1; an overflow line is placed on a step inside its ``step=`` block by its timestamp (in order, one per
  step). ``loss_scale`` is known only where DeepSpeed prints it - on overflow steps (the scale that
  overflowed); the silent doubling after a clean window is not logged, so it is left absent elsewhere.
  ``step_time`` is the block's wall time over its steps; ``val_loss`` is ``log(ppl)``. There is no per-step
  loss in this shape.
- **RLHF (PPO) log**: ``epoch: E|step: N|ppo_ep: 1|act_loss: X|cri_loss: Y|unsuper_loss: Z`` per step, then
  ``average reward score: R`` and an ``E2E latency=Ts`` line. Overflow lines printed before a step line belong
  to it (actor and critic engines both print them): ``overflow = 1`` and ``loss_scale`` = the lowest scale
  that overflowed. ``loss`` is the actor loss; ``critic_loss``, ``unsuper_loss`` and ``reward`` are kept too.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "train.log"
>>> ov = "[2023-04-18 01:46:5{}] [INFO] [loss_scaler.py:181:update_scale] [deepspeed] OVERFLOW! Rank 0 "
>>> _ = p.write_text(ov.format("3,000") + "Skipping step. Attempted loss scale: 65536, reducing to 32768\\n"
...     "[2023-04-18 01:46:59,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=4, skipped=1, lr=[1e-05]\\n")
>>> r = read(p)
>>> [(x.step, x.metrics.get("overflow"), x.metrics.get("loss_scale")) for x in r.records]
[(1, 1.0, 65536.0), (2, 0.0, None), (3, 0.0, None), (4, 0.0, None)]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stabmon.events import Metric
from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.table import StepTable

FORMAT = "deepspeed"
PRIORITY = 20

_TS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:,(\d+))?\]")
_OVERFLOW = re.compile(r"OVERFLOW!.*?Attempted loss scale:\s*([-+0-9.eE]+)"
                       r"(?:,\s*reducing to\s*([-+0-9.eE]+))?")
_STEP = re.compile(r"\bstep=(\d+),\s*skipped=(\d+)(?:,\s*lr=\[([^\],]+))?")
_TIMER = re.compile(r"global_step=(\d+),.*?CurrSamplesPerSec=([-+0-9.eE]+)")
_PPL = re.compile(r"^\s*ppl:\s*([-+0-9.eEnaif]+)\s*$")
_PPO = re.compile(r"epoch:\s*\d+\|step:\s*(\d+)\|(.*)$")
_REWARD = re.compile(r"average reward score:\s*([-+0-9.eEnaif]+)")
_E2E = re.compile(r"E2E latency=([-+0-9.eE]+)s")
_PPO_FIELDS = {"act_loss": Metric.LOSS, "cri_loss": "critic_loss", "unsuper_loss": "unsuper_loss"}


def sniff(head: str) -> bool:
    return "[deepspeed] OVERFLOW!" in head or bool(_STEP.search(head) and "[Rank 0]" in head) or bool(
        _PPO.search(head))


def _time(line: str) -> float | None:
    m = _TS.match(line)
    if m is None:
        return None
    t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return t + (int(m.group(2)) / 1000.0 if m.group(2) else 0.0)


def _place(overflows: list[tuple[float | None, float]], prev: int, cur: int,
           t_prev: float | None, t_cur: float | None) -> dict[int, float]:
    """Steps in (prev, cur] for the overflow lines of one block: by timestamp, in order, one per step."""
    n = cur - prev
    placed: dict[int, float] = {}
    last = prev
    for i, (t, scale) in enumerate(overflows):
        left = len(overflows) - i  # this one and the ones after it still need a step each
        est = last + 1
        if t is not None and t_prev is not None and t_cur is not None and t_cur > t_prev:
            est = prev + math.ceil((t - t_prev) / (t_cur - t_prev) * n)
        step = min(max(est, last + 1), cur - left + 1)
        if step <= prev:
            continue
        placed[step] = scale
        last = step
    return placed


def read(path: Path, **options: Any) -> ImportResult:
    """Read a DeepSpeed log, one line at a time; ``options`` are accepted for a uniform signature and ignored."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        ppo = any(_PPO.search(line) for line in fh)
    with open(path, encoding="utf-8", errors="replace") as fh:
        return (_read_ppo if ppo else _read_engine)(Path(path).name, fh)


def _num(text: str) -> float:
    return float(text.strip())


def _read_engine(name: str, lines: Iterable[str]) -> ImportResult:
    steps = StepTable()
    result = ImportResult(FORMAT, steps=steps)
    pending: list[tuple[float | None, float]] = []
    prev, t_prev, n_overflow = 0, None, 0
    for line_no, line in enumerate(lines, 1):
        where = f"{name}:{line_no}"
        try:
            if (m := _OVERFLOW.search(line)) is not None:
                pending.append((_time(line), _num(m.group(1))))
                n_overflow += 1
                result.event(prev, line.strip())
            elif (m := _STEP.search(line)) is not None:
                cur, t_cur = int(m.group(1)), _time(line)
                if cur <= prev:
                    result.restarts.append(cur)
                    steps.drop_from(cur)
                    prev, t_prev = cur - 1, None
                _fill_block(steps, _place(pending, prev, cur, t_prev, t_cur), prev, cur)
                if m.group(3):
                    steps.merge(cur, {Metric.LR: _num(m.group(3))})
                if t_prev is not None and t_cur is not None and t_cur > t_prev:
                    steps.merge(cur, {Metric.STEP_TIME: (t_cur - t_prev) / (cur - prev)})
                if int(m.group(2)) != n_overflow:
                    result.event(cur, f"skipped={m.group(2)} but {n_overflow} OVERFLOW lines so far")
                pending, prev, t_prev = [], cur, t_cur
            elif (m := _TIMER.search(line)) is not None:
                steps.merge(int(m.group(1)), {"samples_per_sec": _num(m.group(2))})
            elif (m := _PPL.match(line)) is not None:
                ppl = _num(m.group(1))
                steps.merge(prev, {Metric.VAL_LOSS: math.log(ppl) if ppl > 0 else math.nan})
        except ValueError as exc:
            result.problem(where, f"unreadable number ({exc})")
    for i, (_, scale) in enumerate(pending, 1):  # overflows after the last step line: the steps that followed it
        steps.put(prev + i, {Metric.OVERFLOW: 1.0, Metric.LOSS_SCALE: scale})
    return result


def _fill_block(steps: StepTable, placed: dict[int, float], prev: int, cur: int) -> None:
    """Every step of a ``step=`` block gets ``overflow`` 0, or 1 and the loss scale where an overflow was placed."""
    for s in range(prev + 1, cur + 1):
        steps.put_new(s, {Metric.OVERFLOW: 0.0})
        if s in placed:
            steps.merge(s, {Metric.OVERFLOW: 1.0, Metric.LOSS_SCALE: placed[s]})


def _read_ppo(name: str, lines: Iterable[str]) -> ImportResult:
    steps = StepTable()
    result = ImportResult(FORMAT, steps=steps)
    scales: list[float] = []
    current: int | None = None
    for line_no, line in enumerate(lines, 1):
        where = f"{name}:{line_no}"
        try:
            if (m := _OVERFLOW.search(line)) is not None:
                scales.append(_num(m.group(1)))
                result.event(current, line.strip())
            elif (m := _PPO.search(line)) is not None:
                step = int(m.group(1))
                metrics: dict[str, float] = {Metric.OVERFLOW: 1.0 if scales else 0.0}
                if scales:
                    metrics[Metric.LOSS_SCALE] = min(scales)
                for part in m.group(2).split("|"):
                    key, _, value = part.partition(":")
                    if key.strip() in _PPO_FIELDS:
                        metrics[_PPO_FIELDS[key.strip()]] = _num(value)
                if current is not None and step <= current:
                    result.restarts.append(step)
                    steps.drop_from(step)
                steps.put(step, metrics)
                current, scales = step, []
            elif current is not None and (m := _REWARD.search(line)) is not None:
                steps.merge(current, {"reward": _num(m.group(1))})
            elif current is not None and (m := _E2E.search(line)) is not None:
                steps.merge(current, {Metric.STEP_TIME: _num(m.group(1))})
        except ValueError as exc:
            result.problem(where, f"unreadable number ({exc})")
    return result
