"""What the live monitor keeps on the device, per signal.

:meth:`stabmon.monitor.Monitor.device_memory` fills one :class:`DeviceMemory`; ``benchmarks/gpu.py`` prints it
beside the model's and optimizer's own bytes, and docs/monitor.md tabulates the bound of each signal.

>>> m = DeviceMemory(embeddings=4096, skip_guard=0, pending=320)
>>> m.total, m.share_of(1_000_000)
(4416, 0.004416)
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes held on the device between steps by each of the monitor's signals."""

    embeddings: int
    """Tracked embedding rows: ``W0`` and the scratch buffer (``config.embeddings.rows`` / ``.reference``)."""
    skip_guard: int
    """The skip_step guard's snapshot: 0 with fused Adam/AdamW or while the guard is off; else a copy of
    parameters and optimizer state."""
    pending: int
    """Metric values queued until the next flush (a few floats per metric and step)."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def share_of(self, nbytes: int) -> float:
        """``total`` as a fraction of ``nbytes`` (for instance the model's and optimizer's own bytes)."""
        return self.total / nbytes if nbytes else 0.0
