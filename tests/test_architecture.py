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
    # a torch LR scheduler keeps the list get_last_lr() returns private; the HF callback shows the LR in force
    # there while the Trainer reads it (a plain list of numbers: no method patched onto the user's scheduler)
    (r"self\.scheduler", r"_last_lr"),
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


# -- what an action is, the runbook reads from its declared traits (stabmon.interventions.traits), not its name --
TRAIT_READERS = ("runbook", "pipeline.py")  # the engine, its helpers and the pipeline that feeds it


def _is_action(node: ast.expr) -> bool:
    """``action``, ``x.action`` or ``x["action"]``."""
    if isinstance(node, ast.Name):
        return node.id == "action"
    if isinstance(node, ast.Attribute):
        return node.attr == "action"
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and node.slice.value == "action")


def _names_literal(node: ast.expr) -> bool:
    """A string literal, or a tuple / list / set (or frozenset(...)) holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set"):
        return any(_names_literal(a) for a in node.args)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_literal(e) for e in node.elts)
    return False


def action_name_branches(source: str, filename: str = "<source>") -> list[str]:
    """Every comparison of an action with a name written in the source (``action == "rollback"``,
    ``d.action in ("revert", "alert_only")``, ``iv["action"] != "diagnose"``)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(_is_action(s) for s in sides) and any(_names_literal(s) for s in sides):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_runbook_reads_traits_not_action_names() -> None:
    found = []
    for place in TRAIT_READERS:
        root = PACKAGE / place
        for path in sorted(root.rglob("*.py") if root.is_dir() else [root]):
            found += action_name_branches(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "branches on an action's name (declare a trait on the intervention instead):\n" + "\n".join(
        found)


@pytest.mark.parametrize(
    "source",
    [
        'if decision.action == "rollback": pass',
        'x = rung.action != "alert_only"',
        'ok = d.action in ("revert", "alert_only")',
        'ok = iv["action"] == "diagnose"',
        'ok = action not in frozenset({"diagnose"})',
        'ok = "checkpoint_and_stop" == decision.action',
    ],
)
def test_the_action_rule_catches_name_branches(source: str) -> None:
    assert len(action_name_branches(source)) == 1


@pytest.mark.parametrize(
    "source",
    ['if traits_of(decision.action).rewinds_step: pass', 'ok = rung.on_failure == "revert"',
     'ok = decision.status == "applied"'],
)
def test_trait_reads_pass_the_action_rule(source: str) -> None:
    assert action_name_branches(source) == []


# -- a component gets its collaborators, not the Monitor that owns them --
MONITOR_USERS = {  # modules that may take a Monitor as a parameter: users of its public API, not its parts
    "stabmon/monitor.py",
    "stabmon/integrations/_shared.py",  # the framework callbacks' helpers: the monitor the callback built
    "stabmon/cli/demo.py",  # prints the summary of the run it made, from the monitor's public attributes
}


def monitor_parameters(source: str, filename: str = "<source>") -> list[str]:
    """Every function parameter named ``monitor`` or annotated with the ``Monitor``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]:
            note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if arg.arg == "monitor" or re.search(r"\bMonitor\b", note):
                found.append(f"{filename}:{arg.lineno}: {arg.arg}: {note or '(no annotation)'}")
    return found


def test_no_component_receives_the_monitor() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE.parent))
        if name not in MONITOR_USERS:
            found += monitor_parameters(path.read_text(encoding="utf-8"), name)
    assert found == [], "the Monitor handed to a collaborator (pass what it needs instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "caught"),
    [("def diagnose(monitor: Any, grads): ...", 1), ("def f(owner: 'stabmon.Monitor'): ...", 1),
     ("def f(m: Monitor | None = None): ...", 1), ("def f(model: nn.Module, monitored: bool): ...", 0)],
)
def test_the_monitor_rule_catches_a_monitor_parameter(source: str, caught: int) -> None:
    assert len(monitor_parameters(source)) == caught


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
HANDED_THE_MONITOR: tuple[tuple[str, str], ...] = ()
"""(module, function) allowed to receive the whole Monitor: none (diagnose gets its collaborators from
``stabmon.diagnose.build.build_diagnoser``)."""


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
    assert found == [], "the Monitor passes itself to a collaborator:\n" + "\n".join(found)


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


# -- no probing of stabmon's own objects: what is optional is a small Protocol, checked with isinstance --
PROBES_ALLOWED: dict[tuple[str, str], str] = {
    # torch's objects: private or version-dependent attributes of the optimizer, the loss scaler, DTensor
    ("stabmon/collect/step/guard.py", "self.optimizer"): "torch: a fused optimizer's found_inf",
    ("stabmon/collect/step/optim.py", "self.optimizer"): "torch: a fused optimizer's grad_scale / found_inf",
    ("stabmon/collect/signals/moment_ratio.py", "self._optimizer"): "torch: a fused optimizer's grad_scale / found_inf",
    ("stabmon/collect/step/optim.py", "scaler"): "torch: GradScaler's per-optimizer stage (private)",
    ("stabmon/collect/step/optim.py", "state.get('stage')"): "torch: GradScaler's OptState enum",
    ("stabmon/collect/signals/record.py", "scaler"): "torch: GradScaler's _scale (private)",
    ("stabmon/collect/signals/record.py", "value"): "a user's observed value: tensor, numpy or float",
    ("stabmon/detect/plain.py", "cls"): "an allow-listed statistic class (river's or a detector window)",
    ("stabmon/detect/plain.py", "importlib.import_module(module)"): "the module of an allow-listed class",
    ("stabmon/detect/plain.py", "obj"): "an allow-listed statistic object: its own methods",
    ("stabmon/detect/plain.py", "value"): "a statistic's attribute: a bound method of its own or a value",
    ("stabmon/collect/signals/observe.py", "value"): "a user's observed value: tensor, numpy or float",
    ("stabmon/collect/cluster/sharding.py", "t"): "torch: DTensor or plain tensor",
    ("stabmon/collect/step/qk.py", "tensor"): "torch: DTensor or plain tensor",
    ("stabmon/collect/signals/attention.py", "module"): "a user's attention module (head counts by attribute)",
    ("stabmon/collect/signals/attention.py", "owner"): "a user's attention module or its HF config",
    ("stabmon/collect/signals/vocab.py", "model"): "a user's model (an HF config, if any)",
    ("stabmon/collect/signals/vocab.py", "getattr(model, 'config', None)"): "an HF config's vocab_size",
    ("stabmon/diagnose/rerun.py", "scaler"): "torch: GradScaler's per-optimizer state (private)",
    ("stabmon/pipeline.py", "self.engine"): "a user's own EngineLike need not settle (it goes on at its next record)",
    ("stabmon/diagnose/experiments.py", "scaler"): "torch: GradScaler's per-optimizer stage, put back (private)",
    ("stabmon/diagnose/experiments.py", "out"): "a user's model output (an HF ModelOutput's loss)",
    ("stabmon/overrides.py", "out"): "an LR that is a float or a tensor",
    # frameworks and third-party libraries
    ("stabmon/integrations/_shared.py", "self.scheduler"): "a framework's LR scheduler",
    ("stabmon/integrations/hf.py", "optimizer"): "accelerate's AcceleratedOptimizer wrapper",
    ("stabmon/integrations/hf.py", "output"): "an HF ModelOutput",
    ("stabmon/integrations/hf.py", "kwargs.get('optimizer')"): "accelerate's step_was_skipped",
    ("stabmon/integrations/hf.py", "args"): "HF TrainingArguments across versions",
    ("stabmon/integrations/lightning.py", "trainer"): "Lightning's Trainer across versions",
    ("stabmon/integrations/lightning.py", "trainer.gradient_clip_algorithm"): "Lightning's enum or str",
    ("stabmon/integrations/lightning.py", "trainer.precision_plugin"): "Lightning's precision plugins",
    ("stabmon/integrations/lightning.py", "scaler"): "torch: GradScaler's _scale (private)",
    ("stabmon/detect/spike.py", "self._mean"): "river: its statistics' internals (the fast path)",
    ("stabmon/detect/spike.py", "self._var"): "river: its statistics' internals (the fast path)",
    ("stabmon/detect/spike.py", "self._median"): "river: its statistics' internals (the fast path)",
    ("stabmon/detect/spike.py", "self._iqr"): "river: its statistics' internals (the fast path)",
    ("stabmon/detect/trends.py", "drift.PageHinkley()"): "river: PageHinkley's internals, version check",
    ("stabmon/detect/trends.py", "drift.PageHinkley()._x_mean"): "river: PageHinkley's internals, version check",
    ("stabmon/alerts/pagerduty.py", "NotifyPagerDuty"): "apprise: the plugin's template arguments",
    ("stabmon/store/batch.py", "value"): "a numpy or torch scalar",
    ("stabmon/store/batch.py", "stmt.excluded"): "SQLAlchemy: an upsert's excluded columns",
    ("stabmon/store/repo.py", "row"): "SQLAlchemy: a row's columns by name",
    ("stabmon/replay/importers/sniff.py", "mod"): "importer modules discovered by their members",
    ("stabmon/replay/importers/sniff.py", "m"): "importer modules discovered by their members",
    ("stabmon/environment.py", "fn"): "a probe function's name for the log",
    ("stabmon/__init__.py", "import_module(where[0])"): "the package's lazy attributes (PEP 562)",
    # reflection by field name over a dataclass or pydantic model of our own (its fields, not a capability)
    ("stabmon/alerts/config.py", "self"): "its own dataclass fields by name",
    ("stabmon/collect/signals/memory.py", "self"): "its own dataclass fields by name",
    ("stabmon/detect/base.py", "self"): "its own state attributes by name (state_dict)",
    ("stabmon/detect/scorer.py", "cls"): "a class's own methods by name",
    ("stabmon/diff.py", "self"): "its own dataclass fields by name",
    ("stabmon/replay/advice.py", "config"): "a detector config dataclass's fields by name",
    ("stabmon/replay/advice.py", "configs[firing.detector]"): "a detector config dataclass's field by name",
    ("stabmon/replay/advice.py", "configs[detector]"): "a detector config dataclass's field by name",
    ("stabmon/events.py", "event"): "an event dataclass's fields by name",
    ("stabmon/store/store.py", "self"): "its own settings by name (validation)",
    ("stabmon/interventions/_override.py", "overrides"): "the Overrides field an intervention names",
    ("stabmon/interventions/_state.py", "overrides"): "the Overrides fields an intervention names",
    ("stabmon/interventions/rollback.py", "overrides"): "the Overrides fields a rollback changed",
    ("stabmon/runbook/fit.py", "params"): "a rung's params model field by name",
}
"""Every ``getattr``/``hasattr`` in the package, by (file, the object probed), with why it is not a probe of one
of stabmon's own protocols. An optional capability of stabmon's own objects is a small runtime-checkable
Protocol (``sinks.ResumableSink``, ``pipeline.ProposingEngine``, ``checkpoints.CheckpointStore``, ...)."""


def probes(root: Path) -> set[tuple[str, str]]:
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and node.args:
                found.add((str(path.relative_to(root.parent)), ast.unparse(node.args[0])))
    return found


def test_no_probe_of_stabmons_own_objects_outside_the_allow_list() -> None:
    unknown = sorted(probes(PACKAGE) - set(PROBES_ALLOWED))
    assert unknown == [], ("getattr/hasattr on an object not in PROBES_ALLOWED (use a Protocol, or add it with "
                           "the reason): " + "; ".join(f"{f}: {o}" for f, o in unknown))


def test_the_probe_allow_list_has_no_stale_entries() -> None:
    assert sorted(set(PROBES_ALLOWED) - probes(PACKAGE)) == []


def test_the_probe_check_catches_a_probe_of_an_engine(tmp_path: Path) -> None:
    pkg = tmp_path / "stabmon"
    pkg.mkdir()
    (pkg / "flushing.py").write_text("def f(engine):\n    return getattr(engine, 'hold', None)\n")
    assert probes(pkg) == {("stabmon/flushing.py", "engine")}


def test_architecture_places_every_module() -> None:
    """docs/ARCHITECTURE.md's "Every module" table names each module of the package."""
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = text.split("## Every module", 1)[1]
    missing = [rel for rel in (str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")))
               if f"`{rel}`" not in table]
    assert missing == [], "modules docs/ARCHITECTURE.md does not place: " + ", ".join(missing)


def test_architecture_prose_places_every_module() -> None:
    """Every module is placed in the prose of the part it belongs to, not only in the index: by its path under
    ``stabmon/`` (a sub-package's ``__init__.py`` by its folder)."""
    prose = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8").split("## Every module", 1)[0]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        names = [rel, f"stabmon/{rel}"]
        if path.name == "__init__.py" and path.parent != PACKAGE:
            names.append(rel.removesuffix("__init__.py"))
        if not any(f"`{name}`" in prose for name in names):
            missing.append(rel)
    assert missing == [], "modules the prose of docs/ARCHITECTURE.md does not place: " + ", ".join(missing)


def test_how_to_add_names_files_and_names_that_exist() -> None:
    """The "How to add" section names real files, and each "`Name` in `file`" is defined in that file."""
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## How to add", 1)[1].split("\n## ", 1)[0]
    paths = set(re.findall(r"`((?:stabmon|tests)/[\w/]+\.py)`", section))
    assert len(paths) >= 12, paths
    assert [p for p in sorted(paths) if not (PACKAGE.parent / p).is_file()] == []
    for name, path in re.findall(r"`(\w+)` in `((?:stabmon|tests)/[\w/]+\.py)`", section):
        source = (PACKAGE.parent / path).read_text(encoding="utf-8")
        assert re.search(rf"^(class|def) {name}\b", source, re.M), f"{name} is not defined in {path}"
    for tuple_name in re.findall(r"`(\w*_DETECTORS)`", section) or ["_DETECTORS"]:
        assert "_DETECTORS" in (PACKAGE / "detect" / "suite.py").read_text(encoding="utf-8"), tuple_name


def test_architecture_has_a_side_paths_section() -> None:
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert "## Side paths" in text and "publish_from_thread" in text and "learn_host" in text


# -- no import cycles: every import in the package counted, deferred and type-checking ones too --
def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (at the top, inside a function, under
    ``TYPE_CHECKING``): a deferred import hides a cycle from Python, not from a reader."""
    paths = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(parent + ([node.module] if node.module else []))
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "stabmon.monitor" in graph and "stabmon.pipeline" in graph["stabmon.monitor"]
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles (each: the modules that import one another):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_rule_finds_deferred_and_type_checking_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / "stabmon"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stabmon.sub.b import X\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import Y\n")
    (pkg / "c.py").write_text("import stabmon.a\n")
    cycles = import_cycles(import_graph(pkg))
    assert cycles == [["stabmon.a", "stabmon.sub.b"]]


# -- the monitor is built in order: each collaborator gets what it needs when it is made, nothing patched after --
MUTATORS = {"update", "append", "extend", "add", "setdefault", "insert", "pop", "clear", "__setitem__"}


def patches(function: ast.FunctionDef) -> list[str]:
    """Every place ``function`` changes another object after it was made: an assignment to an attribute or item
    of anything but ``self`` (``self.target.diagnoser = ...``, ``self.flusher.joiners[k] = ...``) or a mutating
    call on another object's attribute (``self.flusher.joiners.update(...)``)."""
    found = []

    def foreign(node: ast.expr) -> bool:  # not self's own attribute (``self.x``): another object's
        if isinstance(node, ast.Attribute):
            return not (isinstance(node.value, ast.Name) and node.value.id == "self")
        return isinstance(node, ast.Subscript)

    for node in ast.walk(function):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                              else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        found += [f"line {node.lineno}: {ast.unparse(t)} = ..." for t in targets if foreign(t)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and foreign(owner):
                found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def _init_of(path: Path, cls: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")


def test_the_monitor_is_built_without_patching_its_collaborators() -> None:
    init = _init_of(PACKAGE / "monitor.py", "Monitor")
    assert len(init.body) > 20, "Monitor.__init__ not found where expected"
    assert patches(init) == [], "Monitor.__init__ changes objects after making them:\n" + "\n".join(patches(init))


@pytest.mark.parametrize("line", [
    "self.target.diagnoser = build()", "self.flusher.joiners[k] = f", "self.flusher.joiners.update(j)",
    "target.x, self.y = 1, 2", "self.a.b += 1",
])
def test_the_patch_rule_catches_patches(line: str) -> None:
    function = ast.parse(f"def __init__(self):\n    {line}\n").body[0]
    assert isinstance(function, ast.FunctionDef) and len(patches(function)) == 1


@pytest.mark.parametrize("line", ["self.target = Target(diagnoser=d)", "self.x: int = 1", "self.records.append(r)",
                                  "joiners = {**a, k: f}"])
def test_building_in_order_passes_the_patch_rule(line: str) -> None:
    function = ast.parse(f"def __init__(self):\n    {line}\n").body[0]
    assert isinstance(function, ast.FunctionDef) and patches(function) == []


# -- nothing in the package unpickles what it reads --
def unpickling(source: str, filename: str = "<source>") -> list[str]:
    """Calls that would run code from the data they read: ``pickle.load``/``loads`` (any module's ``Unpickler``)
    and ``torch.load(..., weights_only=False)``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if re.fullmatch(r"(c?pickle|dill|cloudpickle)\.(loads?|Unpickler)", name):
            found.append(f"{filename}:{node.lineno}: {name}")
        for kw in node.keywords:
            if kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                found.append(f"{filename}:{node.lineno}: {name}(weights_only=False)")
    return found


def test_nothing_in_the_package_unpickles_what_it_reads() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += unpickling(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "unpickling in the package:\n" + "\n".join(found)


@pytest.mark.parametrize("line", ["pickle.loads(b)", "pickle.load(f)", "torch.load(p, weights_only=False)",
                                  "cloudpickle.loads(b)"])
def test_the_unpickling_rule_catches_it(line: str) -> None:
    assert len(unpickling(line)) == 1
