"""``stabmon report``: one self-contained HTML file showing a run (charts, event marks, causal trace,
environment), built from the store or from a replay's records and events.

>>> import os, tempfile
>>> from stabmon.events import StepRecord
>>> path = os.path.join(tempfile.mkdtemp(), "r.html")
>>> data = build_report(records_frame([StepRecord(step=0, metrics={"loss": 2.0})]), [], run=RunInfo("r", "x"))
>>> write_report(data, path).stat().st_size > 1000
True
"""

from __future__ import annotations

from stabmon.report.load import load_report
from stabmon.report.model import RunInfo, build_report
from stabmon.report.render import render_html, write_report
from stabmon.report.series import records_frame

__all__ = ["RunInfo", "build_report", "load_report", "records_frame", "render_html", "write_report"]
