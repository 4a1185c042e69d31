"""``stabmon report``: downsampling keeps spikes, rollbacks are told apart, and the page draws in a real
headless Chromium with no console errors, non-blank charts and a mark at the right step."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import polars as pl
import pytest
from browser_support import open_page
from typer.testing import CliRunner

from stabmon.cli import app
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
from stabmon.report import RunInfo, build_report, records_frame, render_html
from stabmon.report.series import build_series, metrics_frame
from stabmon.store import open_store

runner = CliRunner()


def test_min_max_buckets_keep_every_spike_of_a_million_steps() -> None:
    n, rng = 1_000_000, random.Random(7)
    spikes = sorted(rng.sample(range(n), 5))
    values = [1.0 + 0.01 * rng.random() for _ in range(n)]
    for s in spikes:
        values[s] = 50.0
    values[spikes[0] + 1] = -40.0  # a dip next to a spike survives too
    df = pl.DataFrame({"seq": range(n), "step": range(n), "name": ["grad_norm"] * n, "value": values})
    (series,) = build_series(df, buckets=1000)
    assert len(series.steps) <= 2000 and series.points == n
    kept = {s for s, v in zip(series.steps, series.values, strict=True) if v == 50.0}
    assert kept == set(spikes)
    assert (spikes[0] + 1, -40.0) in set(zip(series.steps, series.values, strict=True))
    assert series.steps == sorted(series.steps)


@pytest.mark.slow
def test_a_million_step_report_stays_small() -> None:
    n = 1_000_000
    frames = [
        pl.DataFrame({"seq": range(n), "step": range(n), "name": [name] * n,
                      "value": [float(i % 97) for i in range(n)]})
        for name in ("loss", "grad_norm", "lr", "step_time")
    ]
    data = build_report(pl.concat(frames), [], run=RunInfo("r", "big"))
    size = len(render_html(data).encode())
    assert size < 3_000_000, size
    assert data.records == n and data.step_range == (0, n - 1)


def test_non_finite_values_are_kept_apart_and_rollback_stretches_marked_abandoned() -> None:
    rows = [(0, 0, "loss", 2.0), (1, 1, "loss", math.nan), (2, 2, "loss", 3.0), (3, 1, "loss", 1.9),
            (4, 2, "loss", math.inf), (5, 3, "loss", 1.8)]
    (s,) = build_series(metrics_frame(rows), buckets=100)
    assert (s.steps, s.values) == ([0, 1, 3], [2.0, 1.9, 1.8])
    assert s.abandoned == ([2], [3.0])
    assert s.nonfinite == [1, 2]


def test_a_run_without_clipping_is_not_flagged_non_finite() -> None:
    recs = [StepRecord(step=s, metrics={"grad_norm": 1.0, "clip": math.inf, "loss": math.nan if s == 3 else 1.0})
            for s in range(10)]
    data = build_report(records_frame(recs), [], run=RunInfo("r", "x"))
    charts = {c.id: c for c in data.charts}
    assert [s.name for s in charts["grad_norm"].series] == ["grad_norm"]  # nothing of clip left to draw
    assert charts["loss"].series[0].nonfinite == [3]


def _records(n: int) -> list[StepRecord]:
    rng = random.Random(3)
    recs = []
    for s in range(n):
        m = {"loss": 3.0 - s / n + 0.05 * rng.random(), "grad_norm": 1.0 + 0.2 * rng.random(), "lr": 1e-3,
             "loss_scale": 2.0 ** (16 - (s > 1800)), "step_time": 0.03 + 0.001 * rng.random(),
             "tokens_per_sec": 3e4 + 100 * rng.random()}
        for k, layer in enumerate(("h.0", "h.1")):
            m[f"grad_norm/{layer}"] = 0.5 + 0.1 * rng.random()
            m[f"act_rms/{layer}"] = 1.5 + k + 0.01 * s / n
        m["emb_drift/wte"] = 0.1 * s / n
        m["emb_update/wte"] = 1e-4 + 1e-5 * rng.random()
        recs.append(StepRecord(step=s, metrics=m))
    return recs


ANOMALY_STEP = 1234


def _events() -> list[object]:
    a = Anomaly("spike", "grad_norm", ANOMALY_STEP, 9.5, Severity.ERROR, "zscore",
                ((ANOMALY_STEP - 1, 1.1), (ANOMALY_STEP, 7.25)), threshold=6.0, message="grad norm spike")
    d = Decision(ANOMALY_STEP, "rollback", {"lookback": 100}, DecisionStatus.APPLY, "palm-rollback", "spikes", 0,
                 "loss spike", a.id, "inc1")
    i = InterventionRecord(d.id, 1100, "rollback", {"step": 1300},
                           {"checkpoint_step": 1100, "restored_step": 1100, "from_step": 1300})
    o = Outcome(i.id, d.id, 1500, Verdict.RESOLVED, {"signal_max": 1.2}, "inc1")
    return [a, d, i, o]


@pytest.fixture
def stored_run(sqlite_url: str) -> str:
    recs = _records(2000)
    retrained = [StepRecord(step=r.step, metrics={**r.metrics, "loss": r.metrics["loss"] - 0.3}) for r in recs]
    with open_store(sqlite_url) as store:
        run = store.start_run(name="report-test", environment={"torch": {"version": "2.13.0"}, "host": "h1"})
        store.write_steps(run_id=run, records=recs[:1300])  # trained to 1300, rolled back to 1100, trained on
        store.write_steps(run_id=run, records=retrained[1100:])
        store.write_events(run_id=run, events=_events())  # type: ignore[arg-type]
        store.end_run(run_id=run, status="finished")
        assert store.flush(20)
    return run


def _blue(p: tuple[int, int, int]) -> bool:
    """The first series colour of every chart (#1f77b4), also where anti-aliasing blends it with white."""
    return p[2] - p[0] > 50 and p[1] - p[0] > 25


def _red(p: tuple[int, int, int]) -> bool:
    """An anomaly mark (#d62728)."""
    return p[0] - p[1] > 80 and p[0] - p[2] > 80


def _count(img, box: tuple[int, int, int, int], kind) -> int:
    crop = img.crop(box)
    return sum(1 for y in range(crop.height) for x in range(crop.width) if kind(crop.getpixel((x, y))))


def mark_probe(chart: str, kind: str) -> str:
    """JS: the page x of the first ``kind`` mark on ``chart`` and of each x-axis tick label, by its text."""
    return (f"(() => {{ const svg = document.querySelector('svg[data-chart={chart}]');"
            f" const m = svg.querySelector('line.mark-{kind}').getBoundingClientRect();"
            " const ticks = {}; svg.querySelectorAll('g.axis text[text-anchor=middle]').forEach(t => {"
            " const r = t.getBoundingClientRect(); ticks[t.textContent] = r.left + r.width / 2; });"
            " return JSON.stringify({x: m.left + m.width / 2, top: m.top + scrollY, ticks: ticks}); })()")


def assert_mark_at(probe: str, step: int) -> dict:
    """The mark sits where the axis's own tick labels put ``step`` (linear between the two ticks around it)."""
    mark = json.loads(probe)
    ticks = sorted((int(t), x) for t, x in mark["ticks"].items())
    (t0, x0), (t1, x1) = next((a, b) for a, b in zip(ticks, ticks[1:], strict=False) if a[0] <= step <= b[0])
    assert mark["x"] == pytest.approx(x0 + (step - t0) / (t1 - t0) * (x1 - x0), abs=1.5)
    return mark


PROBES = {
    "mark": mark_probe("grad_norm", "anomaly"),
    "charts": "JSON.stringify([...document.querySelectorAll('svg[data-chart]')].map(s => {"
              "const r = s.getBoundingClientRect(); return [s.dataset.chart, r.left + scrollX, r.top + scrollY,"
              " r.width, r.height]; }))",
    "hover": "(() => { const hit = document.querySelector('svg[data-chart=loss] line.mark-anomaly').nextSibling;"
             " const r = hit.getBoundingClientRect(); hit.dispatchEvent(new MouseEvent('mousemove', {bubbles: true,"
             " clientX: r.left + 1, clientY: r.top + 20})); return document.getElementById('tip').textContent; })()",
    "lit": "(() => { document.querySelector('tr[data-row^=ev-]').click();"
           " return document.querySelectorAll('line.mark.lit').length; })()",
    "abandoned": "document.querySelectorAll('svg[data-chart=loss] polyline.abandoned').length",
    "bands": "document.querySelectorAll('svg[data-chart=loss] rect.band').length",
}


def test_report_draws_in_headless_chromium(stored_run: str, sqlite_url: str, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    res = runner.invoke(app, ["report", stored_run, "-o", str(out), "--db", sqlite_url])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output
    page = out.read_text()
    assert "2.13.0" in page and "palm-rollback" in page

    load = open_page(out, PROBES)
    assert load.errors == []
    assert load.requests == [out.resolve().as_uri()]  # nothing fetched: the file is self-contained
    charts = json.loads(load.values["charts"])
    assert [c[0] for c in charts] == ["loss", "grad_norm", "grad_norm_layers", "loss_scale", "act_rms", "emb_drift",
                                      "emb_update", "lr", "step_time", "tokens_per_sec"]
    for name, x, y, w, h in charts:
        assert _count(load.screenshot, (int(x), int(y), int(x + w), int(y + h)), _blue) > 300, name

    mark = assert_mark_at(load.values["mark"], ANOMALY_STEP)
    red = _count(load.screenshot, (round(mark["x"]) - 1, int(mark["top"]), round(mark["x"]) + 2,
                                   int(mark["top"]) + 150), _red)
    assert red > 100  # the mark is on screen where the geometry says

    assert "spike on grad_norm" in load.values["hover"] and "7.25" in load.values["hover"]
    assert load.values["lit"] >= len(charts)  # a trace row lights its mark on every chart
    assert load.values["abandoned"] >= 1 and load.values["bands"] == 1


def test_report_of_unknown_run_is_one_line(sqlite_url: str, stored_run: str, tmp_path: Path) -> None:
    res = runner.invoke(app, ["report", "nope", "-o", str(tmp_path / "r.html"), "--db", sqlite_url])
    assert res.exit_code == 1
    assert "no run matches" in res.output and len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["report", stored_run, "--buckets", "3", "--db", sqlite_url])
    assert res.exit_code == 1 and "--buckets must be >= 10" in res.output


def test_replay_writes_the_same_report(stored_run: str, sqlite_url: str, tmp_path: Path) -> None:
    out = tmp_path / "replay.html"
    res = runner.invoke(app, ["replay", stored_run, "--no-store", "--report", str(out), "--db", sqlite_url])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "replay of report-test" in page and "2.13.0" in page  # the replayed run's environment
    assert 'id="stabmon-data"' in page or "id='stabmon-data'" in page


def test_records_frame_matches_the_stored_table(stored_run: str, sqlite_url: str) -> None:
    from stabmon.store.repo import get_metrics, load_steps

    with open_store(sqlite_url) as store, store.session() as s:
        stored = get_metrics(session=s, run_id=stored_run)
        rebuilt = records_frame(load_steps(session=s, run_id=stored_run))
    key = ["seq", "step", "name"]
    assert stored.select(key).sort(key).equals(rebuilt.select(key).sort(key))


@pytest.mark.slow
def test_the_demo_report_draws_its_rollback_at_its_step(sqlite_url: str, tmp_path: Path) -> None:
    """The real thing: the tiny GPT meets a corrupted shard, the runbook rolls back, the report shows it."""
    from stabmon.events import InterventionRecord
    from stabmon.store.repo import load_events, resolve_run

    res = runner.invoke(app, ["demo", "--db", sqlite_url, "--steps", "400"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "demo.html"
    res = runner.invoke(app, ["report", "latest", "-o", str(out), "--db", sqlite_url])
    assert res.exit_code == 0, res.output
    with open_store(sqlite_url) as store, store.session() as s:
        events = load_events(session=s, run_id=resolve_run(session=s, ref="latest").id)
    (rollback,) = [e for e in events if isinstance(e, InterventionRecord) and e.action == "rollback"]
    load = open_page(out, {"charts": PROBES["charts"], "mark": mark_probe("loss", "rollback"),
                           "bands": PROBES["bands"]})
    assert load.errors == [] and load.requests == [out.resolve().as_uri()]
    charts = json.loads(load.values["charts"])
    assert {"loss", "grad_norm", "grad_norm_layers", "act_rms", "emb_drift", "emb_update", "step_time"} <= {
        c[0] for c in charts}
    for name, x, y, w, h in charts:
        assert _count(load.screenshot, (int(x), int(y), int(x + w), int(y + h)), _blue) > 300, name
    assert_mark_at(load.values["mark"], rollback.step)
    assert load.values["bands"] == 1


def test_replay_of_a_log_file_writes_its_report_with_the_spike_marked(tmp_path: Path, sqlite_url: str) -> None:
    rng = random.Random(5)
    rows = ["step,loss,grad_norm"]
    for s in range(300):
        spike = s == 200
        rows.append(f"{s},{(9.0 if spike else 2.0 + 0.01 * rng.random()):.5f},"
                    f"{(50.0 if spike else 1.0 + 0.05 * rng.random()):.5f}")
    log = tmp_path / "train.csv"
    log.write_text("\n".join(rows) + "\n")
    out = tmp_path / "replay.html"
    res = runner.invoke(app, ["replay", str(log), "--no-store", "--report", str(out), "--db", sqlite_url])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    payload = json.loads(page.split("id='stabmon-data'>", 1)[1].split("</script>", 1)[0])
    assert {(m["kind"], m["step"]) for m in payload["marks"]} >= {("anomaly", 200)}
    loss = next(c for c in payload["charts"] if c["id"] == "loss")["series"][0]
    assert loss["steps"] == list(range(300)) and loss["values"][200] == 9.0


def _abandoned_blowup() -> tuple[list[StepRecord], list[object]]:
    """Activations near 0.5 on the kept timeline; an attempt a rollback abandoned went to ~500 (issue 26: the
    chart's scale followed the abandoned values and flattened the kept curve into a line). Anomaly marks of
    every severity: 3 info, 2 warning, 1 error."""
    kept = [StepRecord(step=s, metrics={"act_rms/0": 0.4 + 0.2 * ((s * 7) % 10) / 10}) for s in range(100)]
    blown = [StepRecord(step=s, metrics={"act_rms/0": 0.5 * 1.15 ** (s - 50)}) for s in range(50, 100)]
    records = kept[:50] + blown + kept[50:]  # trained 50-99, rolled back to 50, trained 50-99 again
    severities = [Severity.INFO] * 3 + [Severity.WARNING] * 2 + [Severity.ERROR]
    events = [Anomaly("drift", "act_rms/0", 55 + i, 1.0, sev, "test", ((55 + i, 1.0),)) for i, sev in
              enumerate(severities)]
    return records, events


def test_the_y_scale_follows_the_kept_timeline_and_abandoned_values_are_clipped() -> None:
    records, events = _abandoned_blowup()
    data = build_report(records_frame(records), events, run=RunInfo("r", "blowup"))
    (act,) = [c for c in data.charts if c.id == "act_rms"]
    assert act.y_range is not None and 0.39 < act.y_range[0] and act.y_range[1] < 0.61  # not ~500
    assert act.off_scale == 48  # the abandoned values above the kept scale (0.5 x 1.15^k, k = 2..49), counted
    assert [m.severity for m in data.marks] == ["info"] * 3 + ["warning"] * 2 + ["error"]
    page = render_html(data)
    assert "<select id='mark-filter'>" in page and "warning and above (3)" in page and "error and above (1)" in page


BLOWUP_PROBES = {
    # the kept curve's drawn height as a share of the plot height (flattened into a line: about 0)
    "spread": "(() => { const svg = document.querySelector('svg[data-chart=act_rms]');"
              " const r = svg.querySelector('polyline.series').getBoundingClientRect();"
              " const f = svg.querySelector('g.axis rect.frame').getBoundingClientRect();"
              " return r.height / f.height; })()",
    "off": "document.querySelector('svg[data-chart=act_rms]').parentNode.querySelector('.off-scale').textContent",
    "visible": "(() => { const s = document.getElementById('mark-filter'); const seen = [];"
               " for (const v of ['0', '1', '2']) { s.value = v; s.dispatchEvent(new Event('change'));"
               " seen.push([...document.querySelectorAll('svg[data-chart=act_rms] line.mark-anomaly')]"
               ".filter(m => m.style.display !== 'none').length); } return JSON.stringify(seen); })()",
}


def test_the_kept_curve_fills_its_chart_and_marks_filter_by_severity(tmp_path: Path) -> None:
    records, events = _abandoned_blowup()
    out = tmp_path / "blowup.html"
    out.write_text(render_html(build_report(records_frame(records), events, run=RunInfo("r", "blowup"))))
    load = open_page(out, BLOWUP_PROBES)
    assert load.errors == []
    assert load.values["spread"] > 0.7, load.values["spread"]
    assert load.values["off"].startswith("48 abandoned value(s) off the kept scale")  # 0.5 x 1.15^k > 0.6 from k=2
    assert json.loads(load.values["visible"]) == [6, 3, 1]
