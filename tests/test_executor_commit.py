"""A change is whole or absent: the executor's one commit point, and the failures around it.

Each test injects the failure by construction (a stage that raises, an intervention whose release raises) and
checks what the run, the executor and the record say afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stabmon.events import Anomaly, Decision, DecisionStatus, InterventionRecord, Severity, StepRecord
from stabmon.factory import NullDetectors
from stabmon.interventions.executor import Executor
from stabmon.interventions.set_clip import SetClip
from stabmon.monitor import Monitor, MonitorConfig
from stabmon.overrides import Overrides
from stabmon.runbook import loads_runbook

RUNBOOK = loads_runbook("""
name: one-cut
mode: apply
cooldown: 0
rules:
  - name: spike
    when: {kind: spike, severity: error}
    ladder: [{action: scale_lr, params: {factor: 0.5}, observe: 5}]
""")


class SpikeAt(NullDetectors):
    """Flags an error spike at one step; ``enter_grace`` (called right after a change to training) raises when
    asked to: the stage after the executor failing."""

    def __init__(self, step: int, *, grace_raises: bool = False) -> None:
        self.step, self.grace_raises = step, grace_raises

    def update(self, record: StepRecord) -> list[Anomaly]:
        if record.step != self.step:
            return []
        return [Anomaly(kind="spike", metric="loss", step=record.step, score=50.0, severity=Severity.ERROR,
                        detector="test")]

    def enter_grace(self, steps: int | None = None) -> None:
        if self.grace_raises:
            raise RuntimeError("the detectors could not re-enter their grace period")


def _train(monitor: Monitor, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 20) -> None:
    for _, x in monitor.steps([torch.ones(4, 2)] * steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        monitor.observe(loss=loss)
        optimizer.step()
        optimizer.zero_grad()


def test_a_change_made_before_a_later_stage_fails_is_recorded(tmp_path: Any) -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    url = f"sqlite:///{tmp_path / 'run.db'}"
    with Monitor(model, optimizer, store=url, runbook=RUNBOOK, mode="apply",
                 detectors=SpikeAt(7, grace_raises=True), config=MonitorConfig(flush_every=5)) as monitor:
        _train(monitor, model, optimizer)
    records = [e for e in monitor.events if isinstance(e, InterventionRecord)]
    # the change was made and is on the record, and so is its release once the incident resolved (the engine knew
    # of it: it was told before the stage that failed)
    assert [r.action for r in records] == ["scale_lr", "release"] and all(r.ok for r in records)
    assert records[0].after["lr_scale"] == 0.5
    assert monitor.errors["pipeline"] == 2  # the failure after each change is counted

    from stabmon.store import open_store
    from stabmon.store.repo import load_events

    store = open_store(url)
    try:
        with store.session() as session:
            stored = [e for e in load_events(session=session, run_id=monitor.run_id)
                      if isinstance(e, InterventionRecord)]
    finally:
        store.close()
    assert [r.id for r in stored] == [r.id for r in records]  # and in the store (before: lost with their record)


class Target:
    training = follow_ups = None  # a replay-like handle: no model, no follow-ups
    def __init__(self) -> None:
        self.overrides = Overrides()
        self.step = 10

    def hparams(self) -> dict[str, float]:
        return {"clip": self.overrides.max_norm or 1.0, "lr": 0.1}


def _decision(action: str, params: dict[str, Any], step: int = 10) -> Decision:
    return Decision(step=step, action=action, params=params, status=DecisionStatus.APPLY, runbook="r",
                    rule="x", rung=0, reason="test")


def test_a_change_the_engine_cannot_take_is_undone_and_says_so() -> None:
    executor = Executor(Target())
    out: list[Any] = []

    def refuse(decision: Decision, record: InterventionRecord) -> None:
        raise ValueError("engine state out of step")

    executor.commit(_decision("set_clip", {"max_norm": 0.5}), refuse, out)
    (record,) = out
    assert executor.target.overrides.max_norm is None  # undone: nothing half-made
    assert record.error is not None and "engine could not take it" in record.error and "(undone)" in record.error
    assert not record.ok and executor.state_dict()["applied"] == {}


class FlakyClip(SetClip):
    """``set_clip`` whose giving back raises once, then works; its putting back raises when told to."""

    name = "set_clip"
    fail_release = 0
    fail_reapply = 0

    def _release(self, steps: int) -> Any:
        if FlakyClip.fail_release:
            FlakyClip.fail_release -= 1
            raise OSError("could not give it back")
        return super()._release(steps)

    def _reapply(self) -> Any:
        if FlakyClip.fail_reapply:
            FlakyClip.fail_reapply -= 1
            raise OSError("could not put it back")
        return super()._reapply()


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> type[FlakyClip]:
    import stabmon.interventions as registry

    monkeypatch.setitem(registry.INTERVENTIONS, "set_clip", FlakyClip)
    FlakyClip.fail_release = FlakyClip.fail_reapply = 0
    return FlakyClip


def _two_clips(executor: Executor) -> list[str]:
    ids = []
    for norm in (0.5, 0.25):
        record = executor.execute(_decision("set_clip", {"max_norm": norm}))
        assert record is not None and record.ok
        ids.append(record.id)
    return ids


def test_a_release_that_fails_half_way_leaves_every_change_in_force(flaky: type[FlakyClip]) -> None:
    executor = Executor(Target())
    first, second = _two_clips(executor)
    flaky.fail_release = 1  # the second change given back (oldest last: the newest goes first) fails
    release = _decision("release", {"intervention_ids": [second, first], "steps": 0})
    released_first = executor.execute(_decision("release", {"intervention_ids": [second], "steps": 0}))
    assert released_first is not None and released_first.error is not None  # the newest could not be given back
    assert executor.target.overrides.max_norm == 0.25 and set(executor.state_dict()["applied"]) == {first, second}
    flaky.fail_release = 0
    record = executor.execute(release)
    assert record is not None and record.ok and executor.target.overrides.max_norm is None
    assert executor.state_dict()["applied"] == {}


def test_a_release_whose_second_change_fails_puts_the_first_back(flaky: type[FlakyClip]) -> None:
    executor = Executor(Target())
    first, second = _two_clips(executor)

    calls = {"n": 0}
    original = FlakyClip._release

    def second_fails(self: FlakyClip, steps: int) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("could not give the second back")
        return original(self, steps)

    FlakyClip._release = second_fails  # type: ignore[method-assign]
    try:
        record = executor.execute(_decision("release", {"intervention_ids": [second, first], "steps": 0}))
    finally:
        FlakyClip._release = original  # type: ignore[method-assign]
    assert record is not None and record.error is not None
    assert executor.target.overrides.max_norm == 0.25  # the newest, given back first, was put back
    assert set(executor.state_dict()["applied"]) == {first, second}  # both still in force, both revertible
    for rid in (second, first):
        assert executor.execute(_decision("revert", {"intervention_id": rid})).ok  # type: ignore[union-attr]
    assert executor.target.overrides.max_norm is None


def test_a_reapply_that_fails_half_way_leaves_the_release_standing(flaky: type[FlakyClip]) -> None:
    executor = Executor(Target())
    first, second = _two_clips(executor)
    release = executor.execute(_decision("release", {"intervention_ids": [second, first], "steps": 0}))
    assert release is not None and release.ok and executor.target.overrides.max_norm is None
    calls = {"n": 0}
    original = FlakyClip._reapply

    def second_fails(self: FlakyClip) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("could not put the second back")
        return original(self)

    FlakyClip._reapply = second_fails  # type: ignore[method-assign]
    try:
        record = executor.execute(_decision("reapply", {"intervention_id": release.id}))
    finally:
        FlakyClip._reapply = original  # type: ignore[method-assign]
    assert record is not None and record.error is not None
    assert executor.target.overrides.max_norm is None  # the one put back was given back again
    assert executor.state_dict()["applied"] == {} and list(executor.state_dict()["released"]) == [release.id]
    again = executor.execute(_decision("reapply", {"intervention_id": release.id}))
    assert again is not None and again.ok and executor.target.overrides.max_norm == 0.25


def test_another_rank_follows_rank_0s_release_and_reapply() -> None:
    """Rank 0's release names rank 0's records: the other ranks give back their own (before: only a revert was
    translated, so a release failed there with LookupError and the ranks trained with different settings)."""
    from stabmon.collect.cluster.distributed import RankFollower

    lead, other, follower = Executor(Target()), Executor(Target()), RankFollower()
    for action, params in (("set_clip", {"max_norm": 0.5}), ("scale_lr", {"factor": 0.5})):
        decision = _decision(action, params)
        record = lead.execute(decision)
        assert record is not None and record.ok
        follower.follow(other, [(decision, record.id)])
    changes = list(lead.state_dict()["applied"])
    release = _decision("release", {"intervention_ids": changes[::-1], "steps": 0})
    done = lead.execute(release)
    assert done is not None and done.ok
    follower.follow(other, [(release, done.id)])
    assert other.target.overrides == lead.target.overrides and other.target.overrides.max_norm is None
    back = _decision("reapply", {"intervention_id": done.id})
    again = lead.execute(back)
    assert again is not None and again.ok
    follower.follow(other, [(back, again.id)])
    assert other.target.overrides == lead.target.overrides
    assert (other.target.overrides.max_norm, other.target.overrides.lr_scale) == (0.5, 0.5)
