"""llm.c main.log importer."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabmon.events import Metric
from stabmon.replay.importers import llmc


def test_full_run(real_runs: Path) -> None:
    path = real_runs / "llmc-gpt2-124m-SiddanthEmani" / "main.log"
    assert llmc.sniff(path.read_text()[:4096])
    r = llmc.read(path)
    assert r.malformed == 0 and r.restarts == []
    train = [x for x in r.records if Metric.LOSS in x.metrics]
    assert len(train) == 19_552 and train[-1].step == 19_551
    assert sum(Metric.VAL_LOSS in x.metrics for x in r.records) == 80
    assert sum("hellaswag" in x.metrics for x in r.records) == 79
    first = r.records[0].metrics
    assert first == {Metric.VAL_LOSS: 11.0095, Metric.LOSS: 11.0116, Metric.LR: 1e-6, Metric.GRAD_NORM: 14.96}
    s8715 = next(x for x in r.records if x.step == 8715)
    assert s8715.metrics[Metric.GRAD_NORM] == 4.29


def test_restart_and_bad_lines(tmp_path: Path) -> None:
    p = tmp_path / "main.log"
    p.write_text("s:1 trl:3.0 lr:1 norm:1\ns:2 trl:3.1 lr:1 norm:1\nhello\ns:2 trl:2.9 lr:1 norm:1\n"
                 "s:3 trl:nope\n\ns:3 foo:1\n")
    r = llmc.read(p)
    assert r.restarts == [2]
    assert [(x.step, x.metrics[Metric.LOSS]) for x in r.records] == [(1, 3.0), (2, 2.9)]
    assert r.malformed == 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(
    st.builds(lambda s, k, v: f"s:{s} {k}:{v}", st.integers(0, 10**5),
              st.sampled_from(["trl", "tel", "lr", "norm", "eval", "xx"]),
              st.one_of(st.floats().map(str), st.text(max_size=5))),
    st.text(max_size=60)), max_size=40))
def test_garbage_never_crashes(tmp_path: Path, lines: list[str]) -> None:
    p = tmp_path / "main.log"
    p.write_text("\n".join(lines), encoding="utf-8", errors="replace")
    r = llmc.read(p)
    n = len(p.read_text(encoding="utf-8", errors="replace").splitlines())
    assert 0 <= r.malformed <= n and len(r.records) <= n
    assert [x.step for x in r.records] == sorted({x.step for x in r.records})
