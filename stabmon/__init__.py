"""stabmon: a training-stability monitor with an intervention runbook engine."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stabmon")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

__all__ = ["Monitor", "MonitorConfig", "MonitorSpec", "UserCheckpoints", "__version__", "init_process_group",
           "resume_checkpoint"]


def __getattr__(name: str) -> object:
    # Lazy, so that `import stabmon` (and the CLI) do not pay for importing torch until a Monitor is wanted.
    if name in ("Monitor", "MonitorConfig"):
        from stabmon import monitor

        return getattr(monitor, name)
    if name == "MonitorSpec":
        from stabmon import spec

        return spec.MonitorSpec
    if name == "init_process_group":  # torch.distributed's, safe across torchrun restarts
        from stabmon.collect.cluster import restarts

        return restarts.init_process_group
    if name == "resume_checkpoint":  # the step every rank resumes from after a torchrun restart
        from stabmon.collect.cluster import restarts

        return restarts.resume_checkpoint
    if name == "UserCheckpoints":
        from stabmon import checkpoints

        return checkpoints.UserCheckpoints
    raise AttributeError(f"module 'stabmon' has no attribute {name!r}")
