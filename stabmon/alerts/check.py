"""``stabmon alert test``: send one test notification to each URL, synchronously, and say how each went.

For ``pagerduty://`` the test triggers an incident and resolves it at once under one ``dedup_key``.

>>> [r] = send_test(["json://127.0.0.1:9/hook"], timeout=0.5)  # nothing listens on port 9
>>> r.channel, r.ok
('json://127.0.0.1:9/***', False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import apprise

from stabmon.alerts.config import ChannelConfig
from stabmon.alerts.delivery import Channel
from stabmon.alerts.message import Alert
from stabmon.alerts.redact import redact, register_secrets, scrub
from stabmon.alerts.routing import RESOLVE, TRIGGER
from stabmon.events import Severity, new_id


@dataclass(frozen=True)
class TestResult:
    """One channel's answer: ``channel`` is the redacted URL; ``error`` is scrubbed of secrets."""

    channel: str
    ok: bool
    error: str | None = None

    __test__ = False  # not a pytest test class


def send_test(
    urls: Sequence[str],
    *,
    timeout: float = 10.0,
    message: str = "stabmon test notification: this channel receives stabmon alerts.",
) -> list[TestResult]:
    """Send ``message`` to every URL in turn (one attempt each, no retries); never raises."""
    results = []
    for i, url in enumerate(urls):
        register_secrets(url)
        try:
            channel = Channel(ChannelConfig.parse(url), timeout=timeout, path=f"urls[{i}]")
        except ValueError as exc:
            results.append(TestResult(redact(url), False, scrub(str(exc))))
            continue
        if channel.config.is_pagerduty:
            ok, error = _pagerduty_test(channel, message)
        else:
            ok, error = channel.send(title="stabmon: test", body=message, notify_type=apprise.NotifyType.INFO)
        results.append(TestResult(channel.name, ok, error))
    return results


def _pagerduty_test(channel: Channel, message: str) -> tuple[bool, str | None]:
    """Trigger a test incident and resolve it at once (same dedup key), so no incident is left open."""
    alert = Alert(
        run_id="test",
        run_name="stabmon alert test",
        kind="test",
        severity=Severity.INFO,
        incident_key=new_id(),
        fingerprint="test",
        step=None,
        title="stabmon: test",
        body=message,
    )
    ok, error = channel.send_alert(alert, TRIGGER)
    if not ok:
        return ok, error
    ok, error = channel.send_alert(dataclasses.replace(alert, resolves=True), RESOLVE)
    return ok, None if ok else f"triggered, but the resolve failed: {error}"
