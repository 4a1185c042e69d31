"""One self-contained HTML file from :class:`~stabmon.report.model.ReportData`: the data as embedded JSON, the
charts drawn by a small inline script as SVG. Nothing is fetched when the file is opened.

>>> from stabmon.events import StepRecord
>>> from stabmon.report.model import RunInfo, build_report, records_frame
>>> data = build_report(records_frame([StepRecord(step=0, metrics={"loss": 2.0})]), [], run=RunInfo("r1", "x"))
>>> page = render_html(data)
>>> page.startswith("<!DOCTYPE html>"), "<link" in page, " src=" in page
(True, False, False)
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from stabmon.report.model import ReportData

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 24px 40px;color:#222;background:#fff}
h1{font-size:20px;margin:18px 0 4px}h2{font-size:17px;margin:26px 0 8px}h3{font-size:14px;margin:14px 0 2px}
.meta{color:#555}.meta b{color:#222}
.goodput-bar{display:flex;height:14px;max-width:900px;border:1px solid #ccc}.goodput-bar i{display:block;height:100%}
.chart svg{display:block;background:#fff}
.legend span{margin-right:12px;font-size:12px;white-space:nowrap}.legend i{display:inline-block;width:10px;
height:10px;margin-right:4px;vertical-align:middle}
.axis text{font-size:11px;fill:#555}.grid{stroke:#eee}.frame{fill:none;stroke:#bbb}
.series{fill:none;stroke-width:1.4}.abandoned{fill:none;stroke-width:1.2;stroke-dasharray:4 3;opacity:.45}
.area{fill:transparent}.cross{stroke:#888;stroke-dasharray:2 2}
.mark{stroke-width:1.5;opacity:.8}.mark.lit{stroke-width:4;opacity:1}.hit{stroke:transparent;stroke-width:9;
cursor:pointer}.band{fill:#f5a623;opacity:.18}.nonfinite{fill:#d62728}
.keys span{margin-right:14px}.keys i{display:inline-block;width:14px;height:3px;margin-right:4px;
vertical-align:middle}
#tip{position:absolute;display:none;background:#fffff4;border:1px solid #999;padding:6px 8px;font-size:12px;
max-width:560px;pointer-events:none;box-shadow:0 2px 6px rgba(0,0,0,.2);z-index:10}
#tip table{border-collapse:collapse}#tip th{text-align:left;padding-right:8px;vertical-align:top}
table.rows{border-collapse:collapse;font-size:12px}table.rows th,table.rows td{border-bottom:1px solid #eee;
padding:3px 8px;text-align:left;vertical-align:top}table.rows tr[data-row]{cursor:pointer}
table.rows tr.focus{background:#fff3c4}td.k{color:#555;white-space:nowrap}
"""

MARK_KEYS = (("anomaly", "#d62728"), ("decision", "#ff7f0e"), ("intervention", "#6a3d9a"),
             ("rollback", "#000000"), ("outcome", "#2ca02c"))


def _script() -> str:
    return resources.files("stabmon.report").joinpath("assets/report.js").read_text(encoding="utf-8")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _payload(data: ReportData) -> str:
    """The JSON the script draws from, safe inside a <script> element."""
    body = {
        "step_range": list(data.step_range),
        "charts": [_finite(dataclasses.asdict(c)) for c in data.charts],
        "marks": [_finite(dataclasses.asdict(m)) for m in data.marks],
        "bands": [dataclasses.asdict(b) for b in data.bands],
    }
    text = json.dumps(body, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(obj, Mapping) and obj:
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)) and obj and any(isinstance(v, (Mapping, list)) for v in obj):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, "" if obj is None else str(obj) if not isinstance(obj, (list, tuple)) else ", ".join(
            map(str, obj))


def _header(data: ReportData) -> str:
    r = data.run
    e = html.escape
    counts: dict[str, int] = {}
    for m in data.marks:
        counts[m.kind] = counts.get(m.kind, 0) + 1
    parts = [f"<b>{n}</b> {k}" for k, n in counts.items()] or ["no events"]
    src = f" &middot; source {e(r.source)}" if r.source else ""
    parent = f" &middot; replay of run {e(r.parent_run_id)}" if r.parent_run_id else ""
    lo, hi = data.step_range
    dropped = f" ({data.dropped_marks} more anomalies not drawn)" if data.dropped_marks else ""
    return (f"<h1>stabmon run {e(r.name)}</h1><div class='meta'>run <b>{e(r.id)}</b> &middot; {e(r.kind)} "
            f"&middot; {e(r.status)}{src}{parent}<br>steps {lo}&ndash;{hi} &middot; {data.records} records "
            f"&middot; {', '.join(parts)}{dropped}</div>")


def _mark_filter(data: ReportData) -> str:
    """A choice of the least severity of the anomaly marks drawn, with how many there are of each."""
    counts: dict[str, int] = {}
    for m in data.marks:
        if m.severity is not None:
            counts[m.severity] = counts.get(m.severity, 0) + 1
    options = "".join(
        f"<option value='{rank}'>{label} ({sum(n for s, n in counts.items() if SEVERITY_RANK.get(s, 0) >= rank)})"
        "</option>"
        for rank, label in enumerate(("all", "warning and above", "error and above", "critical"))
    )
    return (f"<p class='keys'><label>anomaly marks: <select id='mark-filter'>{options}</select></label> "
            "(decisions, interventions, rollbacks and outcomes are always drawn)</p>")


SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2, "critical": 3}


def _keys() -> str:
    items = "".join(f"<span><i style='background:{c}'></i>{k}</span>" for k, c in MARK_KEYS)
    return (f"<p class='keys'>{items}<span><i style='background:#f5a623;height:10px;opacity:.4'></i>re-trained "
            "stretch (rollback)</span><span>dashed: steps abandoned by a rollback</span>"
            "<span style='color:#d62728'>&#9660; non-finite value</span></p>")


def _trace(data: ReportData) -> str:
    if not data.trace:
        return "<h2 id='trace'>Causal trace</h2><p>No incidents.</p>"
    e = html.escape
    rows = "".join(
        f"<tr id='{e(t.row)}' data-row='{e(t.row)}'><td>{e(t.incident)}</td><td>{e(t.stage)}</td>"
        f"<td>{t.step}</td><td>{e(t.what)}</td><td>{e(t.detail)}</td></tr>"
        for t in data.trace
    )
    return ("<h2 id='trace'>Causal trace</h2><p class='meta'>Click a row to light its marks on the charts; click a "
            "mark to find its row.</p><table class='rows'><tr><th>incident</th><th>stage</th><th>step</th>"
            f"<th>what</th><th>detail</th></tr>{rows}</table>")


def _goodput(data: ReportData) -> str:
    """Where the wall time went: one bar split by cause, then the ledger's table (``stabmon goodput``)."""
    ledger = data.goodput
    if ledger is None:
        return ""
    e = html.escape
    shown = [c for c in ledger.causes if c.seconds > 0]
    bar = "".join(f"<i title='{e(c.name)} {c.percent:.1f}%' style='width:{c.percent:.3f}%;"
                  f"background:{GOODPUT_COLOURS.get(c.name, '#999')}'></i>" for c in shown)
    rows = "".join(f"<tr data-cause='{e(c.name)}'><td>{e(c.name)}</td><td>{c.seconds:.1f}</td><td>{c.steps}</td>"
                   f"<td>{c.percent:.1f}%</td><td>{e(c.description)}</td></tr>" for c in ledger.causes)
    return (f"<h2 id='goodput'>Goodput</h2><p class='meta'>wall {ledger.wall_seconds:.1f} s &middot; goodput "
            f"<b>{100 * ledger.goodput:.1f}%</b> &middot; {ledger.segments} process(es) &middot; "
            f"{ledger.skipped_batches} batch(es) skipped</p><div class='goodput-bar'>{bar}</div>"
            "<table class='rows' id='goodput-table'><tr><th>cause</th><th>seconds</th><th>steps</th>"
            f"<th>percent</th><th>what</th></tr>{rows}</table>")


GOODPUT_COLOURS = {"productive": "#2ca02c", "rollback": "#f5a623", "skipped_update": "#9467bd",
                   "checkpoint": "#1f77b4", "outside_steps": "#17becf", "hang": "#d62728", "restart": "#8c564b",
                   "startup": "#7f7f7f", "monitor": "#bcbd22"}


def _environment(data: ReportData) -> str:
    e = html.escape
    rows = "".join(f"<tr><td class='k'>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in _flatten(data.environment))
    body = f"<table class='rows' id='environment'>{rows}</table>" if rows else "<p>Not recorded.</p>"
    return f"<h2>Environment fingerprint</h2>{body}"


def render_html(data: ReportData) -> str:
    """The whole report page as one string."""
    missing = ""
    if data.missing:
        missing = f"<p class='meta'>Not recorded in this run: {html.escape(', '.join(data.missing))}.</p>"
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>stabmon report: {html.escape(data.run.name)}</title>"
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; "
        "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:\">"
        f"<style>{CSS}</style></head><body>{_header(data)}{_keys()}{_mark_filter(data)}<div id='charts'></div>{missing}"
        f"{_trace(data)}{_goodput(data)}{_environment(data)}<div id='tip'></div>"
        f"<script type='application/json' id='stabmon-data'>{_payload(data)}</script>"
        f"<script>{_script()}</script></body></html>"
    )


def write_report(data: ReportData, path: str | Path) -> Path:
    """Write the page to ``path`` (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(data), encoding="utf-8")
    return out
