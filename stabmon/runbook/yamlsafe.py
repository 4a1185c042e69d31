"""Reading runbook YAML that may be hostile: bounded size, nesting and alias expansion, valid UTF-8, no
duplicate keys. Every refusal is a :class:`~stabmon.runbook.loader.RunbookIssue` with FILE:LINE.

>>> bomb = 'a: &a ["x","x","x","x","x","x","x","x","x","x"]\\n' + "".join(
...     f'{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\\n' for p, c in zip("abcdefgh", "bcdefghi"))
>>> problems(bomb.encode(), "bomb.yaml")[0]
('bomb.yaml', 2, '(yaml)', 'aliases expand to more than 100000 values (a billion-laughs document?)')
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 1 << 20
"""Largest runbook file read (a runbook is a page of YAML; an include file is smaller still)."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""
MAX_NODES = 100_000
"""Most values a document may hold once its aliases are expanded."""

Problem = tuple[str, int, str, str]  # file, line, path, message


def decode(raw: bytes, filename: str) -> tuple[str | None, list[Problem]]:
    """``raw`` as text, or the problems that stop it: too large, not UTF-8."""
    if len(raw) > MAX_BYTES:
        return None, [(filename, 1, "(file)", f"{len(raw)} bytes, more than the {MAX_BYTES} a runbook may hold")]
    try:
        return raw.decode("utf-8"), []
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return None, [(filename, line, "(file)", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})")]


def problems(raw: bytes, filename: str) -> list[Problem]:
    """Every reason ``raw`` must not be composed and constructed (see the module docstring)."""
    text, found = decode(raw, filename)
    if text is None:
        return found
    return _depth(text, filename) or _shape(text, filename)


def _depth(text: str, filename: str) -> list[Problem]:
    """Nesting depth from the parser's event stream (iterative: no recursion, however deep the input)."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    line = event.start_mark.line + 1 if event.start_mark else 1
                    return [(filename, line, "(yaml)", f"nested deeper than {MAX_DEPTH} levels")]
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.MarkedYAMLError:
        return []  # reported with its line by the loader's own parse
    return []


def _shape(text: str, filename: str) -> list[Problem]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError:
        return []
    if node is None:
        return []
    found: list[Problem] = []
    sizes: dict[int, int] = {}
    if _expanded(node, sizes, set()) > MAX_NODES:
        line = _first_alias_line(text)
        found.append((filename, line, "(yaml)",
                      f"aliases expand to more than {MAX_NODES} values (a billion-laughs document?)"))
        return found
    _duplicates(node, (), filename, found, set())
    return found


def _expanded(node: yaml.Node, sizes: dict[int, int], active: set[int]) -> int:
    """Values under ``node`` with aliases expanded (memoised on the node objects that aliases share)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in active:  # a recursive alias: infinite once expanded
        return MAX_NODES + 1
    active.add(key)
    total = 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            total += _expanded(k, sizes, active) + _expanded(v, sizes, active)
            if total > MAX_NODES:
                break
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            total += _expanded(item, sizes, active)
            if total > MAX_NODES:
                break
    active.discard(key)
    sizes[key] = total
    return total


def _first_alias_line(text: str) -> int:
    for token in yaml.scan(text, Loader=yaml.SafeLoader):
        if isinstance(token, yaml.AliasToken):
            return token.start_mark.line + 1
    return 1


def _duplicates(node: yaml.Node, loc: tuple[Any, ...], filename: str, found: list[Problem], seen: set[int]) -> None:
    if id(node) in seen:  # an aliased node is checked once
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[Any, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name is not None and name in first:
                path = ".".join(str(p) for p in (*loc, name))
                found.append((filename, line, path, f"duplicate key {name!r} (first at line {first[name]})"))
            elif name is not None:
                first[name] = line
            _duplicates(value, (*loc, name), filename, found, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _duplicates(item, (*loc, i), filename, found, seen)
