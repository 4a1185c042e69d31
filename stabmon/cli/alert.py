"""``stabmon alert``: check alert channels."""

from __future__ import annotations

from typing import Annotated

import typer

from stabmon.cli._common import echo, print_json

alert_app = typer.Typer(help="Alert channels (Slack, PagerDuty, any apprise URL).", no_args_is_help=True)


@alert_app.command("test")
def alert_test(
    urls: Annotated[
        list[str], typer.Argument(help="Apprise URLs, e.g. slack://... pagerduty://... json://...")
    ],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each channel.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per channel.")] = False,
) -> None:
    """Send a test notification to each URL and report per channel; exit 1 if any failed.

    Channels are shown redacted (scheme and, for json/form/xml/http, host): tokens never appear in the output.
    """
    from stabmon.alerts import send_test

    results = send_test(urls, timeout=timeout)
    for r in results:
        if as_json:
            print_json({"channel": r.channel, "ok": r.ok, "error": r.error})
        else:
            echo(f"{r.channel}: ok" if r.ok else f"{r.channel}: error: {r.error}")
    if not all(r.ok for r in results):
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    app.add_typer(alert_app, name="alert")
