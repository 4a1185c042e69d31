"""Hostile input files: runbook YAML built to exhaust memory or crash the parser, and logs far larger than
memory should allow for them."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.runbook import RunbookError, load_runbook

RULES = "rules:\n  - name: spike\n    when: {kind: spike}\n    ladder: [{action: set_clip, params: {max_norm: 1.0}}]\n"


def laughs(levels: int) -> str:
    """The billion-laughs document: each level refers ten times to the one before."""
    out = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        p = f"*l{i - 1}"
        out.append(f"l{i}: &l{i} [{', '.join([p] * 10)}]")
    return "\n".join(out) + "\n" + RULES


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        (laughs(9), 2, "aliases expand to more than 100000 values"),
        ("rules: " + "[" * 5000 + "]" * 5000 + "\n", 1, "nested deeper than 64 levels"),
        ("name: x\n" + RULES.replace("name: spike", "name: spike\n    name: other"), 4, "duplicate key 'name'"),
        ("name: x\nname: y\n" + RULES, 2, "duplicate key 'name' (first at line 1)"),
        ("name: ok\n# caf\xe9\n" + RULES, 2, "not UTF-8 text"),
        ("# " + "x" * (1 << 20) + "\n" + RULES, 1, "more than the 1048576 a runbook may hold"),
    ],
    ids=["billion-laughs", "deep-nesting", "duplicate-nested-key", "duplicate-top-key", "bad-utf8", "huge"],
)
def test_hostile_runbooks_are_one_line_file_line_errors(tmp_path: Path, text: str, line: int, needle: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(text.encode("latin-1") if "\xe9" in text else text.encode())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(RunbookError) as err:
        load_runbook(path)
    took, grew_kib = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert str(err.value).startswith(f"{path}:{line}: ") and needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert took < 10 and grew_kib < 200_000, (took, grew_kib)  # bounded: nothing was expanded
    result = CliRunner().invoke(app, ["runbook", "validate", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output and needle in result.output
