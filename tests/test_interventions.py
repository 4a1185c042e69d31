"""Interventions: the base class's guard and audit record, each action's apply / revert, the live executor
(failures never raise, reverts, state across a resume) and a contract suite over every registered class."""

from __future__ import annotations

import dataclasses
import pickle
import threading
from typing import Any

import pytest

from stabmon.diagnose import Diagnosis
from stabmon.events import Decision, DecisionStatus
from stabmon.interventions import (
    INTERVENTIONS,
    STOP_EXIT_CODE,
    Executor,
    Intervention,
    InterventionError,
    StateIntervention,
    get_intervention,
    register,
)
from stabmon.interventions.base import NoChange
from stabmon.interventions.traits import REVERT, Traits, changed_training, recorded_traits, traits_of
from stabmon.overrides import Overrides
from stabmon.pipeline import ExecutorLike


class FakeTarget:
    """A test double of the :class:`~stabmon.interventions.handle.Handle` the executor passes in (duck-typed: the
    executor and the interventions read only these attributes)."""
    training = follow_ups = None  # a replay-like handle: no model, no follow-ups

    def __init__(self) -> None:
        self.overrides = Overrides()
        self.step = 100
        self.base = {"lr": 1e-3, "beta2": 0.98, "weight_decay": 0.05, "clip": 2.5}
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def hparams(self) -> dict[str, float]:
        o = self.overrides
        return {"lr": self.base["lr"] * o.lr_scale, "beta2": o.beta2 or self.base["beta2"],
                "weight_decay": self.base["weight_decay"] if o.weight_decay is None else o.weight_decay,
                "clip": o.max_norm or self.base["clip"]}

    def rollback(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(("rollback", kw))
        self.step = kw["onset_step"] - kw["lookback"]
        return {"checkpoint_step": self.step, "restored_step": self.step,
                "skipped": [self.step, self.step + kw["skip_batches"]]}

    def checkpoint_and_stop(self, *, reason: str) -> dict[str, Any]:
        self.calls.append(("stop", {"reason": reason}))
        return {"path": "ckpt.pt"}

    def diagnose(self, **kw: Any) -> Diagnosis:
        self.calls.append(("diagnose", kw))
        return Diagnosis("state", "the state is to blame", onset_step=kw["onset_step"])

    def note(self, change: dict[str, Any]) -> None:
        self.calls.append((change["action"], change))


def decision(action: str, params: dict[str, Any] | None = None, **kw: Any) -> Decision:
    return Decision(step=100, action=action, params=params or {}, status=DecisionStatus.APPLY, runbook="rb",
                    rule="r", rung=0, reason="test", **kw)


def test_the_executor_matches_the_protocol() -> None:
    assert isinstance(Executor(FakeTarget()), ExecutorLike)


@pytest.mark.parametrize(("action", "params", "field", "value", "hparam", "after"), [
    ("scale_lr", {"factor": 0.9}, "lr_scale", 0.9, "lr", 0.9e-3),
    ("scale_lr", {"scale": 0.667}, "lr_scale", 0.667, "lr", 0.667e-3),
    ("set_clip", {"max_norm": 1.5}, "max_norm", 1.5, "clip", 1.5),
    ("set_beta2", {"beta2": 0.95}, "beta2", 0.95, "beta2", 0.95),
    ("set_weight_decay", {"weight_decay": 0.1}, "weight_decay", 0.1, "weight_decay", 0.1),
    ("skip_step", {"factor": 6.0}, "skip_factor", 6.0, "skip_factor", 6.0),
])
def test_override_interventions_apply_record_and_revert(action, params, field, value, hparam, after) -> None:
    t = FakeTarget()
    before_hp = t.hparams().get(hparam)
    iv = get_intervention(action)(t, params, decision_id="d1")
    rec = iv.apply()
    assert getattr(t.overrides, field) == pytest.approx(value)
    assert rec.decision_id == "d1" and rec.action == action and rec.step == 100 and not rec.reverted
    assert rec.before[hparam] == before_hp
    if field != hparam:
        assert rec.before[field] == getattr(Overrides(), field)
    assert rec.after[field] == pytest.approx(value) and rec.after[hparam] == pytest.approx(after)
    undo = iv.revert(decision_id="d2")
    assert getattr(t.overrides, field) == getattr(Overrides(), field)
    assert undo.reverted and undo.decision_id == "d2" and undo.before[field] == pytest.approx(value)


def test_scale_lr_factor_compounds_on_the_scale_in_force() -> None:
    t = FakeTarget()
    get_intervention("scale_lr")(t, {"factor": 0.9}, decision_id="a").apply()
    rec = get_intervention("scale_lr")(t, {"factor": 0.9}, decision_id="b").apply()
    assert t.overrides.lr_scale == pytest.approx(0.81) and rec.before["lr_scale"] == pytest.approx(0.9)


def test_guard_apply_once_revert_once_after_apply() -> None:
    iv = get_intervention("set_clip")(FakeTarget(), {"max_norm": 1.0}, decision_id="d")
    with pytest.raises(InterventionError, match="never applied"):
        iv.revert(decision_id="x")
    iv.apply()
    with pytest.raises(InterventionError, match="already applied"):
        iv.apply()
    iv.revert(decision_id="x")
    with pytest.raises(InterventionError, match="already reverted"):
        iv.revert(decision_id="y")


def test_irreversible_actions_refuse_to_revert() -> None:
    for action in ("checkpoint_and_stop", "alert_only"):
        iv = get_intervention(action)(FakeTarget(), {}, decision_id="d")
        iv.apply()
        with pytest.raises(InterventionError, match="cannot be reverted"):
            iv.revert(decision_id="x")


def test_a_rollback_reverts_only_its_learning_rate_change() -> None:
    """The restored weights stay; a rollback that capped the LR gives the cap back, one that did not has
    nothing to give back (skipped, not failed)."""
    plain = get_intervention("rollback")(FakeTarget(), {}, decision_id="d")
    assert not type(plain).holds(plain.apply())
    with pytest.raises(NoChange, match="changed no learning-rate setting"):
        plain.revert(decision_id="x")
    target = FakeTarget()
    capped = get_intervention("rollback")(target, {"lr_cap": 0.5, "onset_lr": 0.01}, decision_id="d")
    assert type(capped).holds(capped.apply()) and target.overrides.lr_cap == 0.005
    record = capped.revert(decision_id="x")
    assert target.overrides.lr_cap is None and record.before == {"lr_cap": 0.005} and record.after == {"lr_cap": None}
    capped.reapply(decision_id="y")  # what a release that the trouble came back on does
    assert target.overrides.lr_cap == 0.005


def test_invalid_override_value_leaves_the_target_untouched() -> None:
    t = FakeTarget()
    t.overrides.lr_scale = 1e-300
    with pytest.raises(ValueError, match="overrides.lr_scale"):
        get_intervention("scale_lr")(t, {"factor": 1e-300}, decision_id="d").apply()
    assert t.overrides.lr_scale == 1e-300


def test_params_are_validated_strictly() -> None:
    cls = get_intervention("set_clip")
    for bad in ({}, {"max_norm": "1.0"}, {"max_norm": 0}, {"max_norm": 1.0, "extra": 1}):
        with pytest.raises(ValueError):
            cls(FakeTarget(), bad, decision_id="d")
    with pytest.raises(ValueError, match="exactly one of factor or scale"):
        get_intervention("scale_lr")(FakeTarget(), {"factor": 0.9, "scale": 0.5}, decision_id="d")


def test_rollback_passes_onset_lookback_and_skip() -> None:
    t = FakeTarget()
    rec = get_intervention("rollback")(t, {"onset_step": 90, "lookback": 20, "skip_batches": 300},
                                       decision_id="d").apply()
    assert t.calls == [("rollback", {"onset_step": 90, "lookback": 20, "skip_batches": 300})]
    assert rec.before == {"step": 100, "onset_step": 90, "lookback": 20}
    assert rec.after["restored_step"] == 70 and rec.after["skipped"] == [70, 370]


def test_checkpoint_and_stop_records_the_documented_exit_code() -> None:
    t = FakeTarget()
    rec = get_intervention("checkpoint_and_stop")(t, {"reason": "ladder exhausted"}, decision_id="d").apply()
    assert t.calls == [("stop", {"reason": "ladder exhausted"})]
    assert rec.after == {"path": "ckpt.pt", "exit_code": STOP_EXIT_CODE} and STOP_EXIT_CODE == 86


def test_executor_applies_and_reverts_by_intervention_id() -> None:
    t = FakeTarget()
    ex = Executor(t)
    rec = ex.execute(decision("set_beta2", {"beta2": 0.95}))
    assert t.overrides.beta2 == 0.95
    undo = ex.execute(decision("revert", {"intervention_id": rec.id}))
    assert t.overrides.beta2 is None and undo.reverted and undo.error is None


def test_executor_failures_are_recorded_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    t = FakeTarget()

    def boom(**kw: Any) -> dict[str, Any]:
        raise FileNotFoundError("no valid checkpoint")

    t.rollback = boom  # type: ignore[method-assign]
    ex = Executor(t)
    rec = ex.execute(decision("rollback", {"onset_step": 50}))
    assert rec.error == "FileNotFoundError: no valid checkpoint" and rec.after == {}
    assert rec.stored_after() == {"error": "FileNotFoundError: no valid checkpoint"}  # as stored
    missing = ex.execute(decision("revert", {"intervention_id": "nope"}))
    assert missing.error.startswith("LookupError")
    assert ex.execute(decision("teleport")).error.startswith("KeyError")
    assert ex.errors == 3 and "rollback at step 100 failed" in caplog.text
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 3 and all("\n" not in m for m in lines)  # one line each: no traceback
    assert not any(r.exc_info for r in caplog.records if r.levelname == "ERROR")


def test_executor_state_survives_a_resume_so_reverts_still_work() -> None:
    t = FakeTarget()
    ex = Executor(t)
    rec = ex.execute(decision("set_clip", {"max_norm": 1.0}))
    state = ex.state_dict()
    t2 = FakeTarget()
    t2.overrides.load_state_dict(t.overrides.state_dict())  # the monitor restores overrides itself
    ex2 = Executor(t2)
    ex2.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert ex2.state_dict() == state
    undo = ex2.execute(decision("revert", {"intervention_id": rec.id}))
    assert undo.error is None and t2.overrides.max_norm is None
    twice = ex2.execute(decision("revert", {"intervention_id": rec.id}))
    assert twice.error.startswith("LookupError")


def test_concurrent_applications_are_serialised() -> None:
    t = FakeTarget()
    ivs = [get_intervention("scale_lr")(t, {"factor": 0.5}, decision_id=str(i)) for i in range(8)]
    threads = [threading.Thread(target=iv.apply) for iv in ivs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.overrides.lr_scale == pytest.approx(0.5**8)
    befores = sorted(iv.record.before["lr_scale"] for iv in ivs)  # type: ignore[union-attr]
    assert befores == sorted(0.5**i for i in range(8))


def test_register_custom_intervention() -> None:
    class Noop(Intervention):
        """Does nothing."""

        name = "noop_for_test"

        def _apply(self):
            return {}, {}

    try:
        register(Noop)
        assert get_intervention("noop_for_test") is Noop
        with pytest.raises(ValueError, match=r"^intervention\.name must be"):
            register(type("Bad", (Intervention,), {"name": "revert"}))
    finally:
        INTERVENTIONS.pop("noop_for_test", None)
    with pytest.raises(KeyError, match="unknown intervention 'noop_for_test'"):
        get_intervention("noop_for_test")


# -- contract suite: every registered intervention --
VALID_PARAMS = {"scale_lr": {"factor": 0.9}, "set_clip": {"max_norm": 1.0}, "set_beta2": {"beta2": 0.95},
                "set_weight_decay": {"weight_decay": 0.1}, "skip_step": {"factor": 5.0}, "rollback": {},
                "checkpoint_and_stop": {}, "alert_only": {}, "diagnose": {"onset_step": 90, "metric": "loss"},
                "reset_moments": {"tensors": ["blocks.0"]}, "adaptive_clip": {}, "clip_update": {"max_rms": 1.0},
                "qk_clip": {"max_logit": 250.0}, "scale_layer_lr": {"tensors": ["lm_head"]}}


@pytest.mark.parametrize("name", sorted(INTERVENTIONS))
def test_contract(name: str) -> None:
    cls = INTERVENTIONS[name]
    assert cls.name == name and cls.__doc__ and ">>>" in cls.__doc__
    assert name in VALID_PARAMS, "add valid params for the new intervention to this suite"
    iv = cls(FakeTarget(), VALID_PARAMS[name], decision_id="d")
    with pytest.raises(ValueError):  # params are immutable
        iv.params.__setattr__(next(iter(cls.Params.model_fields), "x"), 1)
    rec = iv.apply()
    assert dataclasses.asdict(rec)["decision_id"] == "d"
    pickle.loads(pickle.dumps(rec))
    sd = iv.state_dict()
    clone = cls(FakeTarget(), sd["params"], decision_id=sd["decision_id"])
    clone.load_state_dict(pickle.loads(pickle.dumps(sd)))
    assert clone.state_dict() == sd
    assert clone.applied and (clone.revertible == cls.revertible)


def test_rollback_lr_cap_is_a_fraction_of_the_onset_lr_and_halves_on_each_repeat() -> None:
    from stabmon.interventions.rollback import Rollback
    from stabmon.overrides import Overrides

    class Target:
        training = follow_ups = None  # a replay-like handle: no model, no follow-ups
        overrides = Overrides()
        step = 200

        def hparams(self) -> dict[str, float]:
            return {"lr": 0.3}

        def rollback(self, **_: object) -> dict[str, object]:
            return {"checkpoint_step": 100, "restored_step": 100}

    t = Target()
    first = Rollback(t, {"onset_step": 150, "onset_lr": 0.2, "lr_cap": 0.5}, decision_id="d1").apply()
    assert first.after["lr_cap"] == pytest.approx(0.1) and t.overrides.scaled_lr(0.3) == pytest.approx(0.1)
    again = Rollback(t, {"onset_step": 150, "onset_lr": 0.2, "lr_cap": 0.5}, decision_id="d2").apply()
    assert again.before["lr_cap"] == pytest.approx(0.1) and again.after["lr_cap"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="lr_cap"):
        Rollback(t, {"lr_cap": 1.5}, decision_id="d3")
    with pytest.raises(ValueError, match=r"^overrides.lr_cap must be > 0, got 0.0$"):
        Overrides(lr_cap=0.0)


@pytest.mark.parametrize(("action", "params", "why"), [
    ("set_clip", {"max_norm": 3.0}, "set_clip only lowers clip: 2.5 now, the rung gives 3"),  # would loosen
    ("set_clip", {"max_norm": 2.5}, "set_clip only lowers clip: 2.5 now, the rung gives 2.5"),  # no change
    ("set_beta2", {"beta2": 0.98}, "set_beta2 only lowers beta2: 0.98 now, the rung gives 0.98"),
    ("set_weight_decay", {"weight_decay": 0.01}, "only raises weight_decay: 0.05 now, the rung gives 0.01"),
    ("scale_lr", {"factor": 1.5}, "scale_lr only lowers lr: 1 now, the rung gives 1.5"),
])
def test_a_change_the_harmful_way_or_none_at_all_is_skipped_and_recorded(action, params, why) -> None:
    t = FakeTarget()
    with pytest.raises(NoChange, match=why):
        get_intervention(action)(t, params, decision_id="d").apply()
    assert t.overrides == Overrides()  # nothing touched
    ex = Executor(t)
    rec = ex.execute(decision(action, params))
    assert rec is not None and why in rec.not_applied and rec.error is None and ex.errors == 0


def test_scale_lr_during_a_warm_up_at_lr_zero_still_applies_to_later_steps() -> None:
    t = FakeTarget()
    t.base["lr"] = 0.0
    get_intervention("scale_lr")(t, {"factor": 0.5}, decision_id="d").apply()
    assert t.overrides.lr_scale == 0.5


def test_weight_decay_scales_each_param_group_from_its_own_value_and_groups_at_zero_stay_at_zero() -> None:
    import torch

    from stabmon.monitor import Monitor

    decay, no_decay, other = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    optimizer = torch.optim.AdamW([
        {"params": [decay], "weight_decay": 0.1},
        {"params": [no_decay], "weight_decay": 0.0},
        {"params": [other], "weight_decay": 0.05},
    ], lr=1e-3)
    seen: list[list[float]] = []
    monitor = Monitor(torch.nn.ParameterList([decay, no_decay, other]), optimizer, store=None)
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append([g["weight_decay"] for g in opt.param_groups]))
    assert monitor.hparams()["weight_decay"] == pytest.approx(0.1)
    monitor.overrides.weight_decay = 0.2  # what set_weight_decay does
    assert monitor.hparams()["weight_decay"] == pytest.approx(0.2)
    for _, _ in monitor.steps(range(1)):
        (decay.sum() + no_decay.sum() + other.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    assert seen == [[pytest.approx(0.2), 0.0, pytest.approx(0.1)]]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0, 0.05]  # the optimizer's own, after


class ScheduledTarget(FakeTarget):
    """FakeTarget whose LR in force is the overrides' (a cap and a release's re-warm-up included)."""

    def hparams(self) -> dict[str, float]:
        return {**super().hparams(), "lr": self.overrides.scaled_lr(self.base["lr"])}


def _decide(action: str, params: dict[str, Any], did: str) -> Decision:
    return Decision(step=100, action=action, params=params, status=DecisionStatus.APPLY, runbook="r", rule="x",
                    rung=0, reason="test", id=did)


def test_a_release_gives_changes_back_and_rewarms_the_lr_and_a_reapply_puts_them_back() -> None:
    target = ScheduledTarget()
    ex = Executor(target)
    clip = ex.execute(_decide("set_clip", {"max_norm": 0.5}, "d1"))
    lr = ex.execute(_decide("scale_lr", {"factor": 0.25}, "d2"))
    assert clip is not None and lr is not None and target.hparams()["lr"] == pytest.approx(2.5e-4)
    release = ex.execute(_decide("release", {"intervention_ids": [lr.id, clip.id], "steps": 2}, "d3"))
    assert release is not None and release.ok and release.action == "release"
    assert target.overrides.max_norm is None and target.overrides.lr_scale == 1.0  # settings back at once
    assert release.after["ramp_from"] == pytest.approx(0.25) and release.after["ramp_steps"] == 2
    seen = []
    for _ in range(3):  # the LR climbs back to the schedule over 2 optimizer steps
        seen.append(target.hparams()["lr"])
        target.overrides.advance()
    assert seen == pytest.approx([2.5e-4, 5e-4, 1e-3])
    state = ex.state_dict()
    resumed = Executor(target)
    resumed.load_state_dict(state)  # a resumed run can still put them back
    back = resumed.execute(_decide("reapply", {"intervention_id": release.id}, "d4"))
    assert back is not None and back.ok and back.after == {"max_norm": 0.5, "lr_scale": 0.25}
    assert target.overrides.max_norm == 0.5 and target.overrides.lr_scale == 0.25
    again = resumed.execute(_decide("reapply", {"intervention_id": release.id}, "d5"))
    assert again is not None and again.error is not None and "no release" in again.error


def test_a_release_of_a_change_not_in_force_fails_with_one_line() -> None:
    ex = Executor(ScheduledTarget())
    record = ex.execute(_decide("release", {"intervention_ids": ["nope"], "steps": 5}, "d1"))
    assert record is not None and record.error == "LookupError: no change in force to release: nope"


# -- traits: what each intervention declares, read by the engine instead of its name --
TRAITS = ("changes_training", "stays_in_force", "stops_run", "rewinds_step", "diagnoses", "revertible")


@pytest.mark.parametrize("name", sorted(INTERVENTIONS))
def test_every_intervention_declares_consistent_traits(name: str) -> None:
    cls = INTERVENTIONS[name]
    declared = {t: getattr(cls, t) for t in TRAITS}
    assert all(isinstance(v, bool) for v in declared.values()), declared
    t = traits_of(name)
    assert {f: getattr(t, f) for f in TRAITS} == declared and not t.undoes
    if t.revertible:  # what can be undone was in force
        assert t.stays_in_force
    if t.stops_run or t.diagnoses or not t.changes_training:  # nothing of it is left to revert or keep
        assert not t.stays_in_force and not t.revertible


def test_traits_of_the_builtin_actions() -> None:
    flags = {name: {f for f in TRAITS if getattr(traits_of(name), f)} for name in INTERVENTIONS}
    assert flags["alert_only"] == set()
    assert flags["checkpoint_and_stop"] == {"changes_training", "stops_run"}
    assert flags["rollback"] == {"changes_training", "stays_in_force", "rewinds_step", "revertible"}  # its LR cap
    assert flags["diagnose"] == {"changes_training", "diagnoses"}
    assert flags["set_clip"] == {"changes_training", "stays_in_force", "revertible"}
    assert traits_of(REVERT).undoes and not traits_of(REVERT).stays_in_force
    with pytest.raises(KeyError, match="unknown intervention 'teleport'"):
        traits_of("teleport")
    assert recorded_traits("teleport") == Traits()  # a stored action of a custom intervention: a change


def test_a_failed_or_skipped_record_keeps_its_reason_typed_and_stores_it_inside_after() -> None:
    from stabmon.events import InterventionRecord, to_dict
    from stabmon.store.codec import event_from_row, event_row

    failed = InterventionRecord("d1", 7, "rollback", {}, {}, error="FileNotFoundError: gone")
    skipped = InterventionRecord("d2", 8, "set_clip", {"clip": 1.0}, {}, not_applied="would loosen clipping")
    # neither changed the run: a failed change did not happen, a skipped one was not made
    assert not failed.ok and skipped.ok and not changed_training(failed) and not changed_training(skipped)
    stored = {"error": "FileNotFoundError: gone"}, {"not_applied": "would loosen clipping"}
    for rec, after in zip((failed, skipped), stored, strict=True):
        assert to_dict(rec)["after"] == after and "error" not in to_dict(rec) and "not_applied" not in to_dict(rec)
        row = event_row(rec, run_id="r", seq=1)
        assert row["after"] == after
        assert event_from_row("interventions", row) == rec


def test_a_released_lr_cap_holds_until_the_schedule_is_below_where_the_trouble_began() -> None:
    """A warm-up still rising past the edge would bring the trouble straight back: the cap of half the LR the
    trouble began at (0.01) is lifted only once the schedule comes down to 0.01, then re-warmed."""
    target = ScheduledTarget()
    target.base["lr"] = 0.02  # the schedule, above the LR the trouble began at
    ex = Executor(target)
    capped = ex.execute(_decide("rollback", {"lr_cap": 0.5, "onset_lr": 0.01}, "d1"))
    assert capped is not None and target.overrides.lr_cap == 0.005
    release = ex.execute(_decide("release", {"intervention_ids": [capped.id], "steps": 2}, "d2"))
    assert release is not None and release.after == {"lr_cap": 0.005, "lifted_below_lr": 0.01}
    target.overrides.settle(0.02)
    assert target.hparams()["lr"] == 0.005  # held
    target.overrides.settle(0.008)  # the schedule came down
    assert target.overrides.lr_cap is None and target.overrides.scaled_lr(0.008) == pytest.approx(0.005)
    target.overrides.advance(2)
    assert target.overrides.scaled_lr(0.008) == pytest.approx(0.008)


@pytest.mark.parametrize("name", sorted(n for n, c in INTERVENTIONS.items() if issubclass(c, StateIntervention)))
def test_state_level_interventions_declare_their_traits(name: str) -> None:
    cls = INTERVENTIONS[name]
    assert cls.changes_training is True and cls.stops_run is False and cls.rewinds_step is False
    assert cls.takes_evidence and "metric" in cls.Params.model_fields  # the pipeline may fill in the evidence
