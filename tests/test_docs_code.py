"""Every Python block of README.md and docs/ is code a user can paste: it parses, every name it uses is imported or
defined in it (or named as the surrounding loop's in a ``# context:`` line), its imports import, every ``stabmon.X``
it reads exists; and the blocks marked runnable (```` ```python runnable ````) run.

A block is a fragment of the user's training script, so it may use the loop's own objects without defining them:
``model``, ``optimizer``, ``loader``, ``scaler`` and ``scheduler`` by default, or the names its first line lists
(``# context: model, opt, loader``). Anything else, a stabmon name above all, must be imported in the block: a
reader who copies it gets a script that imports.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LOOP = frozenset({"model", "optimizer", "loader", "scaler", "scheduler"})
"""What a block may take from the script around it without saying so."""
BLOCK = re.compile(r"^```(?:python|py)(?P<info>[^\n]*)\n(?P<code>.*?)^```", re.S | re.M)
CONTEXT = re.compile(r"^#\s*context:\s*(?P<names>[\w, ]+)$", re.M)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    code: str
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            found.append(Block(path, text[: m.start()].count("\n") + 1, m.group("code"),
                               "runnable" in m.group("info").split()))
    return found


ALL = blocks()


def free_names(tree: ast.Module) -> set[str]:
    """Names the block reads that it neither imports, defines nor binds (and that are no builtins)."""
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def stabmon_attributes(tree: ast.Module) -> set[str]:
    """``X`` of every ``stabmon.X`` the block reads (``stabmon`` imported as itself)."""
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "stabmon"}


def test_the_docs_have_python_blocks_and_some_are_runnable() -> None:
    assert len(ALL) >= 15
    assert sum(b.runnable for b in ALL) >= 2


@pytest.mark.parametrize("block", ALL, ids=[b.where for b in ALL])
def test_block_parses_and_names_what_it_uses(block: Block) -> None:
    try:
        tree = ast.parse(block.code)
    except SyntaxError as exc:
        pytest.fail(f"{block.where}: does not parse: {exc.msg} (block line {exc.lineno})")
    declared = CONTEXT.search(block.code)
    context = {n.strip() for n in declared.group("names").split(",")} if declared else LOOP
    unknown = sorted(free_names(tree) - context)
    assert unknown == [], f"{block.where}: uses {', '.join(unknown)} without importing or defining it"


@pytest.mark.parametrize("block", ALL, ids=[b.where for b in ALL])
def test_block_imports_import(block: Block) -> None:
    tree = ast.parse(block.code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a sub-module
    if any(isinstance(n, ast.Import) and any(a.name == "stabmon" for a in n.names) for n in ast.walk(tree)):
        import stabmon

        missing = sorted(a for a in stabmon_attributes(tree) if not hasattr(stabmon, a))
        assert missing == [], f"{block.where}: stabmon has no {', '.join(missing)}"


@pytest.mark.parametrize("block", [b for b in ALL if b.runnable], ids=[b.where for b in ALL if b.runnable])
def test_runnable_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stderr[-3000:]}"


def test_the_name_check_catches_a_missing_import() -> None:
    tree = ast.parse("monitor = stabmon.Monitor(model, opt, config=MonitorConfig(hang=HangConfig()))\n")
    assert free_names(tree) - LOOP == {"stabmon", "opt", "MonitorConfig", "HangConfig"}


def test_the_documented_names_import_from_stabmon() -> None:
    """The names the README and docs/distributed.md use, from the top-level package (a fresh process: no
    sub-module imported before)."""
    code = ("import stabmon; stabmon.HangConfig; stabmon.AttentionConfig; stabmon.HANG_EXIT_CODE; "
            "stabmon.MonitorConfig; stabmon.Monitor; import sys; "
            "assert 'torch' not in sys.modules or 'stabmon.monitor' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
