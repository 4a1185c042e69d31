"""The runbook schema: pydantic models of a runbook YAML file, unknown fields forbidden.

A runbook maps anomalies to ladders of interventions::

    name: example
    mode: apply                # apply | propose
    cooldown: 100              # steps after an incident closes before a new one may open
    budget: {max_interventions: 6, per_steps: 2000}
    approval: {timeout: 200, on_timeout: expire, on_reject: revert}   # propose mode
    rules:
      - name: grad_spike
        when: {kind: spike, metric: "grad_norm*", severity: warning, persistence: {seen: 2, of: 10}}
        ladder:
          - action: set_clip
            params: {max_norm: 1.5}
            observe: 100
            success: {quiet_steps: 50, loss_within: 0.1}
            on_failure: next       # next | revert | stop
          - action: scale_lr
            params: {factor: 0.5}
            observe: 50
            repeat: 4              # halve again while the incident persists: down to 1/16

Each rung's ``params`` are validated by the intervention's own parameter model (see
:mod:`stabmon.interventions`), so an unknown action or a wrong parameter type fails at load time. Load
files with :func:`stabmon.runbook.load_runbook`, which reports errors as ``FILE:LINE: field.path: message``.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from stabmon.events import Anomaly, Severity
from stabmon.interventions import INTERVENTIONS, Intervention
from stabmon.interventions.registry import on_register
from stabmon.interventions.traits import traits_of


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Persistence(_Strict):
    """The condition holds when matching anomalies were seen on at least ``seen`` of the last ``of`` steps."""

    seen: int = Field(default=1, ge=1)
    of: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _seen_le_of(self) -> Persistence:
        if self.seen > self.of:
            raise ValueError(f"seen ({self.seen}) must be <= of ({self.of})")
        return self


class Condition(_Strict):
    """Which anomalies a rule answers: ``kind`` and ``metric`` are shell-style globs (``kind`` may be a list),
    ``severity`` the least severity, ``persistence`` how often they must recur before the rule acts.

    ``verdict`` (``data`` | ``state`` | ``hardware_suspect``): the rule answers an incident whose ``diagnose``
    rung returned this verdict, and never opens one itself (:mod:`stabmon.runbook.verdicts`); ``metric`` then
    selects the incidents' metric, and ``kind``/``severity`` which anomalies its observation windows count."""

    kind: str | list[str] = "*"
    metric: str = "*"
    severity: Severity = Severity.WARNING
    persistence: Persistence = Persistence()
    verdict: Literal["data", "state", "hardware_suspect"] | None = None
    ratio: float | None = Field(default=None, gt=1)
    """The flagged value must be at least this many times the median of the values before it in the anomaly's
    evidence (the metric's recent history; at least 8 of them): a size, where ``severity`` is a detector's
    confidence. None: any size."""

    def matches(self, anomaly: Anomaly) -> bool:
        kinds = [self.kind] if isinstance(self.kind, str) else self.kind
        return (
            any(fnmatch.fnmatchcase(anomaly.kind, k) for k in kinds)
            and fnmatch.fnmatchcase(anomaly.metric, self.metric)
            and Severity(anomaly.severity) >= self.severity
            and (self.ratio is None or _times_median(anomaly) >= self.ratio)
        )


_RATIO_HISTORY = 8


def _times_median(anomaly: Anomaly) -> float:
    """The flagged value over the median of the evidence before it (0.0 without 8 positive finite values before
    it, or a flagged value that is not finite: a NaN is the nonfinite rule's).

    >>> from stabmon.events import Anomaly, Severity
    >>> a = Anomaly("spike", "grad_norm", 9, 9.0, Severity.WARNING, "spike",
    ...             evidence=tuple((s, 1.0 + 0.1 * (s % 2)) for s in range(9)) + ((9, 50.0),))
    >>> _times_median(a)
    50.0
    """
    values = [v for _, v in anomaly.evidence]
    if len(values) <= _RATIO_HISTORY or not math.isfinite(values[-1]):
        return 0.0
    before = sorted(v for v in values[:-1] if math.isfinite(v) and v > 0)
    if len(before) < _RATIO_HISTORY:
        return 0.0
    return values[-1] / statistics.median(before)


class Success(_Strict):
    """How a rung is judged at the end of its observation window. All given criteria must hold.

    ``quiet_steps``: no anomaly matching the rule (kind, metric, severity) in the window's last K steps
    (default: the whole window). ``loss_within``: the median loss of those steps is at most ``(1 + x)``
    times the median loss before the incident's onset. ``signal_below``: the triggering metric stayed below
    this value in those steps.
    """

    quiet_steps: int | None = Field(default=None, ge=1)
    loss_within: float | None = Field(default=None, ge=0)
    signal_below: float | None = None


class _RungBase(_Strict):
    observe: int = Field(default=50, ge=1)
    """Steps to observe after the change before judging it."""
    success: Success = Success()
    on_failure: Literal["next", "revert", "stop"] = "next"
    """next: go to the next rung; revert: the same, recorded as reverted; stop: checkpoint and stop the run.
    Either way a change that did not resolve the incident is undone before the next rung (the learning-rate cap
    of a rollback included; the restored weights stay), so one change is in force at a time, and a ladder that
    runs out leaves none behind."""
    repeat: int = Field(default=1, ge=1)
    """How many times the rung is tried while the incident persists: each attempt applies the change again on
    top of the last one and is judged on its own window, so ``scale_lr {factor: 0.5}`` with ``repeat: 5``
    keeps halving the LR (down to 1/32) until the run is quiet. ``on_failure`` applies after the last
    attempt; an attempt that failed to apply (an error) is not repeated, nor one that held the trouble off no
    longer than the attempt before it, or failed on its loss test alone (``judging.held``: the rung is spent)."""

    @model_validator(mode="after")
    def _consistent(self) -> _RungBase:
        cls = INTERVENTIONS[self.action]  # type: ignore[attr-defined]
        if self.on_failure == "revert" and not cls.revertible:
            raise ValueError(f"on_failure: revert is impossible, {cls.name} cannot be reverted")
        if self.repeat > 1 and self.on_failure == "revert":
            raise ValueError("repeat: a rung that is reverted on failure cannot be repeated (use next or stop)")
        if self.success.quiet_steps is not None and self.success.quiet_steps > self.observe:
            raise ValueError(f"success.quiet_steps ({self.success.quiet_steps}) exceeds observe "
                             f"({self.observe})")
        return self


def _rung_model(cls: type[Intervention]) -> type[_RungBase]:
    try:
        cls.Params()
        params: Any = (cls.Params, Field(default_factory=cls.Params))
    except ValueError:
        params = (cls.Params, ...)
    name = f"{cls.__name__}Rung"
    tag: Any = Literal[cls.name]
    model = create_model(  # type: ignore[call-overload]
        name, __base__=_RungBase, __module__=__name__, action=(tag, ...), params=params
    )
    globals()[name] = model  # importable by name, so runbooks pickle
    return model  # type: ignore[no-any-return]


def rung_type() -> Any:
    """The discriminated union of one rung model per registered intervention (tagged by ``action``)."""
    models = tuple(_rung_model(cls) for cls in INTERVENTIONS.values())
    return Annotated[Union[models], Field(discriminator="action")]  # noqa: UP007 - built from the registry


Rung = rung_type()


class Rule(_Strict):
    """One anomaly condition and the ladder of rungs tried, in order, while it persists."""

    name: str = Field(min_length=1)
    description: str = ""
    when: Condition = Condition()
    ladder: list[Rung] = Field(min_length=1)  # type: ignore[valid-type]
    yields: bool = False
    """A first-sign rule: while its change is observed, an anomaly that another rule changes training for
    closes its incident at once (its changes given back first, one change in force at a time) and opens that
    rule's own, instead of counting against the change and waiting for its window to end."""

    @property
    def actions(self) -> list[str]:
        """The action of each rung, in ladder order."""
        ladder: list[Any] = list(self.ladder)  # one pydantic model per action
        return [rung.action for rung in ladder]


def _registered(cls: type[Intervention]) -> None:
    """An intervention registered after this module was imported: the rung union takes it in, so a runbook
    loaded from now on may name it."""
    global Rung
    Rung = rung_type()
    Rule.model_fields["ladder"].annotation = list[Rung]  # type: ignore[valid-type]
    Rule.model_rebuild(force=True)
    Runbook.model_rebuild(force=True)


class Budget(_Strict):
    """At most ``max_interventions`` changes (reverts and alerts not counted) per ``per_steps`` steps."""

    max_interventions: int = Field(default=8, ge=1)
    per_steps: int = Field(default=1000, ge=1)


class Release(_Strict):
    """How a change that resolved its incident is given back (every change that stays in force: a setting, a
    learning-rate cap or scale, a rollback's cap). The settings are restored and a learning rate that comes back
    up climbs to the schedule geometrically over ``steps`` optimizer steps (0: at once); the release is then
    observed for ``steps + observe`` steps and judged like a rung on the rung's own success tests. Quiet: the
    incident closes ``released``. The rule's trouble back: the changes are put back (``reapply``) and the
    incident closes ``kept``, which the trace and the alerts say. No change outlives its incident silently."""

    steps: int = Field(default=100, ge=0)
    observe: int = Field(default=100, ge=1)


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


class Approval(_Strict):
    """Propose mode: a proposal unanswered after ``timeout`` expires or is applied (``on_timeout``).
    ``timeout`` is a number of steps (``500``) or a duration (``"90s"``, ``"10m"``, ``"2h"``) measured on the
    steps' wall-clock times, for loops so fast that steps pass in seconds.

    >>> Approval(timeout="10m").seconds, Approval(timeout=200).steps
    (600.0, 200)
    """

    timeout: int | str = 500
    on_timeout: Literal["expire", "auto_apply"] = "expire"
    on_reject: Literal["revert", "keep"] = "revert"
    """What rejecting a proposal does to the changes its incident already made (earlier rungs): ``revert``
    undoes every one that can be undone (a rollback cannot), newest first; ``keep`` leaves them in force.
    Either way the incident closes."""

    @field_validator("timeout")
    @classmethod
    def _steps_or_duration(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"must be >= 1 step or a duration such as '10m', got {value}")
            return value
        if isinstance(value, str) and _duration(value) is not None:
            return value
        raise ValueError(f"expected a number of steps or a duration such as '90s', '10m', '2h', got {value!r}")

    @property
    def steps(self) -> int | None:
        return self.timeout if isinstance(self.timeout, int) else None

    @property
    def seconds(self) -> float | None:
        return _duration(self.timeout) if isinstance(self.timeout, str) else None


def _duration(text: str) -> float | None:
    number, unit = text.strip()[:-1], text.strip()[-1:]
    try:
        value = float(number)
    except ValueError:
        return None
    return value * _UNITS[unit] if unit in _UNITS and value > 0 else None


class Runbook(_Strict):
    """A validated runbook.

    >>> rb = Runbook.model_validate({"name": "t", "rules": [{"name": "r", "when": {"kind": "spike"},
    ...     "ladder": [{"action": "set_clip", "params": {"max_norm": 1.0}, "observe": 10}]}]})
    >>> rb.mode, rb.rules[0].ladder[0].params.max_norm
    ('apply', 1.0)
    """

    name: str = Field(min_length=1)
    description: str = ""
    mode: Literal["propose", "apply"] = "apply"
    cooldown: int = Field(default=100, ge=0)
    """Steps after an incident closes during which no new incident opens."""
    budget: Budget = Budget()
    approval: Approval = Approval()
    release: Release = Release()
    """How the changes an incident was resolved with are given back (see :class:`Release`)."""
    baseline_steps: int = Field(default=50, ge=1)
    """How many steps before an incident's onset form the loss baseline that success is judged against."""
    include: str | None = None
    """An override file (for example written by ``stabmon tune``) merged over this runbook."""
    detectors: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Detector settings, passed through to the detector suite (``stabmon tune`` writes these)."""
    rules: list[Rule] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_rules(self) -> Runbook:
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rule names must be unique, repeated: {', '.join(dup)}")
        diagnosing = any(traits_of(action).diagnoses for r in self.rules for action in r.actions)
        for r in self.rules:
            if r.when.verdict is not None and not diagnosing:
                raise ValueError(f"rule {r.name}: when.verdict needs a rule with a diagnose rung")
        return self

    def rule(self, name: str) -> Rule:
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(name)


on_register(_registered)
