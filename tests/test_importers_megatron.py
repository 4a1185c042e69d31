"""Megatron-DeepSpeed importer: real BigScience fragments and generated garbage."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabmon.events import Metric
from stabmon.replay.importers import megatron

CHRON = "bigscience-chronicles"


def test_every_fragment_reads_without_problems(real_runs: Path) -> None:
    files = sorted((real_runs / CHRON).glob("*.log"))
    assert len(files) == 18
    for f in files:
        r = megatron.read(f)
        assert r.malformed == 0, (f.name, r.problems)
        assert r.records, f.name
        steps = [x.step for x in r.records]
        assert steps == sorted(set(steps))
        assert megatron.sniff(f.read_text()[:4096]), f.name


def test_auto_detection_picks_these_importers(real_runs: Path) -> None:
    from stabmon.replay.importers.sniff import sniff_format

    expect = {CHRON: "megatron", "deepspeed-chat-opt": "deepspeed", "llmc-gpt2-124m-SiddanthEmani": "llmc"}
    for folder, fmt in expect.items():
        for f in sorted((real_runs / folder).glob("*.log")):
            assert sniff_format(f).FORMAT == fmt, f.name


def test_bloom_fragment_fields_and_rank_prefix(real_runs: Path) -> None:
    r = megatron.read(real_runs / CHRON / "tr11-176B_spike-it31214-31251.log")
    assert [x.step for x in r.records][:3] == [31214, 31215, 31216] and len(r.records) == 11
    first = r.records[0].metrics
    assert first[Metric.LOSS] == 2.198845 and first[Metric.GRAD_NORM] == 0.242
    assert first[Metric.STEP_TIME] == 106.46 and first["tflops"] == 147.29
    assert Metric.LOSS_SCALE not in first  # bf16 run


def test_hard_wrapped_lines_are_joined(real_runs: Path) -> None:
    r = megatron.read(real_runs / CHRON / "tr11-176B_throughput-drop-it42780-42784.log")
    assert [x.step for x in r.records] == [42780, 42781, 42782, 42783, 42784]
    last = r.records[-1].metrics
    assert last[Metric.LR] == 4.475e-05 and last["nan_iterations"] == 0.0 and last["tflops"] == 141.09
    assert [x.metrics[Metric.STEP_TIME] for x in r.records] == [105.16, 105.17, 106.25, 110.17, 111.14]
    wrapped = megatron.read(real_runs / CHRON / "tr8b-104B_embnorm-exp2_rollback-skip-it13251-14000.log")
    assert wrapped.records[0].metrics["skipped_iterations"] == 0.0


def test_missing_loss_and_stale_grad_norm(real_runs: Path) -> None:
    r = megatron.read(real_runs / CHRON / "tr8-104B_exp12_divergence-it9026-9027.log")
    it9027 = r.records[-1].metrics
    assert Metric.LOSS not in it9027 and Metric.GRAD_NORM not in it9027  # repeated value dropped
    assert it9027[Metric.LOSS_SCALE] == 8192.0 and it9027[Metric.OVERFLOW] == 1.0
    assert r.records[-1].step == 9027 and r.records[0].metrics[Metric.STEP_TIME] == 62.0755


def test_overflow_lines_mark_skipped_steps(real_runs: Path) -> None:
    r = megatron.read(real_runs / CHRON / "tr8b-104B_embnorm-exp7_spike-overflow-it17060-17068.log")
    over = [x.step for x in r.records if x.metrics.get(Metric.OVERFLOW) == 1.0]
    assert over == [17062, 17063, 17064, 17065, 17067, 17068]
    assert [x.step for x in r.records if Metric.GRAD_NORM in x.metrics] == [17060, 17061, 17066]
    assert sum("OVERFLOW" in text for _, text in r.events) == 6


def test_unlogged_grad_norm_validation_and_events(real_runs: Path) -> None:
    r = megatron.read(real_runs / CHRON / "tr1-13B_spike-it29020-29090.log")
    assert all(Metric.GRAD_NORM not in x.metrics for x in r.records)  # printed as 0.000: not computed
    v = megatron.read(real_runs / CHRON / "tr8-104B_exp1_spike-it7000-7220.log")
    assert v.records[0].metrics[Metric.VAL_LOSS] == 7.1742
    crash = megatron.read(real_runs / CHRON / "tr1-13B_gpu-crash-it43680.log")
    assert any("Traceback" in text for _, text in crash.events)
    assert any(step == 43680 for step, _ in crash.events)


def test_restart_supersedes_older_segment(tmp_path: Path) -> None:
    line = " iteration {}/ 100 | lm loss: {} | grad norm: 1.0 |\n"
    p = tmp_path / "log"
    first, second = (line.format(s, 2.0) for s in (1, 2, 3)), (line.format(s, 3.0) for s in (2, 3))
    p.write_text("".join(first) + "".join(second))
    r = megatron.read(p)
    assert r.restarts == [2]
    assert [(x.step, x.metrics[Metric.LOSS]) for x in r.records] == [(1, 2.0), (2, 3.0), (3, 3.0)]


def test_malformed_values_are_counted(tmp_path: Path) -> None:
    p = tmp_path / "log"
    p.write_text(" iteration 1/ 10 | lm loss: banana | grad norm: 1.0 |\n iteration 2/ 10 | lm loss: 2.0 |\n")
    r = megatron.read(p)
    assert r.malformed == 1 and "lm loss: banana" in r.problems[0]
    assert [x.step for x in r.records] == [1, 2]


_FIELD = st.sampled_from(["lm loss", "grad norm", "loss scale", "learning rate",
                          "elapsed time per iteration (ms)", "num zeros", "TFLOPs", "bogus"])
_VALUE = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str), st.text(max_size=8))
_RECORD = st.builds(
    lambda step, fields: f" iteration {step}/ 999 | " + " | ".join(f"{k}: {v}" for k, v in fields) + " |",
    st.integers(0, 10**6), st.lists(st.tuples(_FIELD, _VALUE), max_size=6))
_LINE = st.one_of(_RECORD, st.text(max_size=120).map(lambda t: t.replace("\r", "")),
                  st.just("[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: 4096.0, reducing to 2"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_LINE, max_size=30))
def test_garbage_never_crashes_and_counts_are_sane(tmp_path: Path, lines: list[str]) -> None:
    p = tmp_path / "garbage.log"
    p.write_text("\n".join(lines), encoding="utf-8", errors="replace")
    r = megatron.read(p)
    n_lines = len(p.read_text(encoding="utf-8", errors="replace").splitlines())
    assert 0 <= r.malformed <= 2 * max(n_lines, 1)
    assert len(r.records) <= n_lines
    assert len(r.problems) <= r.MAX_PROBLEMS
    steps = [x.step for x in r.records]
    assert steps == sorted(set(steps))
