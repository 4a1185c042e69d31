"""Runbook files: the bundled ones load; bad input fails before training with FILE:LINE: field.path: msg."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stabmon.resources import runbooks_dir
from stabmon.runbook import Runbook, RunbookError, bundled_runbooks, load_runbook, loads_runbook

GOOD = """\
name: t
mode: apply
rules:
  - name: spikes
    when: {kind: spike}
    ladder:
      - action: set_clip
        params:
          max_norm: 1.5
        observe: 10
      - action: scale_lr
        params: {factor: 0.9}
        observe: 10
"""


def write(tmp_path: Path, text: str, name: str = "rb.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(path: Path) -> str:
    with pytest.raises(RunbookError) as exc:
        load_runbook(path)
    return str(exc.value)


def test_bundled_runbooks_load_and_carry_a_source_header() -> None:
    names = set(bundled_runbooks())
    assert {"default", "restart-first", "diagnose-first", "in-place-first", "opt175b", "palm-rollback",
            "propose-only"} <= names
    for name in names:
        rb = load_runbook(name)
        assert rb.name == name
        text = (runbooks_dir() / f"{name}.yaml").read_text()
        assert text.startswith("#") and "come from" in text.split("\nname:")[0]


def test_opt175b_is_the_logbook_ladder() -> None:
    rb = load_runbook("opt175b")
    ladder = [(r.action, r.params.model_dump(exclude_none=True)) for r in rb.rule("instability").ladder]
    assert ladder == [
        ("set_clip", {"max_norm": 1.5}), ("set_clip", {"max_norm": 1.0}), ("set_beta2", {"beta2": 0.95}),
        ("set_weight_decay", {"weight_decay": 0.1}), ("scale_lr", {"factor": 0.9}),
        ("scale_lr", {"scale": 0.667}), ("rollback", {"lookback": 0, "skip_batches": 0}),
    ]
    assert rb.rule("instability").ladder[-1].on_failure == "stop"
    assert rb.rule("loss_scale_collapse").ladder[0].action == "rollback"
    assert rb.mode == "apply"


def test_palm_rollback_skips_200_to_500_batches_from_100_steps_back() -> None:
    rung = load_runbook("palm-rollback").rule("loss_spike").ladder[0]
    assert rung.action == "rollback" and rung.params.lookback == 100
    assert 200 <= rung.params.skip_batches <= 500


def test_propose_only_is_propose_mode() -> None:
    assert load_runbook("propose-only").mode == "propose"


def test_unknown_intervention(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("action: scale_lr", "action: scale_learning_rate"))
    msg = error_of(p)
    assert msg.startswith(f"{p}:11: rules[0].ladder[1].action: unknown intervention 'scale_learning_rate'")


def test_wrong_parameter_type(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("max_norm: 1.5", 'max_norm: "1.5"'))
    assert error_of(p) == f"{p}:9: rules[0].ladder[0].params.max_norm: Input should be a valid number"


def test_negative_window(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("observe: 10\n      - action: scale_lr",
                                     "observe: -5\n      - action: scale_lr"))
    assert error_of(p) == f"{p}:10: rules[0].ladder[0].observe: Input should be greater than or equal to 1"


def test_missing_checkpoint_directory(tmp_path: Path) -> None:
    text = GOOD + ("      - action: rollback\n"
                   "        params: {checkpoint_dir: /nonexistent/ckpts, lookback: 100}\n")
    p = write(tmp_path, text)
    assert error_of(p) == (f"{p}:15: rules[0].ladder[2].params.checkpoint_dir: "
                           "checkpoint directory does not exist: /nonexistent/ckpts")
    ok = write(tmp_path, text.replace("/nonexistent/ckpts", str(tmp_path)), "ok.yaml")
    assert load_runbook(ok).rules[0].ladder[2].params.checkpoint_dir == str(tmp_path)


def test_a_negative_cleared_step_is_one_line(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD + "      - action: rollback\n        params: {lookback: 0, cleared_step: -1}\n")
    assert error_of(p) == f"{p}:15: rules[0].ladder[2].params.cleared_step: Input should be greater than or equal to 0"


def test_unknown_field_is_forbidden(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("    when: {kind: spike}", "    when: {kind: spike, sevrity: error}"))
    assert error_of(p) == f"{p}:5: rules[0].when.sevrity: Extra inputs are not permitted"


def test_revert_of_an_irreversible_action(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD + "      - action: checkpoint_and_stop\n        on_failure: revert\n")
    assert error_of(p) == (f"{p}:14: rules[0].ladder[2]: on_failure: revert is impossible, checkpoint_and_stop "
                           "cannot be reverted")


def test_every_error_is_reported(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("mode: apply", "mode: sometimes").replace("factor: 0.9", "factor: -1"))
    lines = error_of(p).splitlines()
    assert lines == [f"{p}:2: mode: Input should be 'propose' or 'apply'",
                     f"{p}:12: rules[0].ladder[1].params.factor: Input should be greater than 0"]


def test_yaml_syntax_error(tmp_path: Path) -> None:
    p = write(tmp_path, "name: t\nrules: [\n")
    assert error_of(p).startswith(f"{p}:3: (yaml): ")


def test_not_a_runbook_at_all(tmp_path: Path) -> None:
    assert error_of(write(tmp_path, "- 1\n- 2\n")).startswith(f"{tmp_path / 'rb.yaml'}:1: (root): ")
    with pytest.raises(RunbookError, match="no bundled runbook of that name"):
        load_runbook("no-such-runbook")


def test_include_merges_an_override_file(tmp_path: Path) -> None:
    write(tmp_path, "cooldown: 7\ndetectors:\n  spike: {threshold: 4.5}\n", "tuned.yaml")
    rb = load_runbook(write(tmp_path, "include: tuned.yaml\ndetectors:\n  spike: {window: 50}\n" + GOOD))
    assert rb.cooldown == 7 and rb.detectors == {"spike": {"window": 50, "threshold": 4.5}}


def test_errors_in_an_included_file_point_into_it(tmp_path: Path) -> None:
    inc = write(tmp_path, "# tuned\ncooldown: -3\n", "tuned.yaml")
    p = write(tmp_path, "include: tuned.yaml\n" + GOOD)
    assert error_of(p) == f"{inc}:2: cooldown: Input should be greater than or equal to 0"
    missing = write(tmp_path, "include: nope.yaml\n" + GOOD, "m.yaml")
    assert error_of(missing) == f"{missing}:1: include: included file does not exist: nope.yaml"


def test_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    assert load_runbook(write(tmp_path, GOOD.replace("name: t\n", ""), "mine.yaml")).name == "mine"


def test_loaded_runbooks_pickle_and_are_immutable() -> None:
    rb = load_runbook("opt175b")
    assert pickle.loads(pickle.dumps(rb)) == rb
    with pytest.raises(ValueError):
        rb.rules[0].ladder[0].observe = 3  # type: ignore[misc]


def test_duplicate_rule_names() -> None:
    with pytest.raises(RunbookError, match=r"<string>:1: \(root\): rule names must be unique, repeated: a"):
        loads_runbook("name: x\nrules:\n - {name: a, ladder: [{action: alert_only}]}\n"
                      " - {name: a, ladder: [{action: alert_only}]}\n")


@settings(max_examples=150, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["name", "mode", "rules", "ladder", "action", "params", "observe", "when", "x"]),
        inner, max_size=4),
    max_leaves=12,
))
def test_arbitrary_documents_fail_only_with_runbook_errors(doc: object) -> None:
    import yaml

    try:
        rb = loads_runbook(yaml.safe_dump(doc))
    except RunbookError as exc:
        for issue in exc.issues:
            assert issue.line >= 1 and issue.path and issue.message
    else:
        assert isinstance(rb, Runbook)


def test_a_bad_release_setting_is_one_line_naming_it(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("mode: apply\n", "mode: apply\nrelease: {steps: -5}\n"))
    assert error_of(p).startswith(f"{p}:3: release.steps: Input should be greater than or equal to 0")
