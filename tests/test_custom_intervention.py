"""An intervention that changes the weights in place, written and registered in this one file: what a
contributor adds for a new action is its module and its test.

``shrink_weights`` multiplies the weights of the layer the incident names (else every weight) by ``factor``. Its
live effect acts on the model :func:`~stabmon.interventions.handle.training_of` hands it (each rank's own: every
rank runs the decision); in replay, which has no weights, the same module says what it would have done. The
test forces it with the conformance matrix's injected fault, then checks the change in the live weights at the
step it was recorded, the record in the store, a resume from the checkpoint after it, and a replay of the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_support import FAULT_STEPS, Fault, Tiny, forced_runbook, tiny_data, tiny_loss
from pydantic import Field

from stabmon.interventions import INTERVENTIONS, StateIntervention, register, training_of
from stabmon.interventions._state import tensors_of
from stabmon.interventions.base import Params


class ShrinkWeightsParams(Params):
    factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    metric: str | None = None
    value: float | None = None


class ShrinkWeights(StateIntervention):
    """Scale the flagged layer's weights by ``factor`` (not revertible: the old weights are not kept)."""

    name = "shrink_weights"
    Params = ShrinkWeightsParams
    revertible = False

    def _apply(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        p = self.params
        assert isinstance(p, ShrinkWeightsParams)
        layers = tensors_of(p.metric)
        training = training_of(self.target)
        if training is None:  # replay: no weights, what it would have done
            return {}, {"layers": list(layers) or "all", "factor": p.factor, "simulated": True}
        names = []
        with torch.no_grad():
            for name, param in training.model.named_parameters():
                if name.endswith("weight") and (not layers or any(name.startswith(f"{x}.") for x in layers)):
                    param.mul_(p.factor)
                    names.append(name)
        return {}, {"scaled": names, "factor": p.factor}


FACTOR = 0.5
STEPS = 60


@pytest.fixture(autouse=True, scope="module")
def registered() -> Any:
    """``register(ShrinkWeights)``, as the action's own module does with ``@register`` at import; here for this
    module's tests only (the package's list of actions is checked elsewhere). The runbook schema is imported
    first: a runbook loaded after a registration may name the action however late it comes."""
    import stabmon.runbook.schema  # noqa: F401

    register(ShrinkWeights)
    yield
    INTERVENTIONS.pop(ShrinkWeights.name)


def _run(tmp_path: Path, *, resume: Any = None) -> tuple[Any, list[dict[str, torch.Tensor]], Tiny]:
    """A monitored loop with the injected fault; the weights after each ``optimizer.step()``."""
    import stabmon
    from stabmon.collect.config import MonitorConfig

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mon = stabmon.Monitor(model, opt, store=f"sqlite:///{tmp_path / 'run.db'}", mode="apply",
                          runbook=forced_runbook("shrink_weights", {"factor": FACTOR}),
                          checkpoint_dir=str(tmp_path / "ckpt"),
                          config=MonitorConfig(flush_every=1, checkpoint_every=10, hang_timeout=None),
                          resume_run_id=None if resume is None else resume["monitor"]["run_id"])
    if resume is not None:
        mon.load_training_state(resume)
    after: list[dict[str, torch.Tensor]] = []
    fault = Fault()
    with mon:
        for step, batch in mon.steps(tiny_data(STEPS + 5), max_steps=STEPS):
            if after:  # the flush of the step before may have changed the weights: they are what it left
                before = {k: v.clone() for k, v in model.state_dict().items()}
                after[-1] = {"trained": after[-1]["trained"], "next": before}  # type: ignore[dict-item]
            loss = fault(step, tiny_loss(model, batch))
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
            after.append({"trained": {k: v.clone() for k, v in model.state_dict().items()}})  # type: ignore[dict-item]
    return mon, after, model


def test_an_intervention_registered_from_one_file_changes_the_weights_where_it_is_recorded(tmp_path: Path) -> None:
    assert INTERVENTIONS["shrink_weights"] is ShrinkWeights
    mon, after, model = _run(tmp_path)
    records = [e for e in mon.events if type(e).__name__ == "InterventionRecord" and e.action == "shrink_weights"]
    assert records and all(r.ok for r in records), records
    changed = []
    for step, seen in enumerate(after[:-1]):
        trained, nxt = seen["trained"], seen["next"]  # type: ignore[index]
        moved = [k for k in trained if not torch.equal(trained[k], nxt[k])]
        if moved:
            assert all(torch.equal(nxt[k], trained[k] * FACTOR) for k in moved), f"step {step}: not x{FACTOR}"
            assert all(k.endswith("weight") for k in moved)
            changed.append(step + 1)  # made in the flush after this step: in force from the next
    assert changed == [r.step for r in records], (changed, [r.step for r in records])
    assert min(changed) >= min(FAULT_STEPS)
    import sqlite3

    with sqlite3.connect(tmp_path / "run.db") as con:
        stored = con.execute("SELECT count(*) FROM interventions WHERE action = 'shrink_weights'").fetchone()[0]
    assert stored == len(records)


def test_a_resume_after_it_holds_the_changed_weights(tmp_path: Path) -> None:
    import stabmon

    mon, _, model = _run(tmp_path)
    found = stabmon.resume_checkpoint(tmp_path / "ckpt")
    assert found is not None
    info, state = found
    assert info.step == STEPS
    for name, value in model.state_dict().items():
        assert torch.equal(state["model"][name], value), name


def test_replay_runs_the_same_module_without_weights(tmp_path: Path) -> None:
    from stabmon.replay.replay import replay

    mon, _, _ = _run(tmp_path)
    result = replay(list(mon.records), runbook=forced_runbook("shrink_weights", {"factor": FACTOR}))
    simulated = [e for e in result.events if type(e).__name__ == "InterventionRecord"]
    assert simulated and all(r.after.get("simulated") for r in simulated)


@pytest.mark.parametrize("factor", [0.0, 1.0, -2.0])
def test_a_bad_factor_is_refused_where_the_runbook_is_loaded(factor: float) -> None:
    with pytest.raises(ValueError, match="factor"):
        forced_runbook("shrink_weights", {"factor": factor})
