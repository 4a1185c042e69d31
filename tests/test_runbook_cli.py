"""``stabmon runbook validate | list | show``."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from stabmon.cli import app


def test_validate_ok_and_bad(tmp_path: Path) -> None:
    ok = CliRunner().invoke(app, ["runbook", "validate", "opt175b"])
    assert ok.exit_code == 0 and ok.output == "ok: opt175b (apply mode, 2 rules, 8 rungs)\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrules:\n  - name: r\n    ladder:\n      - action: set_clip\n"
                   "        observe: -1\n")
    res = CliRunner().invoke(app, ["runbook", "validate", str(bad)])
    assert res.exit_code == 1
    assert res.output.splitlines() == [
        f"{bad}:5: rules[0].ladder[0].params: Field required",
        f"{bad}:6: rules[0].ladder[0].observe: Input should be greater than or equal to 1",
    ]


def test_list_and_show() -> None:
    res = CliRunner().invoke(app, ["runbook", "list", "--json"])
    names = {r["name"]: r for r in json.loads(res.output)}
    assert set(names) >= {"default", "opt175b", "palm-rollback", "propose-only"}
    assert names["propose-only"]["mode"] == "propose"
    text = CliRunner().invoke(app, ["runbook", "show", "opt175b"]).output
    assert text.startswith("# OPT-175B ladder") and "max_norm: 1.0" in text
    shown = json.loads(CliRunner().invoke(app, ["runbook", "show", "opt175b", "--json"]).output)
    assert shown["rules"][1]["ladder"][5]["params"] == {"factor": None, "scale": 0.667}
    missing = CliRunner().invoke(app, ["runbook", "show", "nope"])
    assert missing.exit_code == 1 and "no bundled runbook of that name" in missing.output


def test_validate_warns_about_rungs_that_do_not_fit_the_optimizer_in_force(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["runbook", "validate", "opt175b", "--hparams", "clip=1.0,weight_decay=0.2"])
    assert res.exit_code == 0
    warnings = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: rule instability rung 1: set_clip to 1.5 would not lower clip (1 in force): it will be skipped",
        "warning: rule instability rung 2: set_clip to 1 would not lower clip (1 in force): it will be skipped",
        "warning: rule instability rung 3: set_beta2: the optimizer has no beta2: it will change nothing",
        "warning: rule instability rung 4: set_weight_decay to 0.1 would not raise weight_decay (0.2 in force): "
        "it will be skipped",
    ]
    fits = CliRunner().invoke(app, ["runbook", "validate", "opt175b", "--hparams", "clip=2,beta2=0.98,weight_decay=0"])
    assert fits.exit_code == 0 and "warning" not in fits.output
    bad = CliRunner().invoke(app, ["runbook", "validate", "opt175b", "--hparams", "clip=one"])
    assert bad.exit_code == 1 and bad.output == "error: --hparams: expected name=number, got 'clip=one'\n"


def test_fit_warns_that_a_rollback_without_checkpoints_will_fail() -> None:
    from stabmon.runbook import load_runbook
    from stabmon.runbook.fit import fit_warnings

    lines = fit_warnings(load_runbook("palm-rollback"), {"clip": 1.0}, checkpoints=False)
    assert lines and all("needs checkpoints" in line for line in lines)
    assert fit_warnings(load_runbook("palm-rollback"), {"clip": 1.0}, checkpoints=True) == []
