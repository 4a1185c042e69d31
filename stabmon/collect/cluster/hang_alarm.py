"""One rank's hang, told to every rank, so that each stores its own stacks before the job goes down.

When one rank's watchdog fires, its peers are usually stuck too (waiting in a collective for it, or the other way
round), but their watchdogs may have later deadlines, and under ``torchrun`` the first process to exit makes the
elastic agent terminate the others: the culprit's stacks, the ones that say why, reached only its stderr. The
alarm is one key in the job's c10d store (the store every rank already shares): the rank that fires sets it and
every rank's watchdog looks for it at each poll (from the watchdog thread, never the training thread). A rank
that sees it reports at once (its stacks, its last step), and every reporting rank waits, bounded, until all
ranks have reported before it exits. A rank that never reports (stopped, frozen in C code that holds the GIL,
dead) is :meth:`PeerAlarm.silent`: rank 0 names it. Store errors (the job already going down) read as "no alarm".

>>> class Store(dict):
...     def set(self, k, v): self[k] = v
...     def check(self, keys): return all(k in self for k in keys)
...     def add(self, k, n): self[k] = self.get(k, 0) + n; return self[k]
>>> alarm = PeerAlarm(Store(), world_size=2)
>>> alarm.rung(), alarm.ring(rank=1), alarm.rung()
(False, None, True)
>>> alarm.reported(rank=0), alarm.wait_for_all(timeout=0.05, poll=0.01), alarm.silent()
(1, False, [1])
>>> alarm.reported(rank=1), alarm.wait_for_all(timeout=0.05, poll=0.01), alarm.silent()
(2, True, [])
"""

from __future__ import annotations

import logging
import time
from typing import Any

from stabmon.collect.cluster.restarts import attempt_prefix

log = logging.getLogger(__name__)

KEY = "hang"
REPORTS = "hang-reports"


class PeerAlarm:
    """See the module docstring. ``store``: a c10d ``Store`` (``set``, ``check``, ``add``)."""

    def __init__(self, store: Any, *, world_size: int, prefix: str = "") -> None:
        """``prefix``: of the keys; this restart attempt's (torchrun keeps one store for every attempt, and an
        alarm of the attempt that hung must not ring in the next one)."""
        self.store, self.world_size = store, world_size
        self.key, self.reports = prefix + KEY, prefix + REPORTS

    @classmethod
    def of_default_group(cls, world_size: int) -> PeerAlarm | None:
        """The alarm on the default process group's store (None when there is none to share)."""
        try:
            from torch.distributed import distributed_c10d

            return cls(distributed_c10d._get_default_store(), world_size=world_size, prefix=attempt_prefix())
        except Exception:  # noqa: BLE001 - no shared store: each rank reports on its own deadline
            log.warning("stabmon: no c10d store to share a hang alarm; each rank reports on its own deadline")
            return None

    def ring(self, *, rank: int) -> None:
        try:
            self.store.set(self.key, str(rank))
        except Exception as exc:  # noqa: BLE001 - the job may already be going down: one line, no traceback
            log.error("stabmon: could not tell the other ranks about the hang (%s: %s)", type(exc).__name__,
                      (str(exc).splitlines() or [""])[0])

    def rung(self) -> bool:
        try:
            return bool(self.store.check([self.key]))
        except Exception:  # noqa: BLE001 - a store that is gone rings no alarm
            return False

    def reported(self, *, rank: int) -> int:
        """Count this rank's report; returns how many ranks have reported."""
        try:
            self.store.set(f"{self.reports}/{rank}", "1")
            return int(self.store.add(self.reports, 1))
        except Exception:  # noqa: BLE001
            return 0

    def silent(self) -> list[int]:
        """The ranks that have not reported (none when the store cannot say)."""
        try:
            return [r for r in range(self.world_size) if not self.store.check([f"{self.reports}/{r}"])]
        except Exception:  # noqa: BLE001
            return []

    def wait_for_all(self, *, timeout: float, poll: float = 0.2) -> bool:
        """Wait until every rank has reported (at most ``timeout`` seconds); whether they all did."""
        end = time.monotonic() + timeout
        while True:
            try:
                if int(self.store.add(self.reports, 0)) >= self.world_size:
                    return True
            except Exception:  # noqa: BLE001
                return False
            if time.monotonic() >= end:
                return False
            time.sleep(poll)
