"""``stabmon replay`` says what to tune first, and a tuning reaches a shipped runbook by reference.

- the summary's first screen: the verdict, each detector that fired, and for a noisy one a setting checked by a
  second replay (or the ``stabmon tune`` command), on real records (a ``trainer_state.json``, an llm.c log, a
  Megatron-DeepSpeed log; skipped with the reason where ``../shared`` is absent);
- ``--thresholds FILE`` (the file ``stabmon tune --out`` writes) changes the replay as the summary predicted;
- ``extends: default`` beside ``include: tuned.yaml``, and ``Monitor(thresholds=...)``;
- bad input is one line naming the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from test_tune import labelled, write_series  # noqa: F401  (the labelled fixture)
from typer.testing import CliRunner

from stabmon.cli import app
from stabmon.replay.tune import tune

SHARED = Path(os.environ.get("STABMON_REAL_RUNS", Path(__file__).resolve().parents[2] / "shared" / "data"
                                                                                        / "real-runs")).parent
FINETUNE = SHARED / "real-finetunes" / "HangerYang__Star__spec-draft-heads-ckpt40000.json"
LLMC = SHARED / "real-runs" / "llmc-gpt2-124m-SiddanthEmani" / "main.log"
MEGATRON = SHARED / "real-runs" / "bigscience-chronicles" / "tr8-104B_exp11_spike-it11446-11448.log"


def real(path: Path) -> Path:
    if not path.is_file():
        if os.environ.get("STABMON_REQUIRE_REAL_RUNS"):
            pytest.fail(f"real record missing: {path}")
        pytest.skip(f"real record not present: {path} (the shared corpus is not beside this clone)")
    return path


def replay(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["replay", *args, "--no-store"], terminal_width=300)
    return res.exit_code, res.output


def first_screen(output: str) -> list[str]:
    return output.splitlines()[:12]


def test_a_trainer_state_replay_names_the_noisy_detectors_and_a_checked_setting(tmp_path: Path) -> None:
    code, out = replay(str(real(FINETUNE)))
    assert code == 0, out
    head = first_screen(out)
    assert head[0].endswith(": alerts only")
    assert any(re.match(r"\s+robust_spike\s+grad_norm\s+57 info, 1 warning", line) for line in head), head
    settings = re.findall(r"try: --set (\S+)", "\n".join(head))
    assert "robust_spike.z_threshold=25" in settings, head
    together = next(line for line in head if line.startswith("tune: all"))
    remaining = int(re.search(r"together: (\d+) report", together).group(1))
    assert "every warning-or-above report still made" in together
    assert "(62 info report(s) not listed: --all lists them)" in out

    # the round trip: the settings as a thresholds file, replayed: what the summary predicted
    thresholds = tmp_path / "tuned.yaml"
    nested: dict[str, dict[str, float]] = {}
    for s in settings:
        key, value = s.split("=")
        det, param = key.split(".")
        nested.setdefault(det, {})[param] = float(value)
    thresholds.write_text(yaml.safe_dump({"detectors": nested}))
    code, again = replay(str(FINETUNE), "--thresholds", str(thresholds), "--all", "--json")
    assert code == 0, again
    rows = [yaml.safe_load(line) for line in again.splitlines() if line.startswith("{")]
    anomalies = [r for r in rows if r["type"] == "Anomaly"]
    assert len(anomalies) == remaining
    assert [(r["step"], r["severity"]) for r in anomalies if r["severity"] != "info"] == [(22360, "warning")]


@pytest.mark.parametrize("path", [LLMC, MEGATRON], ids=["llmc", "megatron"])
def test_llmc_and_megatron_replays_summarise_first(path: Path) -> None:
    code, out = replay(str(real(path)))
    assert code == 0, out
    head = first_screen(out)
    assert re.search(r": (quiet|alerts only|would change training)$", head[0]), head
    assert any(line.startswith("  spike ") for line in head), head
    assert any(line.startswith("tune: ") for line in head), head  # a setting, or why there is nothing to tune


def test_tune_out_feeds_replay_thresholds(labelled: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "tuned.yaml"
    out.write_text(tune(labelled, space={"spike.z_threshold": [1000.0], "robust_spike.z_threshold": [1000.0]},
                        folds=1).overrides_yaml())
    run = labelled.parent / "runs" / "r0.csv"
    code, plain = replay(str(run), "--json")
    code2, tuned = replay(str(run), "--json", "--thresholds", str(out))
    code3, sets = replay(str(run), "--json", "--set", "spike.z_threshold=1000", "--set",
                         "robust_spike.z_threshold=1000")
    assert code == code2 == code3 == 0
    spikes = [line for line in plain.splitlines() if '"kind": "spike"' in line]
    assert spikes  # the synthetic spike is caught at the defaults
    assert [line for line in tuned.splitlines() if '"kind": "spike"' in line] == []  # and not at the tuned setting
    def rows(output: str) -> list[tuple]:
        found = [yaml.safe_load(line) for line in output.splitlines() if line.startswith("{")]
        return [(r["type"], r.get("step"), r.get("kind"), r.get("metric"), r.get("severity")) for r in found]

    assert rows(tuned) == rows(sets)  # the file is the same as its settings given one by one


def test_extends_default_with_an_include_is_the_tuned_default(tmp_path: Path) -> None:
    from stabmon.runbook import load_runbook

    (tmp_path / "tuned.yaml").write_text("detectors:\n  spike: {z_threshold: 7.5}\n")
    (tmp_path / "mine.yaml").write_text("extends: default\ninclude: tuned.yaml\n")
    mine, default = load_runbook(tmp_path / "mine.yaml"), load_runbook("default")
    assert mine.name == "mine" and mine.rules == default.rules
    assert mine.detectors["spike"] == {**default.detectors.get("spike", {}), "z_threshold": 7.5}


@pytest.mark.parametrize(("text", "message"), [
    ("extends: nope\n", "mine.yaml:1: extends: no runbook file and no bundled runbook named 'nope'"),
    ("extends: mine.yaml\n", "mine.yaml:1: extends: 'mine.yaml' extends itself"),
    ("extends: [default]\n", "mine.yaml:1: extends: must name a bundled runbook or a runbook file"),
])
def test_a_bad_extends_is_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    from stabmon.runbook import RunbookError, load_runbook

    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(RunbookError) as err:
        load_runbook(tmp_path / "mine.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_monitor_takes_a_thresholds_file(tmp_path: Path) -> None:
    import torch

    from stabmon.monitor import Monitor

    f = tmp_path / "tuned.yaml"
    f.write_text("detectors:\n  spike: {z_threshold: 9}\n")
    model = torch.nn.Linear(2, 1)
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, runbook="default", thresholds=f)
    try:
        assert mon.pipeline.detectors.configs["spike"].z_threshold == 9.0
    finally:
        mon.close()
    f.write_text("detectors:\n  spike: {z_threshold: -1}\n")
    with pytest.raises(ValueError, match=r"^detectors: detectors.spike.z_threshold must be > 0"):
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, thresholds=f)


@pytest.mark.parametrize(("text", "message"), [
    (None, "cannot read"),
    ("- a\n", "must map detectors to their parameters"),
    ("spike: 3\n", "spike must map parameters to values, got 3"),
    ("spike: {z: [1\n", "is no YAML mapping"),
])
def test_a_bad_thresholds_file_is_one_line(tmp_path: Path, text: str | None, message: str) -> None:
    run = tmp_path / "run.csv"
    write_series(run, 50, 30)
    f = tmp_path / "t.yaml"
    if text is not None:
        f.write_text(text)
    code, out = replay(str(run), "--thresholds", str(f))
    assert code == 1 and message in out and len(out.strip().splitlines()) == 1, out
