"""Offline stabmon: recorded runs through the same pipeline as live.

- :mod:`stabmon.replay.importers`: recorded logs (Megatron, fairseq, llm.c, DeepSpeed, W&B, TensorBoard,
  tables) -> StepRecords, with format sniffing (:mod:`~stabmon.replay.importers.sniff`);
- :mod:`stabmon.replay.stitch`: the segments of a resumed run joined into one history;
- :mod:`stabmon.replay.replay`: replay through the live detector and runbook classes, interventions simulated
  (:mod:`stabmon.replay.simulate`);
- :mod:`stabmon.replay.eval`: stabmon and the peer rules (:mod:`stabmon.replay.baselines`) against labelled
  incidents (:mod:`stabmon.replay.labels`);
- :mod:`stabmon.replay.tune`: cross-validated search over detector parameters.
"""
