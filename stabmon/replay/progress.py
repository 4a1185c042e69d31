"""rich progress bars for the offline commands, silent when output is JSON or stderr is not a terminal.

>>> with progress_bar("replay", total=3, enabled=False) as advance:
...     advance(3)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def wanted(json_output: bool) -> bool:
    """Bars only for humans: not under ``--json`` and only when stderr is a terminal."""
    return not json_output and sys.stderr.isatty()


@contextmanager
def progress_bar(description: str, *, total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; draws a rich bar on stderr when ``enabled``, else does nothing."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
