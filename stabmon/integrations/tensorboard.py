"""Mirror stabmon into TensorBoard (extra ``tensorboard``): every metric as a scalar at its step, and anomalies,
decisions, interventions and outcomes as text under ``stabmon/<kind>``.

>>> import tempfile
>>> from stabmon.events import StepRecord
>>> from stabmon.integrations.mirror import MirrorSink
>>> tb = TensorBoardMirror(tempfile.mkdtemp())
>>> sink = MirrorSink(None, tb)
>>> run = sink.start_run(name="demo")
>>> sink.write_steps(run_id=run, records=[StepRecord(step=0, metrics={"loss": 2.0})])
>>> sink.close(); tb.errors
Counter()
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stabmon.events import StepRecord
from stabmon.integrations.mirror import Mirror, describe
from stabmon.sinks import LowVolumeEvent


class TensorBoardMirror(Mirror):
    """Writes a TensorBoard event file under ``logdir`` (``torch.utils.tensorboard.SummaryWriter``).

    ``prefix`` goes before every scalar tag (default none: ``loss``, ``grad_norm/h.0``, ...)."""

    def __init__(self, logdir: str | Path, *, prefix: str = "", flush_secs: int = 10) -> None:
        super().__init__()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("TensorBoardMirror needs tensorboard: pip install 'stabmon[tensorboard]'") from exc
        self.logdir = Path(logdir)
        self.prefix = prefix
        self._writer: Any = SummaryWriter(log_dir=str(self.logdir), flush_secs=flush_secs)
        self._closed = False

    def _open(self, *, run_id: str, name: str, config: Mapping[str, Any]) -> None:
        self._writer.add_text("stabmon/run", f"run {run_id} ({name})", 0)

    def _steps(self, records: Sequence[StepRecord]) -> None:
        add = self._writer.add_scalar
        for r in records:
            for name, value in r.metrics.items():
                if math.isfinite(value):  # TensorBoard's charts cannot place NaN/inf; the store keeps them
                    add(self.prefix + name, value, r.step)

    def _events(self, events: Sequence[LowVolumeEvent]) -> None:
        for e in events:
            kind, text = describe(e)
            self._writer.add_text(f"stabmon/{kind}", text, e.step)

    def _close(self, status: str) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
