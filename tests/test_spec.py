"""MonitorSpec: the one argument list of the Monitor and both framework callbacks, frozen and checked once."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.collect.config import MonitorConfig
from stabmon.monitor import Monitor
from stabmon.spec import FIELDS, MonitorSpec

PACKAGE = Path(__file__).resolve().parents[1] / "stabmon"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"mode": "sometimes"}, "mode: must be one of"),
        ({"config": {"clip": 1.0}}, "config: expected a MonitorConfig, got dict"),
        ({"runbook": "no-such-runbook"}, "runbook: "),
        ({"detectors": {"no_such_detector": {}}}, "detectors: "),
        ({"detectors": 42}, None),  # a form the pipeline refuses: checked when the monitor is built
        ({"store": 42}, "store: expected a URL string, a Sink object or None, got int"),
        ({"recipe": [1, 2]}, "recipe: expected a mapping"),
        ({"run_name": ""}, "run_name"),
        ({"alerts": ["nosuch://abc/def"]}, "alerts"),
        ({"notifier": object()}, "notifier: expected an object with handle() and close()"),
        ({"checkpoints": "ckpt/"}, "checkpoints: expected a CheckpointStore"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(arguments: dict[str, Any], message: str | None) -> None:
    if message is None:
        MonitorSpec(**{"store": None, **arguments})
        return
    with pytest.raises(ValueError) as info:
        MonitorSpec(**{"store": None, **arguments})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_spec_is_frozen_and_replace_checks_again() -> None:
    spec = MonitorSpec(store=None, runbook="default")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.mode = "apply"  # type: ignore[misc]
    assert spec.replace(mode="apply").mode == "apply" and spec.mode == "propose"
    with pytest.raises(ValueError, match="^mode: "):
        spec.replace(mode="yolo")
    assert spec.runbook.name == "default"  # loaded once, shared by every monitor built from the spec


def test_the_monitor_takes_a_spec_or_its_fields() -> None:
    model = torch.nn.Linear(2, 1)
    spec = MonitorSpec(store=None, run_name="from-spec", config=MonitorConfig(hang_timeout=None))
    with Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), spec, run_name="overridden") as monitor:
        assert monitor.run_name == "overridden" and monitor.spec.config.hang_timeout is None
    with pytest.raises(TypeError, match="unexpected keyword argument 'clip'"):
        Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), store=None, clip=1.0)


def test_the_argument_list_is_written_once() -> None:
    """No function outside spec.py takes four or more of the spec's fields as parameters: the Monitor and the
    callbacks take ``**options`` (or ``spec=``) and hand them to MonitorSpec."""
    fields = set(FIELDS)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "spec.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                names = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]} & fields
                if len(names) >= 4:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.name}({', '.join(sorted(names))})")
    assert found == []


def test_both_callbacks_build_their_spec_from_the_same_fields() -> None:
    from stabmon.integrations.hf import StabmonCallback as HFCallback
    from stabmon.integrations.lightning import StabmonCallback as PLCallback

    for callback in (HFCallback, PLCallback):
        cb = callback(store=None, runbook="default", mode="apply", config=MonitorConfig(flush_every=3))
        assert isinstance(cb.spec, MonitorSpec) and cb.spec.runbook.name == "default"
        assert cb.spec.config.flush_every == 3
        with pytest.raises(ValueError, match="^mode: "):
            callback(store=None, mode="sometimes")
