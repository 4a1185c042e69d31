"""The one place a :class:`~stabmon.pipeline.Pipeline` is built, for the live monitor and for replay alike.

:func:`build_pipeline` turns the plain forms a user gives (a runbook name or path, a detector config mapping,
``detector.param=value`` overrides, a mode) or ready objects implementing the pipeline protocols into the
detector suite, the runbook engine and the executor acting on ``target``: the live monitor passes its
:class:`~stabmon.interventions.handle.Handle` (:meth:`~stabmon.collect.checkpoint.recovery.Recovery.handle`), replay its
:class:`~stabmon.replay.simulate.Simulation`'s.
Nothing here imports torch, so ``stabmon replay``, ``eval`` and ``tune`` never load it. Bad input is a one-line
``ValueError`` naming the argument.

>>> from stabmon.replay.simulate import Simulation
>>> pipe = build_pipeline(Simulation().handle, runbook="default", simulated=True)
>>> type(pipe.detectors).__name__, type(pipe.engine).__name__, pipe.executor.simulated
('DetectorSuite', 'Engine', True)
>>> build_pipeline(Simulation().handle, detectors=42)
Traceback (most recent call last):
...
ValueError: detectors: expected a config mapping, a detector suite, None or False, got int
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from stabmon.events import Anomaly, StepRecord
from stabmon.interventions.handle import Handle
from stabmon.pipeline import DetectorSuiteLike, EngineLike, Pipeline


class NullDetectors:
    """A detector suite that finds nothing (``detectors=False``).

    >>> NullDetectors().update(StepRecord(step=0, metrics={}))
    []
    """

    def update(self, record: StepRecord) -> list[Anomaly]:
        return []

    def enter_grace(self, steps: int | None = None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def resolve_detectors(detectors: Any, overrides: Sequence[str] = ()) -> DetectorSuiteLike:
    """The detector suite for ``detectors=``: False (none), None (defaults) or a config mapping, then the
    ``detector.param=value`` ``overrides``; or a ready suite."""
    if detectors is False:
        return NullDetectors()
    if detectors is None or isinstance(detectors, Mapping):
        from stabmon.detect import DetectorSuite

        try:
            return DetectorSuite.from_config(detectors, overrides=list(overrides))
        except ValueError as exc:
            raise ValueError(f"detectors: {exc}") from None
    if isinstance(detectors, DetectorSuiteLike):
        return detectors
    raise ValueError(
        f"detectors: expected a config mapping, a detector suite, None or False, got {type(detectors).__name__}"
    )


def resolve_runbook(runbook: Any) -> Any:
    """A loaded :class:`~stabmon.runbook.Runbook` from a name, a path or a Runbook; errors name ``runbook``."""
    from stabmon.runbook import Runbook, load_runbook

    if isinstance(runbook, Runbook):
        return runbook
    try:
        return load_runbook(os.fspath(runbook))
    except (ValueError, OSError, TypeError) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
        every = lines[0] if len(lines) == 1 else f"{len(lines)} problems: " + "; ".join(lines)
        raise ValueError(f"runbook: {every}") from None  # one line, every problem (as `runbook validate`)


def resolve_engine(runbook: Any, mode: str | None) -> EngineLike | None:
    """The runbook engine for a runbook name, path, Runbook or ready engine; None without a runbook or in
    ``observe`` mode. ``mode`` None keeps the runbook's."""
    if runbook is None or mode == "observe":
        return None
    if isinstance(runbook, EngineLike):
        return runbook
    from stabmon.runbook import Engine

    return Engine(resolve_runbook(runbook), mode=mode)


def build_pipeline(
    target: Handle,
    *,
    runbook: Any = None,
    detectors: Any = None,
    overrides: Sequence[str] = (),
    mode: str | None = None,
    simulated: bool = False,
) -> Pipeline:
    """Detectors, the runbook engine (None without a runbook or in ``observe`` mode) and, with an engine, an
    :class:`~stabmon.interventions.Executor` acting on ``target`` (``simulated``: its records say so).

    Without ``detectors=``, the detectors take the runbook's ``detectors:`` section (where a ``stabmon tune``
    result lands through ``include:``); ``overrides`` apply on top."""
    engine, suite = resolve_decisions(runbook=runbook, detectors=detectors, overrides=overrides, mode=mode)
    return pipeline_of(target, engine=engine, detectors=suite, simulated=simulated)


def resolve_decisions(
    *, runbook: Any = None, detectors: Any = None, overrides: Sequence[str] = (), mode: str | None = None
) -> tuple[EngineLike | None, DetectorSuiteLike]:
    """The runbook engine (None without a runbook or in ``observe`` mode) and the detectors (without
    ``detectors=``: the runbook's ``detectors:`` section; ``overrides`` on top), before any target exists."""
    if runbook is not None and mode != "observe" and not isinstance(runbook, EngineLike):
        runbook = resolve_runbook(runbook)
        if detectors is None and runbook.detectors:
            detectors = dict(runbook.detectors)
    return resolve_engine(runbook, mode), resolve_detectors(detectors, overrides)


def pipeline_of(
    target: Handle, *, engine: EngineLike | None, detectors: DetectorSuiteLike,
    simulated: bool = False,
) -> Pipeline:
    """The pipeline of ``detectors`` and ``engine``, with an executor acting on ``target`` when there is an
    engine."""
    executor = None
    if engine is not None:
        from stabmon.interventions import Executor

        executor = Executor(target, simulated=simulated)
    return Pipeline(detectors, engine, executor)
