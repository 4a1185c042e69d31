"""Collectors of the live monitor, one concern per module.

``grads`` (fused global / per-layer gradient norms and clipping), ``optim`` (the optimizer step hooks: unscale,
norms, clip, overrides, skip guard), ``activations`` (sampled activation RMS), ``embeddings`` (drift and update
ratio), ``buffer`` (device values until one host copy per flush), ``data`` (data position and skipped batches),
``distributed`` (cross-rank reduction and decision sharing), ``flushing`` (pipeline, store and notifier at a
flush), ``restore`` (checkpoint contents, resume and rollback), ``wiring`` (turning the Monitor's arguments into
objects) and ``config`` (:class:`MonitorConfig`). :class:`stabmon.monitor.Monitor` ties them together.
"""
