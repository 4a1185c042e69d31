"""TensorBoard and Weights & Biases mirrors: signals and events land where those tools read them (W&B offline,
no network), a failing mirror never reaches training, and the Monitor takes a MirrorSink as its store."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import torch

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
from stabmon.integrations.mirror import Mirror, MirrorSink
from stabmon.store import open_store
from stabmon.store.repo import load_events, load_steps

RECORDS = [StepRecord(step=s, metrics={"loss": 3.0 - s / 10, "grad_norm/h.0": 0.5 + s, "nonfinite": 0.0})
           for s in range(6)]
ANOMALY = Anomaly("spike", "grad_norm", 4, 9.0, Severity.ERROR, "zscore", ((4, 4.5),), message="spike")
DECISION = Decision(4, "set_clip", {"max_norm": 1.0}, DecisionStatus.APPLY, "default", "grad_spike", 0, "clip it",
                    ANOMALY.id)
INTERVENTION = InterventionRecord(DECISION.id, 5, "set_clip", {"clip": float("inf")}, {"clip": 1.0})
OUTCOME = Outcome(INTERVENTION.id, DECISION.id, 5, Verdict.RESOLVED, {"signal_max": 1.1})
EVENTS = [ANOMALY, DECISION, INTERVENTION, OUTCOME]


def _feed(sink: MirrorSink) -> str:
    run = sink.start_run(name="mirrored", config={"lr": 1e-3}, environment={})
    sink.write_steps(run_id=run, records=RECORDS)
    sink.write_events(run_id=run, events=EVENTS)
    sink.end_run(run_id=run, status="finished")
    sink.flush(20)
    sink.close()
    return run


def test_tensorboard_gets_scalars_and_events_as_text(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stabmon.integrations.tensorboard import TensorBoardMirror

    tb = TensorBoardMirror(tmp_path / "tb")
    _feed(MirrorSink(None, tb))
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [(e.step, round(e.value, 6)) for e in loss] == [(r.step, r.metrics["loss"]) for r in RECORDS]
    assert [e.value for e in acc.Scalars("grad_norm/h.0")][-1] == 5.5
    texts = {tag: acc.Tensors(tag) for tag in acc.Tags()["tensors"]}
    decision = texts["stabmon/decision/text_summary"][0]
    assert decision.step == 4 and b"set_clip(max_norm=1.0)" in decision.tensor_proto.string_val[0]
    outcome = texts["stabmon/outcome/text_summary"][0]
    assert b"resolved" in outcome.tensor_proto.string_val[0]
    assert b"spike on grad_norm" in texts["stabmon/anomaly/text_summary"][0].tensor_proto.string_val[0]
    assert not tb.errors


def _wandb_records(run_dir: Path) -> list:
    """Records of an offline W&B run's transaction log (LevelDB-style blocks of 32 KiB after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, pos, block, buf, out = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def _complete_wandb_log(run_dir: Path, timeout: float = 60.0) -> list:
    """The run's records once W&B's core process has written the closing ``exit`` record (``run.finish()`` can
    return before the core has flushed the file on a busy machine)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = _wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def test_wandb_offline_logs_metrics_and_alerts_interventions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from stabmon.integrations.wandb import WandbMirror

    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there: offline must not care
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "")
    wb = WandbMirror(project="stabmon-test", mode="offline", dir=str(tmp_path))
    run_id = _feed(MirrorSink(None, wb))
    assert not wb.errors
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    recs = _complete_wandb_log(run_dir)
    rows = [{i.nested_key[0] if i.nested_key else i.key: i.value_json for i in r.history.item}
            for r in recs if r.WhichOneof("record_type") == "history"]
    logged = [(int(r["stabmon/step"]), float(r["loss"])) for r in rows if "loss" in r]
    kinds = [r.WhichOneof("record_type") for r in recs]
    assert logged == [(r.step, r.metrics["loss"]) for r in RECORDS], (kinds, rows[:3])
    assert any("stabmon/events" in r for r in rows)
    (alert,) = [r.alert for r in recs if r.WhichOneof("record_type") == "alert"]
    assert alert.title == "stabmon intervention: set_clip at step 5" and alert.level == "WARN"
    assert "'clip': 1.0" in alert.text
    config = next(r.run.config for r in recs if r.WhichOneof("record_type") == "run")
    assert any(item.key == "stabmon_run_id" and run_id in item.value_json for item in config.update)


class Broken(Mirror):
    def _steps(self, records: object) -> None:
        raise OSError("disk full")


def test_a_failing_mirror_is_counted_and_the_store_keeps_everything(sqlite_url: str) -> None:
    broken = Broken()
    run = _feed(MirrorSink(open_store(sqlite_url), broken))
    assert broken.errors["steps"] == 1
    with open_store(sqlite_url) as store, store.session() as s:
        assert [r.step for r in load_steps(session=s, run_id=run)] == [r.step for r in RECORDS]
        assert len(load_events(session=s, run_id=run)) == 4


def test_monitor_writes_through_a_mirror_sink(sqlite_url: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stabmon.integrations.tensorboard import TensorBoardMirror
    from stabmon.monitor import Monitor, MonitorConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MirrorSink(open_store(sqlite_url), TensorBoardMirror(tmp_path / "tb"))
    with Monitor(model, opt, store=sink, mode=None, config=MonitorConfig(clip=1.0, flush_every=2)) as mon:
        for _, x in mon.steps([torch.randn(16, 4) for _ in range(6)]):
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("grad_norm")] == list(range(6))
    with open_store(sqlite_url) as store, store.session() as s:
        stored = load_steps(session=s, run_id=mon.run_id)
    assert [round(r.metrics["grad_norm"], 5) for r in stored] == [round(e.value, 5) for e in acc.Scalars("grad_norm")]
