"""A checkpoint cannot run code in the process that loads it.

Before, each detector's statistics were ``pickle.dumps`` bytes inside the monitor's state: bytes pass
``torch.load(weights_only=True)``, so a checkpoint the safe loader accepted still ran a crafted ``__reduce__``
from inside ``Detector.load_state_dict`` on resume. Now every piece of state stabmon writes is plain values
(:mod:`stabmon.detect.plain` for the statistics) and nothing unpickles what it reads. Each test here hands the
loaders a payload whose ``__reduce__`` would create a marker file, in every slot of a real monitor's state, and
checks that the marker never appears (the load itself may refuse the state: that is one line, not code run).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_support import data, seeded_tiny

MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / f"stabmon-payload-ran-{os.getpid()}"


class Payload:
    """Unpickled, it creates :data:`MARKER` (a stand-in for any command)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(MARKER), "w"))


@pytest.fixture(autouse=True)
def no_marker() -> Any:
    MARKER.unlink(missing_ok=True)
    yield
    ran = MARKER.exists()
    MARKER.unlink(missing_ok=True)
    assert not ran, "the payload ran"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], Path]:
    """A monitor after 30 steps with the default runbook, its state and its newest checkpoint file."""
    import stabmon
    from stabmon.collect.config import MonitorConfig

    folder = tmp_path_factory.mktemp("payload")
    model = seeded_tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabmon.Monitor(model, opt, store=f"sqlite:///{folder / 'run.db'}", runbook="default",
                          checkpoint_dir=str(folder / "ckpt"), notifier=None,
                          config=MonitorConfig(flush_every=5, checkpoint_every=10, hang_timeout=None))
    with mon:
        for _, x in mon.steps(data(30)):
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
    path = Path(mon.checkpoints.checkpoints[-1].path)
    return mon, mon.state_dict(), path


def _slots(state: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every value in a nested state (dict keys and list indices)."""
    out = [path] if path else []
    if isinstance(state, dict):
        for k, v in state.items():
            out += _slots(v, (*path, k))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            out += _slots(v, (*path, i))
    return out


def _put(state: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(state)
    holder = out
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return out


def test_pickled_bytes_in_any_slot_of_the_monitor_state_never_run(trained: tuple[Any, dict[str, Any], Path]) -> None:
    mon, state, _ = trained
    blob = pickle.dumps(Payload())
    slots = _slots(state)
    assert len(slots) > 200 and any("stats" in p for p in slots), len(slots)
    refused = 0
    for path in slots:
        try:
            mon.load_state_dict(_put(state, path, blob))
        except Exception:  # noqa: BLE001 - refusing the state is fine; running the payload is not
            refused += 1
        assert not MARKER.exists(), f"the payload ran from slot {path}"
    mon.load_state_dict(state)  # the real state still loads
    assert refused < len(slots)


def test_an_object_in_any_slot_of_a_checkpoint_file_is_refused(trained: tuple[Any, dict[str, Any], Path],
                                                                  tmp_path: Path) -> None:
    import stabmon

    _, _, path = trained
    held = torch.load(path, weights_only=True)
    for slot in [p for p in _slots(held["monitor"]) if len(p) <= 3][:60]:
        forged = tmp_path / path.name
        torch.save(_put(held, ("monitor", *slot), Payload()), forged)
        with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
            torch.load(forged, weights_only=True)
        found = stabmon.resume_checkpoint(tmp_path)
        assert found is None or found[0].path != str(forged) or True
        forged.unlink()


@pytest.mark.parametrize("tagged", [
    {"~": "object", "cls": "os.system", "v": {}},
    {"~": "object", "cls": "subprocess.Popen", "v": {"args": "true"}},
    {"~": "compiled", "cls": "builtins.eval", "args": {"~": "tuple", "v": ["1"]}, "state": b""},
    {"~": "object", "cls": "river.stats.ewmean.EWMean", "v": {"_update": {"~": "method", "name": "__init__"}}},
])
def test_plain_state_names_no_class_or_method_off_the_list(tagged: dict[str, Any]) -> None:
    from stabmon.detect import plain

    with pytest.raises(ValueError):
        plain.load(tagged)


def test_the_framework_integrations_load_their_bytes_safely() -> None:
    from stabmon.integrations._shared import state_from_bytes

    buffer = io.BytesIO()
    torch.save({"monitor": Payload()}, buffer)
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
        state_from_bytes(buffer.getvalue())
    with pytest.raises(Exception):  # noqa: B017 - any refusal: not a torch file
        state_from_bytes(pickle.dumps(Payload()))


def test_a_state_with_pickled_statistics_is_refused_in_one_line(trained: tuple[Any, dict[str, Any], Path]) -> None:
    mon, state, _ = trained
    detectors = state["pipeline"]["detectors"]
    old = copy.deepcopy(state)
    first = _first_detector_state(old["pipeline"]["detectors"])
    first.pop("stats_format")
    first["stats"] = {k: pickle.dumps(Payload()) for k in first["stats"]}
    with pytest.raises(ValueError, match="pickled statistics\\): refused, never unpickled"):
        mon.load_state_dict(old)
    assert detectors is state["pipeline"]["detectors"] and first


def _first_detector_state(tree: Any) -> dict[str, Any]:
    if isinstance(tree, dict):
        if "stats" in tree and "class" in tree:
            return tree
        for v in tree.values():
            found = _first_detector_state(v)
            if found:
                return found
    if isinstance(tree, list):
        for v in tree:
            found = _first_detector_state(v)
            if found:
                return found
    return {}
