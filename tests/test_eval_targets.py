"""The issue-5 targets on the real labelled runs, with the shipped defaults (nothing fitted to the labels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stabmon.replay.eval import PEERS, STABMON, EvalReport, evaluate

pytestmark = pytest.mark.slow

CONTROLS = (
    "llmc-gpt2-124m-SiddanthEmani/main.log",
    "deepspeed-chat-opt/opt-1.3b-globalBatchSize128.log",
    "polypythias-wandb-lm-loss/410m-seed2",
    "polypythias-wandb-lm-loss/410m-seed5",
)
# a 2-record fragment: a first record (the only baseline) and a record whose only signals are a missing lm loss
# and one loss-scale halving with an overflow - routine fp16 behaviour on its own; nothing numeric to flag
UNDETECTABLE = {"bigscience-chronicles/tr8-104B_exp12_divergence-it9026-9027.log"}


@pytest.fixture(scope="module")
def report(real_runs: Path) -> EvalReport:
    # the corpus's labels name one segment of a resumed W&B run (410m-seed3, 160m-seed4): join its segments
    return evaluate(real_runs / "LABELS.csv", runbook="default", jobs=2, group_wandb=True)


def _stab(report: EvalReport) -> dict[str, dict[str, Any]]:
    return {r["file"]: r for r in report.incidents if r["method"] == STABMON and r["category"] == "numeric"}


def test_tr11_spike_flagged_by_it31216(report: EvalReport) -> None:
    row = _stab(report)["bigscience-chronicles/tr11-176B_spike-it31214-31251.log"]
    assert row["detected"] and row["first_alert_step"] <= 31216


def test_every_numeric_incident_with_a_numeric_signal_is_detected(report: EvalReport) -> None:
    rows = _stab(report)
    assert len(rows) == 13
    missed = {f for f, r in rows.items() if not r["detected"]}
    assert missed <= UNDETECTABLE, missed


def test_lead_is_not_negative_where_grad_norm_or_loss_scale_lead(report: EvalReport) -> None:
    leading = [r for r in _stab(report).values() if r["kind"].startswith(("grad_norm_spike", "loss_scale"))
               or "loss_scale" in r["kind"]]
    assert len(leading) >= 6
    # tr11-176B's first step (it31215: grad norm 3.9x, loss +1%) is inside what a healthy run comes back from
    # on its own (llm.c: 3.5x at 3843, 5.2x at 12008, the loss unmoved), so it is recorded at info and the
    # alert goes at it31216 (9.9x), three steps before the loss spike: see test_tr11_spike_flagged_by_it31216
    tr11 = "bigscience-chronicles/tr11-176B_spike-it31214-31251.log"
    assert all(r["lead_steps"] is not None and r["lead_steps"] >= (-1 if r["file"] == tr11 else 0)
               for r in leading), leading


def test_healthy_controls_send_nothing_under_default_routing(report: EvalReport) -> None:
    files = {r["file"]: r for r in report.files if r["method"] == STABMON}
    rlhf = "deepspeed-chat-opt/actor_opt-1.3b_critic_opt-350m_globalBatchSize64.log"
    for run in (*CONTROLS, rlhf):
        assert files[run]["false_sent_slack"] == 0 and files[run]["false_sent_pagerduty"] == 0, files[run]
        if run != CONTROLS[0]:  # llm.c: its one message is the labelled 15x blip at 8715, inside its window
            assert files[run]["sent_slack"] == 0 and files[run]["sent_pagerduty"] == 0, files[run]
    assert files[CONTROLS[0]]["sent_slack"] == 1 and files[CONTROLS[0]]["sent_pagerduty"] == 0
    summary = report.summary[STABMON]
    assert summary["detected_sent_slack"] >= 12 and summary["numeric_incidents"] == 13


def test_no_intervention_on_the_healthy_controls(report: EvalReport) -> None:
    files = {r["file"]: r for r in report.files if r["method"] == STABMON}
    for run in CONTROLS:
        assert files[run]["intervention_decisions"] == 0, (run, files[run])
        assert not files[run]["error"]


def test_recall_at_least_every_peers_at_no_more_false_alarms(report: EvalReport) -> None:
    s = report.summary
    stab = s[STABMON]
    points = [(stab["recall"], stab["false_alarms"]), (stab["recall_at_error"], stab["false_alarms_at_error"])]
    for peer in PEERS:
        p = s[peer]
        matched = [recall for recall, fa in points if fa <= p["false_alarms"]]
        assert matched and max(matched) >= p["recall"], (peer, p, points)
