"""docs/attach.md's patch against nanoGPT's own ``train.py`` (a copy under tests/nanogpt/, MIT): it applies with
``patch``, the docs count its lines as ``diff -u`` does, and the patched script trains on CPU from scratch and
resumes into the same run."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
NANOGPT = REPO / "tests" / "nanogpt"
DOCS = REPO / "docs" / "attach.md"


def documented_patch() -> str:
    blocks = re.findall(r"```diff\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/attach.md shows one diff against nanoGPT's train.py"
    return blocks[0]


def test_the_documented_patch_is_counted_as_diff_counts_it() -> None:
    lines = documented_patch().splitlines()
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++ "))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("--- "))
    assert (added, removed) == (20, 19)
    text = DOCS.read_text()
    assert f"{added} added and {removed} removed lines as `diff -u` counts them" in text


def patched_nanogpt(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "configurator.py", "model.py"):
        shutil.copy(NANOGPT / name, where / name)
    (where / "stabmon.patch").write_text(documented_patch())
    proc = subprocess.run(["patch", "-p0", "--no-backup-if-mismatch", "-i", "stabmon.patch"], cwd=where,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return where


def char_data(where: Path) -> None:
    """nanoGPT's shakespeare_char layout (train.bin, val.bin, meta.pkl) from generated text."""
    text = "".join(f"line {i % 97}: the quick brown fox jumps over the lazy dog.\n" for i in range(400))
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    data = where / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    n = int(0.9 * len(ids))
    ids[:n].tofile(data / "train.bin")
    ids[n:].tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
        pickle.dump(meta, f)


TINY = ["--device=cpu", "--compile=False", "--dtype=float32", "--dataset=shakespeare_char", "--n_layer=2",
        "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8", "--gradient_accumulation_steps=2",
        "--eval_interval=10", "--eval_iters=2", "--log_interval=10", "--warmup_iters=5", "--lr_decay_iters=40",
        "--learning_rate=1e-3", "--min_lr=1e-4"]


def train(where: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py", *TINY, *args], cwd=where, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_patched_nanogpt_trains_from_scratch_and_resumes(tmp_path: Path) -> None:
    where = patched_nanogpt(tmp_path / "nanogpt")
    char_data(where)
    first = train(where, "--max_iters=20")
    assert "Traceback" not in first and "iter 20:" in first
    assert sorted(p.name for p in (where / "out").glob("ckpt-*.pt")) == [
        "ckpt-000000.pt", "ckpt-000010.pt", "ckpt-000020.pt"]  # every eval_interval, through save_checkpoint
    second = train(where, "--max_iters=30", "--init_from=resume")
    assert "Traceback" not in second and "iter 30:" in second and "iter 10:" not in second
    with sqlite3.connect(where / "out" / "stabmon.db") as db:
        runs = db.execute("select id, status, config from runs").fetchall()
        steps = [s for (s,) in db.execute("select step from steps order by seq")]
    assert len(runs) == 1 and runs[0][1] == "finished"  # the resume continued the same run
    assert '"init_from": "scratch"' in runs[0][2] and '"n_embd": 32' in runs[0][2]  # nanoGPT's config as recipe
    # steps 0-20 from scratch; the resume starts from the checkpoint at 20 (saved before step 20 trained)
    assert steps == list(range(21)) + list(range(20, 31))
