"""The Grafana dashboard's SQL runs against the real schema on PostgreSQL and finds what a run recorded."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

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
from stabmon.store import StoreConfig, open_store, upgrade

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "stabmon-run.json"


def queries(dash: dict) -> dict[str, str]:
    out = {f"panel {p['title']}": t["rawSql"] for p in dash["panels"] for t in p["targets"]}
    out |= {
        f"annotation {a['name']}": a["target"]["rawSql"] for a in dash["annotations"]["list"] if "target" in a
    }
    out |= {f"variable {v['name']}": v["query"] for v in dash["templating"]["list"] if v["type"] == "query"}
    return out


def test_dashboard_queries_run_on_the_schema(pg_url: str) -> None:
    upgrade(pg_url)
    now = time.time()
    with open_store(pg_url, config=StoreConfig(flush_interval=0.02)) as store:
        run = store.start_run(name="dash", environment={})
        store.write_steps(
            run_id=run,
            records=[
                StepRecord(
                    s,
                    {"loss": 2.0 - s / 100, "grad_norm": 1.0 + s % 3, "loss_scale": 2.0**16, "step_time": 0.03,
                     "tokens_per_sec": 3e4, "act_rms/h.0": 1.5, "act_rms/h.1": 2.5, "grad_norm/h.0": 0.4,
                     "emb_drift/wte": s / 1000, "emb_update/wte": 1e-4, "emb_update/wpe": 2e-4,
                     "act_rmsX": 9.0},  # not a module metric: must not show up among the activation norms
                    time=now + s,
                )
                for s in range(50)
            ],
        )
        a = Anomaly("spike", "grad_norm", 20, 9.0, Severity.ERROR, "zscore", ((20, 3.0),), message="spike")
        d = Decision(
            20, "scale_lr", {"factor": 0.5}, DecisionStatus.APPLY, "default", "grad_spike", 0, "r", a.id
        )
        i = InterventionRecord(d.id, 21, "scale_lr", {"lr": 1e-3}, {"lr": 5e-4})
        o = Outcome(i.id, d.id, 40, Verdict.RESOLVED, {})
        store.write_events(run_id=run, events=[a, d, i, o])
        assert store.flush(20)

    dash = json.loads(DASHBOARD.read_text())
    engine = sa.create_engine(pg_url)
    results = {}
    with engine.connect() as conn:
        for name, sql in queries(dash).items():
            sql = sql.replace("$run", run)
            sql = re.sub(r"\$__unixEpochFilter\(([^)]+)\)", r"\1 BETWEEN 0 AND 1e12", sql)
            assert "$" not in sql, (name, sql)
            results[name] = conn.execute(sa.text(sql)).mappings().all()
    engine.dispose()

    assert len(results["panel Gradient norm (global, before clipping)"]) == 50
    assert results["panel Loss"][0]["loss"] == 2.0
    acts = results["panel Activation norms (RMS per module)"]
    assert len(acts) == 100 and {r["metric"] for r in acts} == {"act_rms/h.0", "act_rms/h.1"}
    assert {r["metric"] for r in results["panel Gradient norm per layer"]} == {"grad_norm/h.0"}
    drift = results["panel Embedding drift ||W - W0|| / ||W0||"]
    assert [r["value"] for r in drift][:3] == [0.0, 0.001, 0.002]
    ratio = results["panel Embedding update ratio ||W_t - W_t-1|| / ||W_t||"]
    assert {r["metric"] for r in ratio} == {"emb_update/wte", "emb_update/wpe"} and len(ratio) == 100
    assert [r["step_time"] for r in results["panel Step time"]] == [0.03] * 50
    assert len(results["panel Tokens per second"]) == 50
    assert {r["__value"] for r in results["variable run"]} == {run}
    [anomaly] = results["annotation Anomalies"]
    assert anomaly["time"].timestamp() == pytest.approx(now + 20, abs=1e-3)
    assert "spike on grad_norm" in anomaly["text"]
    [intervention] = results["annotation Interventions"]
    assert intervention["time"].timestamp() == pytest.approx(now + 21, abs=1e-3)
    assert "scale_lr" in intervention["text"]
    [decision] = results["panel Decisions and outcomes"]
    assert (decision["action"], decision["verdict"]) == ("scale_lr", "resolved")
