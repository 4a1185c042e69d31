"""Every importer survives garbage: malformed input is counted, never raised (hypothesis-generated)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabmon.replay.importers.base import ImportResult
from stabmon.replay.importers.sniff import importers, sniff_format

MODULES = importers()
IDS = [m.FORMAT for m in MODULES]
OPTIONS = {"pattern": {"patterns": [r"iter (?P<step>\S+): loss (?P<loss>\S+), time (?P<step_time_ms>\S*)ms"]}}
"""Options an importer cannot read without (the pattern importer reads with the user's regex)."""

# Lines that look like the formats' data lines, with their values mangled, mixed with raw noise.
fragments = st.sampled_from(
    [
        "| INFO | train_inner | {",
        '"loss": "',
        '"num_updates": "',
        "}",
        "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: ",
        "train/lm_loss\tstep",
        "step,loss,grad_norm",
        "\t",
        ",",
        "nan",
        "inf",
        "-1e400",
        "1e308",
        "9" * 30,
        "",
        " iteration 5/ 10 | lm loss: ",
        " | grad norm: ",
        "s:12 trl:",
        "OVERFLOW! Rank 0 Skipping step.",
        "\x00",
        "\ufeff",
        '"',
        "{}",
        "[1,2]",
        "PAR1",
        "brain.Event",
        "iter 310: loss ",
        ", time 21.3ms, mfu ",
        "step 250: train loss 2.4, val loss ",
    ]
)
lines = st.lists(
    st.one_of(fragments, st.text(max_size=30), st.floats().map(str), st.integers().map(str)), max_size=8
).map("".join)
documents = st.lists(lines, max_size=25).map("\n".join)


def _write(text: str, name: str) -> Path:
    d = Path(tempfile.mkdtemp())
    p = d / name
    p.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    return p


@pytest.mark.parametrize("module", MODULES, ids=IDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=documents)
def test_importer_never_raises_on_garbage(module: object, text: str) -> None:
    p = _write(text, "garbage.log")
    result = module.read(p, **OPTIONS.get(module.FORMAT, {}))  # type: ignore[attr-defined]
    assert isinstance(result, ImportResult)
    assert result.malformed >= 0 and len(result.problems) <= ImportResult.MAX_PROBLEMS
    steps = [r.step for r in result.records]
    assert steps == sorted(steps)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=2000))
def test_detection_never_raises_on_bytes(data: bytes) -> None:
    d = Path(tempfile.mkdtemp())
    p = d / "blob.bin"
    p.write_bytes(data)
    try:
        mod = sniff_format(p)
    except ValueError:
        return
    assert isinstance(mod.read(p), ImportResult)


@settings(max_examples=40, deadline=None)
@given(
    header=st.sampled_from(["train/lm_loss\tstep", "step,loss", "_step,train/loss,train/grad_norm"]),
    rows=st.lists(
        st.lists(st.one_of(st.floats(allow_nan=True), st.text(max_size=6)), min_size=1, max_size=4),
        max_size=20,
    ),
)
def test_tables_survive_ragged_rows(header: str, rows: list[list[object]]) -> None:
    sep = "\t" if "\t" in header else ","
    body = "\n".join(sep.join(str(v) for v in row) for row in rows)
    p = _write(header + "\n" + body + "\n", "h.tsv" if sep == "\t" else "h.csv")
    for module in MODULES:
        if module.FORMAT in ("wandb", "generic"):
            r = module.read(p)
            assert isinstance(r, ImportResult)
