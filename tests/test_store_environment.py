"""The environment fingerprint: complete, JSON-ready, redacting secrets, never failing."""

from __future__ import annotations

import json
import subprocess

import pytest

from stabmon import environment
from stabmon.environment import fingerprint, redact_env


def test_fingerprint_has_the_documented_parts() -> None:
    fp = fingerprint()
    json.dumps(fp)  # storable as is
    assert fp["torch"]["version"] and "deterministic_algorithms" in fp["torch"]
    assert {"matmul_allow_tf32", "cudnn_allow_tf32", "default_dtype", "num_threads"} <= set(fp["torch"])
    assert fp["cuda"]["available"] in (True, False)
    if not fp["cuda"]["available"]:
        assert fp["cuda"]["cudnn"] is None
    assert fp["packages"]["sqlalchemy"] and fp["packages"]["polars"] and fp["packages"]["river"]
    assert fp["host"] and fp["platform"] and fp["python"]["version"]


def test_env_vars_are_selected_and_secrets_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("TORCH_HUB_TOKEN", "abc")
    monkeypatch.setenv("CUDA_WEBHOOK", "https://hooks.slack.com/services/T/B/X")
    monkeypatch.setenv("STABMON_DB_URL", "postgresql://u:pw@host/db")
    monkeypatch.setenv("HOME_SECRET_THING", "not selected")
    env = fingerprint()["env"]
    assert env["NCCL_DEBUG"] == "INFO" and env["OMP_NUM_THREADS"] == "2"
    assert env["TORCH_HUB_TOKEN"] == env["CUDA_WEBHOOK"] == env["STABMON_DB_URL"] == "<redacted>"
    assert "HOME_SECRET_THING" not in env


def test_redaction_by_value_shape() -> None:
    assert redact_env("TORCH_X", "a" * 40) == "<redacted>"
    assert redact_env("CUDA_VISIBLE_DEVICES", "0,1") == "0,1"


def test_git_outside_a_repository_and_broken_git(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    assert fingerprint()["git"] is None

    def boom(*a, **k):  # noqa: ANN002, ANN003
        raise subprocess.TimeoutExpired("git", 2.0)

    monkeypatch.setattr(environment.subprocess, "run", boom)
    assert fingerprint()["git"] is None


def test_a_failing_probe_is_recorded_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom():  # noqa: ANN202
        raise RuntimeError("probe failed")

    monkeypatch.setattr(environment, "_torch", boom)
    assert fingerprint()["torch"] is None
