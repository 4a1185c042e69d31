"""Load runbooks from YAML with errors that point at the file and line: ``FILE:LINE: field.path: message``.

The YAML is composed once to learn the line of every key and list item, then validated by the pydantic
:class:`~stabmon.runbook.schema.Runbook` model; each validation error's location is mapped back to the line it
came from. Hostile YAML (huge, deeply nested, alias bombs, bad UTF-8, duplicate keys) is refused first with
FILE:LINE errors (:mod:`stabmon.runbook.yamlsafe`). ``extends: NAME`` (a bundled runbook or a path, relative to
the file) starts from that runbook and merges the file over it; an ``include:`` file (an override file, e.g. written
by ``stabmon tune``) is then merged over the result. Mappings merge key by key, anything else is replaced; errors
point into the file a value came from. A tuned default, without copying it::

    extends: default
    include: tuned.yaml
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from stabmon.interventions import INTERVENTIONS
from stabmon.resources import runbooks_dir
from stabmon.runbook import yamlsafe
from stabmon.runbook.schema import Runbook

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class RunbookIssue:
    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


class RunbookError(ValueError):
    """A runbook failed to load; ``issues`` lists every problem, the message shows them one per line."""

    def __init__(self, issues: list[RunbookIssue]) -> None:
        issues = sorted(issues, key=lambda i: (i.file, i.line))
        super().__init__("\n".join(str(i) for i in issues))
        self.issues = issues


def bundled_runbooks() -> dict[str, Path]:
    """Names and paths of the runbooks shipped with stabmon."""
    return {p.stem: p for p in sorted(runbooks_dir().glob("*.yaml"))}


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """A bundled runbook's path by name, or the given file."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = bundled_runbooks()
    if str(name_or_path) in bundled:
        return bundled[str(name_or_path)]
    known = ", ".join(bundled) or "none"
    raise RunbookError([RunbookIssue(str(name_or_path), 0, "(file)",
                                     f"no such file and no bundled runbook of that name (bundled: {known})")])


def load_runbook(name_or_path: str | os.PathLike[str]) -> Runbook:
    """Load and validate a runbook by bundled name (``"opt175b"``) or path; raise :class:`RunbookError`.

    >>> load_runbook("opt175b").rule("instability").ladder[0].action
    'set_clip'
    """
    path = resolve(name_or_path)
    data, lines = _extended(path, ())
    if isinstance(data, Mapping) and isinstance(data.get("include"), str):
        inc = _include_path(path, data["include"], lines)
        inc_data, inc_lines = _compose(inc)
        if not isinstance(inc_data, Mapping):
            raise RunbookError([RunbookIssue(str(inc), 1, "(root)", "an include file must hold a mapping")])
        data = _merge(data, inc_data, (), lines, inc_lines)
    if isinstance(data, Mapping) and "name" not in data:
        data = {"name": path.stem, **data}
    try:
        return Runbook.model_validate(data)
    except ValidationError as exc:
        raise RunbookError([_issue(e, lines, str(path)) for e in exc.errors()]) from None


def loads_runbook(text: str, *, filename: str = "<string>") -> Runbook:
    """Validate runbook YAML given as text (errors name ``filename``)."""
    data, lines = _compose_text(text, filename)
    try:
        return Runbook.model_validate(data)
    except ValidationError as exc:
        raise RunbookError([_issue(e, lines, filename) for e in exc.errors()]) from None


MAX_EXTENDS = 8
"""How deep ``extends:`` may chain."""


def _extended(path: Path, chain: tuple[Path, ...]) -> tuple[Any, dict[Loc, tuple[str, int]]]:
    """The runbook file's data with what it ``extends:`` under it (its own name, or its file's stem, kept)."""
    data, lines = _compose(path)
    if not isinstance(data, Mapping) or "extends" not in data:
        return data, lines
    where = lines.get(("extends",), (str(path), 1))
    base_name = data["extends"]
    if not isinstance(base_name, str) or not base_name.strip():
        raise RunbookError([RunbookIssue(*where, "extends", "must name a bundled runbook or a runbook file")])
    local = Path(os.path.expandvars(base_name)).expanduser()
    local = local if local.is_absolute() else path.parent / local
    try:
        base = local if local.is_file() else resolve(base_name)
    except RunbookError:
        known = ", ".join(bundled_runbooks())
        raise RunbookError([RunbookIssue(*where, "extends", f"no runbook file and no bundled runbook named "
                                                             f"{base_name!r} (bundled: {known})")]) from None
    if base.resolve() in chain or base.resolve() == path.resolve() or len(chain) >= MAX_EXTENDS:
        raise RunbookError([RunbookIssue(*where, "extends", f"{base_name!r} extends itself (a cycle of extends)")])
    base_data, base_lines = _extended(base, (*chain, path.resolve()))
    if not isinstance(base_data, Mapping):
        raise RunbookError([RunbookIssue(str(base), 1, "(root)", "an extended runbook must hold a mapping")])
    own = {k: v for k, v in data.items() if k != "extends"}
    merged = _merge({k: v for k, v in base_data.items() if k != "name"}, own, (), base_lines, lines)
    merged.setdefault("name", path.stem)
    return merged, base_lines


def _include_path(path: Path, include: str, lines: dict[Loc, tuple[str, int]]) -> Path:
    inc = Path(os.path.expandvars(include)).expanduser()
    inc = inc if inc.is_absolute() else path.parent / inc
    if not inc.is_file():
        file, line = lines.get(("include",), (str(path), 1))
        raise RunbookError([RunbookIssue(file, line, "include", f"included file does not exist: {include}")])
    return inc


def _compose(path: Path) -> tuple[Any, dict[Loc, tuple[str, int]]]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(yamlsafe.MAX_BYTES + 1)
    except OSError as exc:
        raise RunbookError([RunbookIssue(str(path), 0, "(file)", str(exc))]) from None
    return _compose_bytes(raw, str(path))


def _compose_text(text: str, filename: str) -> tuple[Any, dict[Loc, tuple[str, int]]]:
    return _compose_bytes(text.encode("utf-8", "surrogateescape"), filename)


def _compose_bytes(raw: bytes, filename: str) -> tuple[Any, dict[Loc, tuple[str, int]]]:
    found = yamlsafe.problems(raw, filename)
    if found:
        raise RunbookError([RunbookIssue(*p) for p in found])
    text = raw.decode("utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 1
        raise RunbookError([RunbookIssue(filename, line, "(yaml)", str(exc.problem or exc))]) from None
    lines: dict[Loc, tuple[str, int]] = {(): (filename, 1)}
    if node is not None:
        _walk(node, (), lines, filename)
    return data, lines


def _walk(node: yaml.Node, loc: Loc, lines: dict[Loc, tuple[str, int]], filename: str) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = (*loc, key.value)
            lines[child] = (filename, key.start_mark.line + 1)
            _walk(value, child, lines, filename)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*loc, i)] = (filename, item.start_mark.line + 1)
            _walk(item, (*loc, i), lines, filename)


def _merge(base: Any, over: Any, loc: Loc, lines: dict[Loc, tuple[str, int]],
           over_lines: dict[Loc, tuple[str, int]]) -> Any:
    """``over`` merged over ``base`` (mappings key by key); ``lines`` learns where merged values came from."""
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base.get(k), v, (*loc, k), lines, over_lines)
        return out
    for key in [k for k in lines if k[: len(loc)] == loc and loc]:
        del lines[key]
    lines.update({k: v for k, v in over_lines.items() if k[: len(loc)] == loc and loc})
    return over


def _issue(error: Any, lines: dict[Loc, tuple[str, int]], filename: str) -> RunbookIssue:
    loc, message = _clean_loc(tuple(error["loc"])), str(error["msg"])
    if error["type"] == "union_tag_invalid":
        loc = (*loc, "action")
        tag = error.get("ctx", {}).get("tag")
        message = f"unknown intervention {tag!r} (known: {', '.join(sorted(INTERVENTIONS))})"
    elif message.startswith("Value error, "):
        message = message[len("Value error, "):]
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            file, line = lines[loc[:n]]
            break
    else:  # pragma: no cover - () is always present
        file, line = filename, 1
    return RunbookIssue(file, line, _dotted(loc) or "(root)", message)


def _clean_loc(loc: Loc) -> Loc:
    """Drop the discriminator tags pydantic inserts after a ladder index (``ladder.0.set_clip.params``)."""
    out: list[str | int] = []
    for i, part in enumerate(loc):
        if i >= 2 and loc[i - 2] == "ladder" and isinstance(loc[i - 1], int) and part in INTERVENTIONS:
            continue
        out.append(part)
    return tuple(out)


def _dotted(loc: Loc) -> str:
    s = ""
    for part in loc:
        s += f"[{part}]" if isinstance(part, int) else (f".{part}" if s else str(part))
    return s
