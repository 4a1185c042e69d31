"""``stabmon alert test``: send one test notification to each URL, synchronously, and say how each went.

>>> [r] = send_test(["json://127.0.0.1:9/hook"], timeout=0.5)  # nothing listens on port 9
>>> r.channel, r.ok
('json://127.0.0.1:9/***', False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import apprise

from stabmon.alerts.config import ChannelConfig
from stabmon.alerts.delivery import Channel
from stabmon.alerts.redact import redact, register_secrets, scrub


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
        ok, error = channel.send(title="stabmon: test", body=message, notify_type=apprise.NotifyType.INFO)
        results.append(TestResult(channel.name, ok, error))
    return results
