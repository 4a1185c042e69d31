"""Rules on the shape of the code, read from the source with :mod:`ast`.

A component gets its collaborators and uses their public surface; it never reaches into another object's private
members (``x._name``, or ``getattr(x, "_name")``, where ``x`` is not ``self``, ``cls`` or ``super()``). Such a
reach is a call back up into an owner, or a dependency on another class's internals that no test of that class
protects. The few third-party internals stabmon cannot do without are listed in ``ALLOWED``, each with its
reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stabmon"

ALLOWED: tuple[tuple[str, str], ...] = (
    # (the object as written, the private name), both regular expressions matched in full
    # torch's multi-tensor kernels: one launch for every gradient; torch offers no public equivalent
    (r"torch", r"_foreach_\w+"),
    # a hung process cannot unwind through its stuck threads: the hang reporter ends it with os._exit
    (r"os", r"_exit"),
    # the hang alarm needs the store every rank already shares; torch.distributed has no public getter for the
    # default group's store (a second client from MASTER_ADDR would miss init_method= and file:// jobs)
    (r"distributed_c10d", r"_get_default_store"),
    # torch.amp.GradScaler keeps its scale tensor and per-optimizer stage private; get_scale() would sync the host
    (r"scaler", r"_scale|_per_optimizer_states"),
    # river's PageHinkley keeps its running statistics private; the drift detector reads its test statistic, and
    # in a suite runs PageHinkley.update (with Mean.update) inline: six Python calls fewer per record, checked
    # bit for bit against river's own update by the contract suite, river's update where these are missing
    (r"ph|mean|drift\.PageHinkley\(\)|drift\.PageHinkley\(\)\._x_mean",
     r"_x_mean|_sum_increase|_min_increase|_sum_decrease|_max_decrease|_drift_detected|_mean"),
    # river's stats wrap a compiled statistic in a Python object whose update/get only forward to it; the spike
    # detectors call it directly (no Python call around each), the wrapper itself where a release has none
    (r"self\._(mean|var|median|iqr)", r"_ewmean|_ewvar|_rolling_quantile|_rolling_iqr"),
)

OWN = {"self", "cls"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """``self`` / ``cls``, or ``super()``: the object's own members."""
    if isinstance(node, ast.Name):
        return node.id in OWN
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _allowed(owner: str, name: str) -> bool:
    return any(re.fullmatch(o, owner) and re.fullmatch(n, name) for o, n in ALLOWED)


def _reaches(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, object, private name) for every reach into another object's private member."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            found.append((node.lineno, ast.unparse(node.value), node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not _own(node.args[0])
        ):
            found.append((node.lineno, ast.unparse(node.args[0]), node.args[1].value))
    return found


def violations(source: str, filename: str = "<source>") -> list[str]:
    tree = ast.parse(source, filename=filename)
    return [f"{filename}:{line}: {owner}.{name}" for line, owner, name in _reaches(tree) if not _allowed(owner, name)]


def test_no_module_reaches_into_another_objects_private_members() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += violations(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "private members reached from outside their object:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("monitor._guard('store', f)", {"monitor._guard"}),
        ("self.monitor._hooks._pre(opt)", {"self.monitor._hooks", "self.monitor._hooks._pre"}),
        ("getattr(other, '_state', None)", {"other._state"}),
        ("self._writer._wake.set()", {"self._writer._wake"}),
        ("import torch\nscale = optimizer._scale", {"optimizer._scale"}),
    ],
)
def test_the_rule_catches_reaches(source: str, expected: set[str]) -> None:
    assert {v.split(": ", 1)[1] for v in violations(source)} == expected


@pytest.mark.parametrize(
    "source",
    [
        "self._step += 1",
        "cls._registry[name] = c",
        "super()._score_value(v, x)",
        "obj.__class__.__name__",
        "torch._foreach_norm(grads)",
        "os._exit(86)",
        "scaler._scale.detach()",
        "getattr(self, '_floor', False)",
    ],
)
def test_own_members_dunders_and_listed_third_party_internals_pass(source: str) -> None:
    assert violations(source) == []


# -- the Monitor is assembly and the user's API: no collaborator receives it ----------------------------------------
USERS_OF_THE_MONITOR = {
    # they build a Monitor for the user (the package's exports, the framework callbacks, the demo command)
    "stabmon/__init__.py",
    "stabmon/monitor.py",
    "stabmon/integrations/_shared.py",
    "stabmon/integrations/hf.py",
    "stabmon/integrations/lightning.py",
    "stabmon/cli/demo.py",
}
HANDED_THE_MONITOR: tuple[tuple[str, str], ...] = (
    # (module, function) still receiving the whole Monitor: diagnose reads its batch log, records and
    # checkpoints; it moves to stabmon/diagnose/ with one build_diagnoser (issue 24, item 8)
    ("stabmon/collect/rerun.py", "diagnose"),
)


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def monitor_handed_out(source: str) -> list[str]:
    """Calls in the Monitor's own module that pass the Monitor itself (``self``) to something else, and lambdas
    that read it (``step=lambda: self._step``: a collaborator calling back into its owner)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Lambda) and any(isinstance(n, ast.Name) and n.id == "self" for n in ast.walk(node)):
            found.append(f"{node.lineno}: lambda reading the Monitor")
        elif isinstance(node, ast.Call):
            values = [*node.args, *(k.value for k in node.keywords)]
            if any(isinstance(v, ast.Name) and v.id == "self" for v in values):
                found.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return found


def monitor_received(source: str, filename: str) -> list[str]:
    """Where a collaborator module imports the Monitor, names its type, or takes a ``monitor`` parameter."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "stabmon.monitor":
            found.append(f"{filename}:{node.lineno}: imports stabmon.monitor")
        elif isinstance(node, ast.Name) and node.id == "Monitor":
            found.append(f"{filename}:{node.lineno}: names the Monitor type")
        elif isinstance(node, ast.FunctionDef) and (filename, node.name) not in HANDED_THE_MONITOR:
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if any(a.arg == "monitor" for a in args):
                found.append(f"{filename}:{node.lineno}: {node.name}() takes a monitor")
    return found


def test_the_monitor_hands_itself_to_nothing() -> None:
    found = monitor_handed_out((PACKAGE / "monitor.py").read_text(encoding="utf-8"))
    allowed = [f for f in found if f.split(": ", 1)[1] != "diagnose"]  # HANDED_THE_MONITOR's one call
    assert allowed == [], "the Monitor passes itself to a collaborator:\n" + "\n".join(allowed)


def test_no_collaborator_receives_the_monitor() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _rel(path) not in USERS_OF_THE_MONITOR:
            found += monitor_received(path.read_text(encoding="utf-8"), _rel(path))
    assert found == [], "modules that receive the Monitor:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("state = TrainingState(model, opt, monitor=self)", ["1: TrainingState"]),
        ("x = Target(step=lambda: self._step)", ["1: lambda reading the Monitor"]),
        ("cross = CrossRank(self.diagnose)", []),
        ("f(self)", ["1: f"]),
    ],
)
def test_the_handing_rule_catches_self(source: str, expected: list[str]) -> None:
    assert monitor_handed_out(source) == expected


def test_the_receiving_rule_catches_imports_types_and_parameters() -> None:
    source = "from stabmon.monitor import Monitor\ndef f(monitor: Monitor) -> None: ...\n"
    assert monitor_received(source, "m.py") == [
        "m.py:1: imports stabmon.monitor",
        "m.py:2: f() takes a monitor",
        "m.py:2: names the Monitor type",
    ]
