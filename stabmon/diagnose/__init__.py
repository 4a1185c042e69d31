"""``diagnose``: why did an incident happen? ``data``, ``state`` or ``hardware_suspect`` (docs/diagnose.md).

One feature, one package, in the order a diagnosis runs:

- :mod:`stabmon.diagnose.build`: :func:`~stabmon.diagnose.build.build_diagnoser` wires the experiments to the
  collaborators they need (model, optimizer, batch log, records, checkpoints, gradients and hooks, loss
  function, the channel between ranks), given explicitly; the monitor calls it once.
- :mod:`stabmon.diagnose.ranks`: under torch.distributed rank 0 calls the other ranks in
  (:class:`~stabmon.diagnose.ranks.CrossRank`) and they exchange plans, evidence and the verdict
  (:class:`~stabmon.diagnose.ranks.RankChannel`).
- :mod:`stabmon.diagnose.experiments`: the replay of the incident's batches at a checkpoint and the re-run of the
  steps from it, on the live model, with everything restored afterwards.
- :mod:`stabmon.diagnose.rerun`: the re-run itself, step by step, compared with the record.
- :mod:`stabmon.diagnose.verdict`: which steps to replay and the verdict from the numbers (no torch), and the
  :class:`Diagnosis` the result travels as.

The runbook side is :class:`stabmon.interventions.Diagnose` (the rung) and :mod:`stabmon.runbook.verdicts` (the
rule that follows a verdict). Importing this package does not import torch.

>>> Diagnosis("state", "the state met them").verdict in VERDICTS
True
"""

from __future__ import annotations

from stabmon.diagnose.verdict import INCONCLUSIVE, VERDICTS, Diagnosis

__all__ = ["INCONCLUSIVE", "VERDICTS", "Diagnosis"]
