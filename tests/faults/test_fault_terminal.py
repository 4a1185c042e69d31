"""Names from the store reach the terminal as text, never as commands.

A run named ``evil<ESC>]0;owned<BEL><ESC>[31m…`` (or a metric so named in an imported log) was printed raw by
``stabmon runs``: it could retitle or recolour the terminal, clear it, or reorder what it showed (a
bidirectional override), and rich read ``[bold]`` in it as markup. Every CLI command now writes control
characters and bidirectional overrides out as escapes (``\\x1b``, ``\\u202e``) and shows brackets as they are.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

NAME = "evil\x1b]0;owned\x07\x1b[31mred\u202eabc[bold]x[/bold]\x1b[2J"
METRIC = "metric\x1b[2J\u202e"
RAW = ("\x1b", "\x07", "\u202e")


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    import stabmon
    from stabmon.collect.config import MonitorConfig

    url = f"sqlite:///{tmp_path_factory.mktemp('terminal') / 'runs.db'}"
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = stabmon.Monitor(model, opt, store=url, run_name=NAME, config=MonitorConfig(hang_timeout=None))
    with mon:
        for _, x in mon.steps([torch.randn(4, 2, generator=torch.Generator().manual_seed(i)) for i in range(10)]):
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss, **{METRIC: loss.detach()})
            opt.step()
            opt.zero_grad()
    return url


@pytest.mark.parametrize("command", [["runs"], ["metrics", "latest"], ["trace", "latest"], ["goodput", "latest"],
                                     ["events", "latest"], ["runs", "--json"], ["metrics", "nosuchrun"]])
def test_no_command_prints_a_control_character_from_a_name(db: str, command: list[str]) -> None:
    from stabmon.cli import app

    result = CliRunner().invoke(app, [*command, "--db", db])
    out = result.output
    assert not [c for c in RAW if c in out], f"stabmon {' '.join(command)} printed {out!r}"
    if command == ["runs"]:
        assert "evil\\x1b]0;owned\\x07\\x1b[31mred\\u202eabc[bold]x[/bold]" in out  # shown, escaped, brackets kept
    if command == ["metrics", "latest"]:
        assert "metric\\x1b[2J\\u202e" in out


def test_safe_escapes_every_control_and_keeps_text() -> None:
    from stabmon.cli._common import safe

    every = "".join(chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]) + "\u200e\u200f\u202a\u2066\u2069"
    out = safe(every, lines=False)
    assert all(ord(c) >= 0x20 and c.isprintable() for c in out), out
    assert safe("naïve – 東京 ok [x]") == "naïve – 東京 ok [x]"
