"""The runbook engine alone, on synthetic anomaly streams: one change at a time, escalation, revert, stop,
cooldown, budget, proposals and their expiry, persistence, determinism and state round-trips."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stabmon.events import (
    Anomaly,
    Decision,
    DecisionStatus,
    InterventionRecord,
    Outcome,
    Severity,
    StepRecord,
    Verdict,
)
from stabmon.runbook import Engine, loads_runbook

LADDER = """
name: test
mode: {mode}
cooldown: {cooldown}
budget: {{max_interventions: {budget}, per_steps: 1000}}
approval: {{timeout: 5, on_timeout: {on_timeout}}}
baseline_steps: 5
rules:
  - name: spikes
    when: {{kind: spike, metric: "grad_norm*", severity: warning, persistence: {{seen: {seen}, of: 5}}}}
    ladder:
      - action: set_clip
        params: {{max_norm: 1.5}}
        observe: 4
        success: {{quiet_steps: 3, loss_within: 0.1}}
        on_failure: {first_failure}
      - action: set_beta2
        params: {{beta2: 0.95}}
        observe: 4
      - action: scale_lr
        params: {{factor: 0.9}}
        observe: 4
        on_failure: {last_failure}
  - name: collapse
    when: {{kind: loss_scale_collapse, severity: error}}
    ladder:
      - action: rollback
        params: {{lookback: 10, skip_batches: 3}}
        observe: 2
"""


def runbook(**kw: object):
    params = dict(mode="apply", cooldown=3, budget=10, on_timeout="expire", seen=1, first_failure="next",
                  last_failure="next")
    params.update(kw)
    return loads_runbook(LADDER.format(**params))


def spike(step: int, *, metric: str = "grad_norm", severity: Severity = Severity.ERROR,
          kind: str = "spike") -> Anomaly:
    return Anomaly(kind=kind, metric=metric, step=step, score=10.0, severity=severity, detector="test",
                   evidence=((step - 2, 1.0), (step - 1, 1.1), (step, 9.0)), id=f"a{step}")


class Driver:
    """Feeds records to an engine and plays the executor's part (records for applied decisions)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step = 0
        self.events: list[Decision | Outcome] = []

    def run(self, n: int, *, anomalous: Iterable[int] = (), loss: float = 2.0,
            make=spike) -> list[Decision | Outcome]:
        bad = set(anomalous)
        out: list[Decision | Outcome] = []
        for _ in range(n):
            self.step += 1
            anomalies = [make(self.step)] if self.step in bad else []
            produced = self.engine.process(StepRecord(self.step, {"loss": loss, "grad_norm": 1.0}), anomalies)
            out.extend(self._apply(produced))
        self.events.extend(out)
        return out

    def answer(self, decision_id: str, approved: bool) -> list[Decision | Outcome]:
        out = self._apply(self.engine.answer(decision_id, approved, self.step))
        self.events.extend(out)
        return out

    def _apply(self, produced: list[Decision | Outcome]) -> list[Decision | Outcome]:
        for ev in produced:
            if isinstance(ev, Decision) and ev.status in (DecisionStatus.APPLY, DecisionStatus.APPROVED):
                self.engine.applied(ev, InterventionRecord(decision_id=ev.id, step=ev.step, action=ev.action,
                                                           before={}, after={}, id=f"i-{ev.id}"))
        return produced


def decisions(events) -> list[Decision]:
    return [e for e in events if isinstance(e, Decision)]


def outcomes(events) -> list[Outcome]:
    return [e for e in events if isinstance(e, Outcome)]


GIVE_BACK = ("revert", "release", "reapply")  # decisions that return to the recipe, not rungs of the ladder


def rungs(events) -> list[Decision]:
    """The ladder's own decisions: without the reverts, releases and re-applications between them."""
    return [d for d in decisions(events) if d.action not in GIVE_BACK]


def test_one_change_at_a_time_while_observing() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    first = d.run(1, anomalous=[1])
    assert [x.action for x in decisions(first)] == ["set_clip"]
    # anomalies keep coming during the 4-step observation window: no second decision before the judgement
    during = d.run(3, anomalous=[2, 3, 4])
    assert decisions(during) == [] and outcomes(during) == []
    judged = d.run(1, anomalous=[5])
    assert [o.verdict for o in outcomes(judged)] == [Verdict.ESCALATED]
    # the failed rung is undone before the next: one change in force at a time
    assert [x.action for x in decisions(judged)] == ["revert", "set_beta2"]
    assert decisions(judged)[0].params["intervention_id"] == f"i-{decisions(first)[0].id}"
    assert d.engine.busy


def test_escalation_follows_the_ladder_in_order_then_exhausts() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    d.run(13, anomalous=range(1, 14))
    ds, os_ = rungs(d.events), outcomes(d.events)
    assert [x.action for x in ds] == ["set_clip", "set_beta2", "scale_lr"]
    # each failed rung, the last too, is reverted: a spent ladder leaves nothing in force
    assert [x.action for x in decisions(d.events)] == ["set_clip", "revert", "set_beta2", "revert", "scale_lr",
                                                       "revert"]
    assert [x.rung for x in ds] == [0, 1, 2]
    assert [o.verdict for o in os_] == [Verdict.ESCALATED, Verdict.ESCALATED, Verdict.EXHAUSTED]
    # each outcome names the decision (and intervention) it judged; one incident groups them all
    assert [o.decision_id for o in os_] == [x.id for x in ds]
    assert [o.intervention_id for o in os_] == [f"i-{x.id}" for x in ds]
    assert len({x.incident_id for x in decisions(d.events)} | {o.incident_id for o in os_}) == 1
    assert not d.engine.busy


def test_resolved_when_quiet_and_loss_back_near_baseline() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    d.run(6)  # healthy history: baseline loss 2.0
    d.run(1, anomalous=[7], loss=5.0)
    d.run(1, loss=5.0)  # first window step still bad
    out = d.run(3, loss=2.1)  # quiet, loss within 10% of baseline for the judged last 3 steps
    (o,) = outcomes(out)
    assert o.verdict == Verdict.RESOLVED
    assert o.evidence["loss_baseline"] == 2.0 and o.evidence["matching_anomalies"] == 0
    # the change that resolved it is given back, and the run observed without it
    (release,) = decisions(out)
    assert release.action == "release" and release.params["intervention_ids"] == [o.intervention_id]
    assert release.params["steps"] == 100 and d.engine.busy
    done = d.run(199, loss=2.0)
    assert not outcomes(done) and d.engine.busy  # 100 steps of re-warm-up + 100 observed
    (released,) = outcomes(d.run(1, loss=2.0))
    assert released.verdict == Verdict.RELEASED and released.decision_id == release.id
    assert not d.engine.busy


def test_a_release_the_trouble_comes_back_on_is_put_back_and_kept() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    d.run(6)
    d.run(1, anomalous=[7])
    d.run(4)  # resolved at step 11: release
    (release,) = decisions(d.events)[1:]
    assert release.action == "release"
    out = d.run(5, anomalous=[15])  # back while released: judged at once
    assert [o.verdict for o in outcomes(out)] == [Verdict.KEPT]
    (back,) = decisions(out)
    assert back.action == "reapply" and back.params["intervention_id"] == f"i-{release.id}"
    assert "stay in force" in back.reason and not d.engine.busy


def test_quiet_but_loss_too_high_is_not_resolved() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    d.run(6)
    d.run(1, anomalous=[7], loss=5.0)
    out = d.run(4, loss=2.5)  # 25% above baseline, tolerance is 10%
    (o,) = outcomes(out)
    assert o.verdict == Verdict.ESCALATED and o.evidence["loss_ratio"] == pytest.approx(1.25)


def test_nonfinite_loss_in_the_window_fails_the_rung() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    d.run(6)
    d.run(1, anomalous=[7])
    d.run(2)
    out = d.run(2, loss=float("nan"))
    (o,) = outcomes(out)
    assert o.verdict == Verdict.ESCALATED and o.evidence["loss_nonfinite"]


def test_revert_undoes_the_change_then_tries_the_next_rung() -> None:
    d = Driver(Engine(runbook(first_failure="revert"), id_seed="s"))
    d.run(5, anomalous=range(1, 6))
    ds = decisions(d.events)
    assert [x.action for x in ds] == ["set_clip", "revert", "set_beta2"]
    revert = ds[1]
    assert revert.params == {"intervention_id": f"i-{ds[0].id}", "decision_id": ds[0].id}
    assert [o.verdict for o in outcomes(d.events)] == [Verdict.REVERTED]


def test_stop_ends_the_run_and_the_engine() -> None:
    d = Driver(Engine(runbook(last_failure="stop"), id_seed="s"))
    d.run(13, anomalous=range(1, 14))
    ds = rungs(d.events)
    assert [x.action for x in ds] == ["set_clip", "set_beta2", "scale_lr", "checkpoint_and_stop"]
    assert outcomes(d.events)[-1].verdict == Verdict.STOPPED
    assert d.engine.stopped
    assert d.run(20, anomalous=range(14, 34)) == []


def test_cooldown_blocks_new_incidents_for_its_length() -> None:
    d = Driver(Engine(runbook(cooldown=5), id_seed="s"))
    d.run(6)
    d.run(1, anomalous=[7])
    d.run(4)  # resolved at step 11, then released and observed for 200 steps (to step 211)
    assert outcomes(d.events)[-1].verdict == Verdict.RESOLVED
    d.run(200)
    assert outcomes(d.events)[-1].verdict == Verdict.RELEASED
    assert decisions(d.run(5, anomalous=range(212, 217))) == []  # steps 212-216: cooldown
    assert [x.action for x in decisions(d.run(1, anomalous=[217]))] == ["set_clip"]


def test_budget_turns_the_next_change_into_an_alert() -> None:
    d = Driver(Engine(runbook(budget=2), id_seed="s"))
    d.run(9, anomalous=range(1, 10))
    ds = rungs(d.events)
    assert [x.action for x in ds] == ["set_clip", "set_beta2", "alert_only"]
    assert "budget exhausted" in ds[-1].reason and ds[-1].status == DecisionStatus.APPLY
    assert not d.engine.busy


def test_persistence_needs_seen_of_last_steps() -> None:
    eng = Engine(runbook(seen=2), id_seed="s")
    d = Driver(eng)
    assert decisions(d.run(8, anomalous=[1, 7])) == []  # two anomalies, six steps apart (window is 5)
    assert [x.action for x in decisions(d.run(2, anomalous=[9]))] == ["set_clip"]  # 7 and 9: within 5


def test_conditions_filter_kind_metric_and_severity() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    assert decisions(d.run(1, anomalous=[1], make=lambda s: spike(s, metric="loss"))) == []
    assert decisions(d.run(1, anomalous=[2], make=lambda s: spike(s, severity=Severity.INFO))) == []
    assert decisions(d.run(1, anomalous=[3], make=lambda s: spike(s, kind="drift"))) == []
    out = d.run(1, anomalous=[4], make=lambda s: spike(s, metric="grad_norm/transformer.h.0"))
    assert [x.rule for x in decisions(out)] == ["spikes"]


def test_rollback_gets_the_onset_step_from_the_evidence() -> None:
    d = Driver(Engine(runbook(), id_seed="s"))
    d.run(20)
    (dec,) = decisions(d.run(1, anomalous=[21], make=lambda s: spike(s, kind="loss_scale_collapse")))
    assert dec.action == "rollback"
    assert dict(dec.params) == {"lookback": 10, "skip_batches": 3, "onset_step": 19}


def test_failed_application_is_judged_at_once() -> None:
    eng = Engine(runbook(), id_seed="s")
    (dec,) = eng.process(StepRecord(1, {"loss": 2.0}), [spike(1)])
    eng.applied(dec, InterventionRecord(decision_id=dec.id, step=1, action=dec.action, before={},
                                        after={}, error="RuntimeError: boom"))
    out = eng.process(StepRecord(2, {"loss": 2.0}), [])
    assert outcomes(out)[0].evidence["error"] == "RuntimeError: boom"
    assert [x.action for x in decisions(out)] == ["set_beta2"]


def test_propose_mode_waits_for_an_answer() -> None:
    d = Driver(Engine(runbook(mode="propose"), id_seed="s"))
    (prop,) = decisions(d.run(1, anomalous=[1]))
    assert prop.status == DecisionStatus.PROPOSED
    assert decisions(d.run(3, anomalous=[2, 3, 4])) == []  # still waiting, nothing else proposed
    (ok,) = d.answer(prop.id, True)
    assert ok.id == prop.id and ok.status == DecisionStatus.APPROVED and ok.step == 4
    assert d.answer(prop.id, True) == []  # a second answer is stale
    out = d.run(4, anomalous=[5, 6, 7, 8])
    assert [o.verdict for o in outcomes(out)] == [Verdict.ESCALATED]
    assert decisions(out)[0].action == "revert"  # undoing the failed rung returns to the recipe: applied
    assert rungs(out)[0].status == DecisionStatus.PROPOSED  # the next rung is proposed too


def test_rejected_proposal_closes_the_incident() -> None:
    d = Driver(Engine(runbook(mode="propose", cooldown=2), id_seed="s"))
    (prop,) = decisions(d.run(1, anomalous=[1]))
    (no,) = d.answer(prop.id, False)
    assert no.status == DecisionStatus.REJECTED and not d.engine.busy
    assert decisions(d.run(2, anomalous=[2, 3])) == []  # cooldown
    assert decisions(d.run(1, anomalous=[4]))[0].status == DecisionStatus.PROPOSED


def test_unanswered_proposal_expires() -> None:
    d = Driver(Engine(runbook(mode="propose"), id_seed="s"))
    (prop,) = decisions(d.run(1, anomalous=[1]))
    assert decisions(d.run(4)) == []
    (exp,) = decisions(d.run(1))
    assert exp.id == prop.id and exp.status == DecisionStatus.EXPIRED and "expired" in exp.reason
    assert not d.engine.busy and d.answer(prop.id, True) == []


def test_unanswered_proposal_auto_applies() -> None:
    d = Driver(Engine(runbook(mode="propose", on_timeout="auto_apply"), id_seed="s"))
    (prop,) = decisions(d.run(1, anomalous=[1]))
    d.run(4)
    (auto,) = decisions(d.run(1))
    assert auto.status == DecisionStatus.APPROVED and "auto-applied" in auto.reason
    assert d.engine.busy  # now observing the change


def test_mode_argument_overrides_the_runbook() -> None:
    eng = Engine(runbook(mode="apply"), mode="propose", id_seed="s")
    (dec,) = eng.process(StepRecord(1, {"loss": 1.0}), [spike(1)])
    assert dec.status == DecisionStatus.PROPOSED
    with pytest.raises(ValueError, match=r"^engine\.mode must be"):
        Engine(runbook(), mode="observe")


def _stream(engine: Engine, steps: range) -> list[dict]:
    d = Driver(engine)
    d.step = steps.start - 1
    d.run(len(steps), anomalous=[s for s in steps if s % 3 == 0])
    return [json.dumps(e.__class__.__name__) + repr(e) for e in d.events]  # type: ignore[misc]


def test_deterministic_with_a_seed() -> None:
    assert _stream(Engine(runbook(), id_seed="x"), range(1, 60)) == _stream(Engine(runbook(), id_seed="x"),
                                                                            range(1, 60))


@pytest.mark.parametrize("cut", [1, 3, 6, 10, 17])
def test_state_dict_round_trip_mid_incident(cut: int) -> None:
    a = Engine(runbook(mode="propose", on_timeout="auto_apply"), id_seed="x")
    _stream(a, range(1, cut + 1))
    state = json.loads(json.dumps(a.state_dict()))  # plain values only
    b = Engine(runbook(mode="propose", on_timeout="auto_apply"), id_seed="other")
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    c = pickle.loads(pickle.dumps(a))
    rest = range(cut + 1, 60)
    assert _stream(a, rest) == _stream(b, rest) == _stream(c, rest)


def test_load_state_dict_refuses_another_runbooks_state() -> None:
    other = loads_runbook("name: other\nrules: [{name: r, ladder: [{action: alert_only}]}]")
    with pytest.raises(ValueError, match=r"^engine\.state\.runbook is 'test'"):
        Engine(other).load_state_dict(Engine(runbook()).state_dict())


def test_records_measured_before_the_change_landed_are_not_observed() -> None:
    """A live monitor applies a decision at a flush: the flush's later records predate the change."""
    eng = Engine(runbook(), id_seed="s")
    (dec,) = eng.process(StepRecord(1, {"loss": 2.0}), [spike(1)])
    eng.applied(dec, InterventionRecord(decision_id=dec.id, step=6, action=dec.action, before={}, after={}))
    for s in range(2, 6):  # the rest of the flush, still with spikes: measured before the change
        assert eng.process(StepRecord(s, {"loss": 2.0}), [spike(s)]) == []
    out = [ev for s in range(6, 10) for ev in eng.process(StepRecord(s, {"loss": 2.0}), [])]
    assert [o.verdict for o in outcomes(out)] == [Verdict.RESOLVED]
    assert outcomes(out)[0].evidence["observed_steps"] == 4


@settings(max_examples=60, deadline=None)
@given(
    flags=st.lists(st.sampled_from(["", "spike", "collapse", "info"]), min_size=1, max_size=120),
    losses=st.lists(st.floats(min_value=0.5, max_value=5.0) | st.just(float("nan")), min_size=1,
                    max_size=120),
    mode=st.sampled_from(["apply", "propose"]),
    answers=st.lists(st.booleans() | st.none(), max_size=40),
    budget=st.integers(1, 4),
    failures=st.tuples(st.sampled_from(["next", "revert", "stop"]), st.sampled_from(["next", "revert", "stop"])),
)
def test_invariants_on_random_streams(flags, losses, mode, answers, budget, failures) -> None:
    """Whatever the stream: at most one change under observation, each outcome judges the change before it,
    the budget holds, and the engine's state survives a JSON round trip at every step."""
    rb = runbook(mode=mode, budget=budget, on_timeout="auto_apply", first_failure=failures[0],
                 last_failure=failures[1])
    eng = Engine(rb, id_seed="p")
    open_change: str | None = None  # decision id of the change being observed
    changes: list[int] = []
    answer_iter = iter(answers)
    for i, flag in enumerate(flags, start=1):
        make = {"spike": spike, "collapse": lambda s: spike(s, kind="loss_scale_collapse"),
                "info": lambda s: spike(s, severity=Severity.INFO)}.get(flag)
        produced = eng.process(StepRecord(i, {"loss": losses[i % len(losses)]}), [make(i)] if make else [])
        pending = [d for d in decisions(produced) if d.status == DecisionStatus.PROPOSED]
        if pending:
            a = next(answer_iter, None)
            if a is not None:
                produced += eng.answer(pending[-1].id, a, i)
        for ev in produced:
            if isinstance(ev, Outcome):
                assert ev.decision_id == open_change
                open_change = None
            elif ev.status in (DecisionStatus.APPLY, DecisionStatus.APPROVED):
                eng.applied(ev, InterventionRecord(decision_id=ev.id, step=i, action=ev.action, before={},
                                                   after={}))
                if ev.action in ("revert", "reapply", "alert_only", "checkpoint_and_stop"):
                    continue
                assert open_change is None, "a second change while one is observed"
                open_change = ev.id
                if ev.action != "release":  # giving a change back spends no budget
                    changes.append(i)
        assert all(sum(1 for t in changes if t > c - 1000) <= budget for c in changes)
        clone = Engine(eng.runbook)
        clone.load_state_dict(json.loads(json.dumps(eng.state_dict())))
        assert json.dumps(clone.state_dict()) == json.dumps(eng.state_dict())  # NaN losses compare as text


def test_revert_on_the_last_rung_closes_with_one_outcome() -> None:
    d = Driver(Engine(runbook(last_failure="revert"), id_seed="s"))
    d.run(13, anomalous=range(1, 14))
    assert [x.action for x in decisions(d.events)] == ["set_clip", "revert", "set_beta2", "revert", "scale_lr",
                                                       "revert"]
    assert [o.verdict for o in outcomes(d.events)] == [Verdict.ESCALATED, Verdict.ESCALATED, Verdict.REVERTED]
    assert not d.engine.busy


ALERT_THEN_ACT = """
name: alert-then-act
mode: apply
cooldown: 50
release: {steps: 0, observe: 1}
rules:
  - name: persistent
    when: {kind: spike, severity: error}
    ladder:
      - action: set_clip
        params: {max_norm: 1.0}
        observe: 4
  - name: blips
    when: {kind: spike, severity: warning}
    ladder:
      - action: alert_only
        observe: 1
"""


def test_an_alert_only_incident_does_not_start_the_cooldown() -> None:
    """A spike is a warning on its first step and an error once it persists: the alert for the warning must not
    hold back the change the error calls for. A change, by contrast, is followed by the cooldown."""
    d = Driver(Engine(loads_runbook(ALERT_THEN_ACT), id_seed="c"))
    warn = d.run(1, anomalous=[1], make=lambda s: spike(s, severity=Severity.WARNING))
    assert [x.action for x in decisions(warn)] == ["alert_only"]
    d.run(2)  # the alert's one-step window passes; its incident closes
    acted = decisions(d.run(1, anomalous=[4]))
    assert [x.action for x in acted] == ["set_clip"] and acted[0].rule == "persistent"
    d.run(10)  # the change is judged and its incident closes: now the cooldown holds
    assert decisions(d.run(5, anomalous=[15, 16, 17])) == []


REPEAT = """
name: repeat
cooldown: 0
budget: {max_interventions: 20, per_steps: 1000}
rules:
  - name: spikes
    when: {kind: spike, severity: error}
    ladder:
      - action: scale_lr
        params: {factor: 0.5}
        observe: 3
        repeat: 3
      - action: alert_only
        observe: 1
"""


def test_a_repeated_rung_is_tried_again_while_each_attempt_holds_the_trouble_off_longer() -> None:
    d = Driver(Engine(loads_runbook(REPEAT.replace("observe: 3", "observe: 6")), id_seed="r"))
    # attempt 1 (made at 1) is watched over 2-7 and the spike comes back 1 step in; attempt 2 (made at 7) holds it off
    # 2 steps (10), attempt 3 (made at 13) 3 steps (17): each bought time, so each got its turn
    d.run(20, anomalous=[1, 3, 10, 17])
    made = rungs(d.events)[:4]
    assert [x.action for x in made] == ["scale_lr", "scale_lr", "scale_lr", "alert_only"]
    # the attempts stack; once the rung is spent all three are undone, newest first, before the next rung
    reverts = [x for x in decisions(d.events) if x.action == "revert"]
    assert [x.params["intervention_id"] for x in reverts] == [f"i-{x.id}" for x in reversed(made[:3])]
    assert ["attempt 1 of 3" in made[0].reason, "attempt 2 of 3" in made[1].reason,
            "attempt 3 of 3" in made[2].reason] == [True, True, True]
    assert {x.rung for x in made[:3]} == {0} and made[3].rung == 1
    judged = outcomes(d.events)
    assert [o.verdict for o in judged[:3]] == [Verdict.ESCALATED] * 3
    assert [o.evidence.get("attempt") for o in judged[:2]] == [1, 2]


def test_a_repeat_that_holds_the_trouble_off_no_longer_spends_the_rung() -> None:
    d = Driver(Engine(loads_runbook(REPEAT.replace("observe: 3", "observe: 6")), id_seed="r"))
    d.run(20, anomalous=[1, 4, 10])  # attempt 1 held the spike off 2 steps (2-7: back at 4), attempt 2 only 2 (8-13)
    made = rungs(d.events)[:3]
    assert [x.action for x in made] == ["scale_lr", "scale_lr", "alert_only"]
    judged = outcomes(d.events)
    assert "held the trouble off 2 steps, no longer than attempt 1 (2)" in judged[1].evidence["futile"]
    reverts = [x for x in decisions(d.events) if x.action == "revert"]
    assert [x.params["intervention_id"] for x in reverts] == [f"i-{x.id}" for x in reversed(made[:2])]


def test_a_repeat_that_kept_the_trouble_away_is_not_stacked_when_only_the_loss_failed() -> None:
    book = REPEAT.replace("observe: 3", "observe: 4\n        success: {loss_within: 0.1}")
    d = Driver(Engine(loads_runbook(book), id_seed="r"))
    d.run(20, loss=2.0)  # a baseline
    d.run(1, anomalous=[21])
    d.run(8, loss=3.0)  # no spike after the cut, but the loss stays 50% above its baseline
    made = rungs(d.events)[:2]
    assert [x.action for x in made] == ["scale_lr", "alert_only"]
    assert "the loss did not recover" in outcomes(d.events)[0].evidence["futile"]


def test_a_repeated_rung_stops_repeating_once_an_attempt_resolves_it() -> None:
    d = Driver(Engine(loads_runbook(REPEAT), id_seed="r"))
    d.run(4, anomalous=range(1, 5))  # attempt 1 (made at 1) judged at 4: not quiet; attempt 2 made at 4
    d.run(6)  # quiet from here on
    assert [x.action for x in decisions(d.events)] == ["scale_lr", "scale_lr", "release"]
    assert decisions(d.events)[-1].params["intervention_ids"] == [f"i-{x.id}" for x in
                                                                  reversed(decisions(d.events)[:2])]
    assert [o.verdict for o in outcomes(d.events)] == [Verdict.ESCALATED, Verdict.RESOLVED]


def test_repeat_cannot_be_combined_with_revert() -> None:
    from stabmon.runbook.loader import RunbookError

    bad = REPEAT.replace("repeat: 3", "repeat: 3\n        on_failure: revert")
    with pytest.raises((RunbookError, ValueError), match="cannot be repeated"):
        loads_runbook(bad)


SUPERSEDE = """
name: supersede
cooldown: 0
rules:
  - name: act
    when: {kind: no_progress, severity: error}
    ladder: [{action: scale_lr, params: {factor: 0.5}, observe: 3}]
  - name: tell
    when: {kind: "*", severity: warning}
    ladder: [{action: alert_only, observe: 5}]
"""


def test_an_anomaly_a_rule_acts_on_is_not_swallowed_by_an_alert_being_observed() -> None:
    d = Driver(Engine(loads_runbook(SUPERSEDE), id_seed="x"))
    d.run(1, anomalous=[1], make=lambda s: spike(s, severity=Severity.WARNING))  # an alert opens an incident
    out = d.run(1, anomalous=[2], make=lambda s: spike(s, kind="no_progress"))  # reported once, while it waits
    assert [o.verdict for o in outcomes(out)] == [Verdict.SUPERSEDED]
    assert [x.action for x in decisions(out)] == ["scale_lr"]


def test_an_alert_awaiting_approval_does_not_swallow_an_anomaly_a_rule_acts_on() -> None:
    # propose mode: the alert is a proposal too; a damage anomaly while it waits must still open its incident
    d = Driver(Engine(loads_runbook(SUPERSEDE.replace("cooldown: 0", "cooldown: 0\nmode: propose")), id_seed="p"))
    first = d.run(1, anomalous=[1], make=lambda s: spike(s, severity=Severity.WARNING))
    assert [(x.action, x.status) for x in decisions(first)] == [("alert_only", DecisionStatus.PROPOSED)]
    out = d.run(1, anomalous=[2], make=lambda s: spike(s, kind="no_progress"))
    assert [o.verdict for o in outcomes(out)] == [Verdict.SUPERSEDED]
    assert [(x.action, x.status) for x in decisions(out)] == [("scale_lr", DecisionStatus.PROPOSED)]


def test_a_skipped_rung_costs_no_window_and_no_budget() -> None:
    eng = Engine(runbook(budget=1), id_seed="s")
    (dec,) = eng.process(StepRecord(1, {"loss": 2.0}), [spike(1)])
    eng.applied(dec, InterventionRecord(decision_id=dec.id, step=1, action=dec.action, before={},
                                        after={}, not_applied="set_clip only lowers clip: 1 now, the rung gives 1.5"))
    out = eng.process(StepRecord(2, {"loss": 2.0}), [])
    (done,) = outcomes(out)
    assert done.verdict == Verdict.ESCALATED and done.evidence["skipped"].startswith("set_clip only lowers")
    (nxt,) = decisions(out)
    assert nxt.action == "set_beta2" and nxt.status == DecisionStatus.APPLY  # budget 1 not spent by the skip


def test_with_the_real_executor_a_ladder_that_would_loosen_clipping_skips_to_its_first_real_change() -> None:
    from stabmon.interventions import Executor
    from stabmon.overrides import Overrides

    class Target:
        training = follow_ups = None  # a replay-like handle: no model, no follow-ups
        overrides = Overrides()
        step = 1

        def hparams(self) -> dict[str, float]:
            o = self.overrides
            return {"clip": o.max_norm or 1.0, "beta2": o.beta2 or 0.95, "lr": 1e-3 * o.lr_scale}

    eng, ex = Engine(runbook(), id_seed="s"), Executor(Target())
    produced = eng.process(StepRecord(1, {"loss": 2.0}), [spike(1)])
    actions = []
    for step in range(2, 6):
        for ev in decisions(produced):
            record = ex.execute(ev)
            assert record is not None
            eng.applied(ev, record)
            actions.append((ev.action, record.not_applied is not None))
        produced = eng.process(StepRecord(step, {"loss": 2.0}), [])
    # clip 1.0 and beta2 0.95 already in force: both rungs are skipped at once, the LR cut is the first change
    assert actions == [("set_clip", True), ("set_beta2", True), ("scale_lr", False)]


def test_an_approval_timeout_given_as_a_duration_counts_wall_clock_time_not_steps() -> None:
    rb = loads_runbook("name: d\nmode: propose\napproval: {timeout: 2m}\nrules:\n  - name: r\n"
                       "    when: {kind: spike}\n    ladder: [{action: set_clip, params: {max_norm: 1.0}}]\n")
    eng = Engine(rb, id_seed="s")
    (proposal,) = eng.process(StepRecord(1, {"loss": 2.0}, time=1000.0), [spike(1)])
    assert proposal.status == DecisionStatus.PROPOSED
    quiet = [eng.process(StepRecord(s, {"loss": 2.0}, time=1000.0 + s), []) for s in range(2, 100)]
    assert not any(quiet)  # 98 steps in 99 s: still waiting
    (expired,) = eng.process(StepRecord(100, {"loss": 2.0}, time=1121.0), [])
    assert expired.status == DecisionStatus.EXPIRED and "no answer within 2m" in expired.reason


@pytest.mark.parametrize("bad", ["10", "10x", "-5m", "0s", 0, "m"])
def test_a_bad_approval_timeout_is_a_one_line_error(bad: object) -> None:
    from stabmon.runbook import RunbookError

    text = f"name: d\napproval: {{timeout: {bad!r}}}\nrules:\n  - name: r\n    ladder: [{{action: alert_only}}]\n"
    with pytest.raises(RunbookError, match=r"approval.timeout"):
        loads_runbook(text)


LEVERS = """
name: levers
cooldown: 0
budget: {max_interventions: 20, per_steps: 1000}
rules:
  - name: spikes
    when: {kind: spike, severity: error}
    ladder:
      - {action: scale_lr, params: {factor: 0.5}, observe: 3}
      - {action: set_clip, params: {max_norm: 0.5}, observe: 3}
      - {action: scale_lr, params: {factor: 0.5}, observe: 3, on_failure: stop}
"""


def test_a_lever_that_did_not_keep_the_trouble_away_is_not_pulled_again() -> None:
    d = Driver(Engine(loads_runbook(LEVERS), id_seed="l"))
    d.run(8, anomalous=range(1, 9))  # the spikes never stop
    made = rungs(d.events)
    # the LR cut did not keep them away: the second LR cut is passed over, and with nothing left a human is told;
    # the run is not stopped (the stop belonged to the rung passed over)
    assert [x.action for x in made][:3] == ["scale_lr", "set_clip", "alert_only"]
    assert "scale_lr" not in [x.action for x in made[3:]]  # the next incidents begin at set_clip
    assert "rung 3 (scale_lr) of rule spikes passed over: lr did not keep this trouble away" in made[2].reason
    assert not d.engine.stopped
    first = decisions(d.events)[:decisions(d.events).index(made[2])]
    assert len([x for x in first if x.action == "revert"]) == 2  # nothing of the incident is left in force
    # a later incident of the same rule does not cut the LR again either (also after a resume)
    d.run(300)  # quiet: the open incident resolves and is released
    state = d.engine.state_dict()
    assert state["incident"] is None
    assert state["spent"] == {"spikes": ["lr"]}
    again = Driver(Engine(loads_runbook(LEVERS), id_seed="l2"))
    again.engine.load_state_dict(state)
    again.step = d.step
    again.run(4, anomalous=[again.step + 1])
    assert [x.action for x in rungs(again.events)][:1] == ["set_clip"]
    assert "rung 1 (scale_lr) passed over" in rungs(again.events)[0].reason


def test_a_lever_that_kept_the_trouble_away_stays_available() -> None:
    d = Driver(Engine(loads_runbook(LEVERS), id_seed="k"))
    d.run(1, anomalous=[1])
    d.run(6)  # quiet after the cut: resolved, then released
    assert d.engine.state_dict()["spent"] == {}


OTHERS = """
name: others
cooldown: 0
rules:
  - name: logits
    when: {kind: level, metric: "attn_logit/*", severity: error}
    ladder:
      - {action: set_beta2, params: {beta2: 0.95}, observe: 4, success: {quiet_steps: 4}}
      - {action: scale_lr, params: {factor: 0.5}, observe: 4}
  - name: instability
    when: {kind: regression, severity: error}
    ladder: [{action: set_clip, params: {max_norm: 1.0}, observe: 4}]
  - name: tell
    when: {kind: "*", severity: warning}
    ladder: [{action: alert_only, observe: 1}]
"""


def level(step: int) -> Anomaly:
    return spike(step, metric="attn_logit/h.0", kind="level")


def regression(step: int) -> Anomaly:
    return spike(step, metric="loss", kind="regression")


def test_trouble_another_rule_acts_on_counts_against_the_change_being_observed() -> None:
    # a change that holds the logits while the loss regresses has not made the run well: the regression fails
    # the rung (the ladder goes on) instead of waiting, unanswered, behind the clip; the judgement names it
    d = Driver(Engine(loads_runbook(OTHERS), id_seed="o"))
    assert [x.action for x in decisions(d.run(1, anomalous=[1], make=level))] == ["set_beta2"]
    d.run(1, anomalous=[2], make=regression)  # while the clip is observed
    out = d.run(3)
    (judged,) = outcomes(out)
    assert judged.verdict == Verdict.ESCALATED and judged.evidence["matching_anomalies"] == 1
    assert judged.evidence["other_rules"] == ["regression on loss at step 2 (rule instability)"]
    assert decisions(out)[-1].action == "scale_lr"  # the next rung, now


def test_without_other_trouble_the_change_being_observed_is_judged_on_its_own() -> None:
    d = Driver(Engine(loads_runbook(OTHERS), id_seed="o"))
    d.run(1, anomalous=[1], make=level)
    d.run(1, anomalous=[2], make=lambda s: spike(s, metric="loss", kind="regression", severity=Severity.WARNING))
    (judged,) = outcomes(d.run(3))  # a warning no rule changes training for does not count against it
    assert judged.verdict == Verdict.RESOLVED and "other_rules" not in judged.evidence


def test_a_diagnosis_after_a_reverted_change_looks_only_at_steps_trained_without_it() -> None:
    # steps trained under a change since reverted would not reproduce from a checkpoint (the change is gone):
    # a diagnosis that re-ran them would call a healthy machine a suspect
    rb = loads_runbook("name: d\ncooldown: 0\nrules:\n  - name: r\n    when: {kind: spike, severity: error}\n"
                       "    ladder:\n      - {action: scale_lr, params: {factor: 0.5}, observe: 3, "
                       "on_failure: revert}\n      - {action: diagnose, observe: 1}\n")
    d = Driver(Engine(rb, id_seed="g"))
    d.run(2)
    d.run(2, anomalous=[3], make=lambda s: spike(s, severity=Severity.WARNING))  # a sign no rule acts on
    (cut,) = decisions(d.run(1, anomalous=[5]))  # onset: step 2, the update before the spike's first sign
    assert cut.action == "scale_lr" and cut.step == 5
    out = d.run(4, anomalous=[6, 7, 8])
    (diag,) = [x for x in decisions(out) if x.action == "diagnose"]
    assert diag.params["onset_step"] == 2 and diag.params["step"] == 4  # not the step it was decided at
    assert diag.step > 5


def test_another_trouble_during_a_release_puts_the_change_back_and_opens_its_own_incident() -> None:
    # the change resolved its incident and is given back; a loss regression arrives meanwhile: it goes back
    # in (giving it back may have let the trouble in), and the regression gets its own incident at once, the
    # cooldown notwithstanding - a detector that reports once would never be heard otherwise
    d = Driver(Engine(loads_runbook(OTHERS.replace("cooldown: 0", "cooldown: 50")), id_seed="r"))
    d.run(1, anomalous=[1], make=level)
    out = d.run(4)
    assert [o.verdict for o in outcomes(out)] == [Verdict.RESOLVED]
    assert [x.action for x in decisions(out)] == ["release"]
    out = d.run(1, anomalous=[6], make=regression)
    assert [o.verdict for o in outcomes(out)] == [Verdict.KEPT]
    assert [(x.rule, x.action) for x in decisions(out)] == [("logits", "reapply"), ("instability", "set_clip")]
    assert d.engine.busy


def test_its_own_trouble_during_a_release_only_puts_the_change_back() -> None:
    d = Driver(Engine(loads_runbook(OTHERS), id_seed="r"))
    d.run(1, anomalous=[1], make=level)
    d.run(4)
    out = d.run(1, anomalous=[6], make=level)
    assert [x.action for x in decisions(out)] == ["reapply"] and not d.engine.busy
