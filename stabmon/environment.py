"""The environment fingerprint recorded with every run, so two runs can be compared on what they ran on.

:func:`fingerprint` never raises: anything it cannot read is recorded as None. Environment variable values
that look like secrets (by name or by shape) are replaced with ``"<redacted>"``.

>>> fp = fingerprint()
>>> sorted(fp)[:4]
['cuda', 'env', 'git', 'host']
>>> fp["python"]["version"].count(".") >= 2
True
>>> redact_env("NCCL_TOKEN", "abc")
'<redacted>'
"""

from __future__ import annotations

import logging
import os
import platform
import re
import socket
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

log = logging.getLogger(__name__)

PACKAGES = (
    "stabmon",
    "torch",
    "numpy",
    "river",
    "polars",
    "sqlalchemy",
    "alembic",
    "pydantic",
    "apprise",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch-lightning",
    "deepspeed",
    "triton",
)
ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "CUBLAS_", "CUDNN_", "OMP_", "MKL_", "STABMON_")
ENV_NAMES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH|WEBHOOK)", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"(://[^/\s:]+:[^@\s]+@|^[A-Za-z0-9_\-+/=]{32,}$|xox[abpr]-|hooks\.slack\.com)")


def redact_env(name: str, value: str) -> str:
    """``value``, or ``"<redacted>"`` when the name or the value looks like a credential; URLs in it (alert
    channels, database URLs) keep only what :func:`stabmon.redaction.hide_secrets` leaves."""
    if _SECRET_NAME.search(name) or _SECRET_VALUE.search(value):
        return "<redacted>"
    if "://" in value:
        from stabmon.redaction import hide_secrets

        return hide_secrets(value)
    return value


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a fingerprint must never fail
        log.debug("environment fingerprint: %s failed", getattr(fn, "__name__", fn), exc_info=True)
        return None


def _packages() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _torch() -> dict[str, Any] | None:
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except Exception:  # noqa: BLE001
            return None
    import torch

    return {
        "version": torch.__version__,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": str(torch.get_default_dtype()),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
    }


def _cuda() -> dict[str, Any]:
    out: dict[str, Any] = {"available": False, "version": None, "cudnn": None, "devices": []}
    try:
        import torch
    except Exception:  # noqa: BLE001
        return out
    out["version"] = torch.version.cuda
    if torch.cuda.is_available():
        out["available"] = True
        out["cudnn"] = torch.backends.cudnn.version()
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def _git() -> dict[str, Any] | None:
    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], capture_output=True, text=True, timeout=2.0, check=False, cwd=os.getcwd()
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    if commit is None:
        return None
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _env() -> dict[str, str]:
    return {
        k: redact_env(k, v)
        for k, v in sorted(os.environ.items())
        if k.startswith(ENV_PREFIXES) or k in ENV_NAMES
    }


def fingerprint() -> dict[str, Any]:
    """Python, torch (and its numerics flags), CUDA/cuDNN (None on CPU), key package versions, relevant
    environment variables (redacted), the git commit of the working directory, host and platform."""
    return {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "torch": _safe(_torch),
        "cuda": _safe(_cuda),
        "packages": _safe(_packages),
        "env": _safe(_env),
        "git": _safe(_git),
        "host": _safe(socket.gethostname),
        "platform": _safe(platform.platform),
        "machine": platform.machine(),
    }
