"""Collectors of the live monitor, grouped by concern.

``signals`` (what is read from the model and the loop, and the device buffer), ``step`` (what runs inside
``optimizer.step()``: the hooks, the skip guard, the in-place changes), ``checkpoint`` (what a checkpoint holds,
resume, and the recovery verbs), ``cluster`` (what coordinates ranks). Beside them: ``config``
(:class:`MonitorConfig`), ``build`` and ``wiring`` (the monitor's collaborators and arguments), ``flushing`` (the
flush), ``run_state``, ``data`` and ``batches`` (the run's position and recent samples), ``failsafe``,
``interrupts`` and ``hangs``. :class:`stabmon.monitor.Monitor` ties them together; docs/ARCHITECTURE.md maps them.
"""
