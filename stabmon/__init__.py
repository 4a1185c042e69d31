"""stabmon: a training-stability monitor with an intervention runbook engine."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stabmon")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

_PUBLIC: dict[str, tuple[str, str]] = {
    # the monitor and what configures it
    "Monitor": ("stabmon.monitor", "Monitor"),
    "MonitorConfig": ("stabmon.collect.config", "MonitorConfig"),
    "MonitorSpec": ("stabmon.spec", "MonitorSpec"),
    "ActivationConfig": ("stabmon.collect.config", "ActivationConfig"),
    "AttentionConfig": ("stabmon.collect.config", "AttentionConfig"),
    "DiagnoseConfig": ("stabmon.collect.config", "DiagnoseConfig"),
    "EmbeddingConfig": ("stabmon.collect.config", "EmbeddingConfig"),
    "GradConfig": ("stabmon.collect.config", "GradConfig"),
    "HangConfig": ("stabmon.collect.config", "HangConfig"),
    "LogitConfig": ("stabmon.collect.config", "LogitConfig"),
    "MomentConfig": ("stabmon.collect.config", "MomentConfig"),
    "SnapshotConfig": ("stabmon.collect.config", "SnapshotConfig"),
    "WatchConfig": ("stabmon.collect.config", "WatchConfig"),
    "UpdateConfig": ("stabmon.collect.config", "UpdateConfig"),
    # the exit codes a job script or a scheduler reads
    "STOP_EXIT_CODE": ("stabmon.checkpoints", "STOP_EXIT_CODE"),
    "HANG_EXIT_CODE": ("stabmon.collect.config", "HANG_EXIT_CODE"),
    "HARDWARE_EXIT_CODE": ("stabmon.checkpoints", "HARDWARE_EXIT_CODE"),
    # checkpoints and torchrun restarts
    "UserCheckpoints": ("stabmon.checkpoints", "UserCheckpoints"),
    "CheckpointManager": ("stabmon.checkpoints", "CheckpointManager"),
    "init_process_group": ("stabmon.collect.cluster.restarts", "init_process_group"),
    "resume_checkpoint": ("stabmon.collect.cluster.restarts", "resume_checkpoint"),
    # offline: read a recorded log (``stabmon.replay.replay.replay`` runs it through the pipeline)
    "import_file": ("stabmon.replay.importers.sniff", "import_file"),
}
"""Every public name: where it lives. Imported on first use, so that ``import stabmon`` (and the CLI) do not pay
for importing torch until a monitor is wanted."""

__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str) -> object:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'stabmon' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(where[0]), where[1])


def __dir__() -> list[str]:
    return __all__
