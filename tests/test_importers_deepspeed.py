"""DeepSpeed engine / DeepSpeed-Chat importer."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabmon.events import Metric
from stabmon.replay.importers import deepspeed

DIR = "deepspeed-chat-opt"


def test_sft_log(real_runs: Path) -> None:
    path = real_runs / DIR / "opt-1.3b-globalBatchSize128.log"
    assert deepspeed.sniff(path.read_text()[:8192])
    r = deepspeed.read(path)
    assert r.malformed == 0
    assert [x.step for x in r.records][:4] == [0, 1, 2, 3] and r.records[-1].step == 7360
    assert set(r.records[0].metrics) == {Metric.VAL_LOSS}  # the evaluation before training
    overflow = [x for x in r.records if x.metrics.get(Metric.OVERFLOW) == 1.0]
    assert len(overflow) == 139  # the log's own skipped=139
    scales = [x.metrics[Metric.LOSS_SCALE] for x in overflow[:6]]
    assert scales == [65536.0, 65536.0, 32768.0, 16384.0, 8192.0, 4096.0]
    assert all(x.step <= 10 for x in overflow[:6])  # initial scale search, inside the first step=10 block
    assert not [e for e in r.events if "skipped=" in e[1]]  # counter agrees with the OVERFLOW lines
    step20 = next(x for x in r.records if x.step == 20).metrics
    assert 0.5 < step20[Metric.STEP_TIME] < 1.0 and step20[Metric.LR] > 0
    assert sum(Metric.VAL_LOSS in x.metrics for x in r.records) == 17


def test_rlhf_log(real_runs: Path) -> None:
    r = deepspeed.read(real_runs / DIR / "actor_opt-1.3b_critic_opt-350m_globalBatchSize64.log")
    assert r.malformed == 0 and [x.step for x in r.records] == list(range(477))
    first = r.records[0].metrics
    assert first[Metric.LOSS] == 0.2099609375 and first["critic_loss"] == 0.12042236328125
    assert first["reward"] == -0.67919921875 and first[Metric.STEP_TIME] == 7.99
    over = [x for x in r.records if x.metrics[Metric.OVERFLOW] == 1.0]
    assert min(x.metrics[Metric.LOSS_SCALE] for x in over) == 2048.0
    assert max(x.step for x in over) == 212  # LABELS.csv: last reduction at step 212


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(
    st.builds(lambda s, k: f"[2023-04-18 01:46:5{s % 10},000] [Rank 0] step={s}, skipped={k}, lr=[1e-5]",
              st.integers(0, 300), st.integers(0, 5)),
    st.builds(lambda a, b: f"[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: {a}, reducing to {b}",
              st.one_of(st.floats().map(str), st.text(max_size=4)), st.integers(0, 9)),
    st.builds(lambda s, v: f"epoch: 0|step: {s}|ppo_ep: 1|act_loss: {v}|cri_loss: 1", st.integers(0, 50),
              st.one_of(st.floats().map(str), st.text(max_size=4))),
    st.text(max_size=80)), max_size=30))
def test_garbage_never_crashes(tmp_path: Path, lines: list[str]) -> None:
    p = tmp_path / "ds.log"
    p.write_text("\n".join(lines), encoding="utf-8", errors="replace")
    r = deepspeed.read(p)
    n = len(p.read_text(encoding="utf-8", errors="replace").splitlines())
    assert 0 <= r.malformed <= n
    assert [x.step for x in r.records] == sorted({x.step for x in r.records})
