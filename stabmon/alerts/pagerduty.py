"""PagerDuty Events v2 when the installed apprise plugin cannot carry a ``dedup_key`` or a ``resolve``.

Recent apprise (``pagerduty://`` with ``action=`` and ``dedup=`` parameters) does everything stabmon needs,
and stabmon uses it when it can. Older releases always send ``trigger`` without a ``dedup_key``, which would
page again on every alert and could never resolve; with those, stabmon posts the Events v2 body itself, to the
same endpoint the plugin would use (``apprise.plugins.pagerduty.PAGERDUTY_API_LOOKUP``), with the same URL.

>>> isinstance(plugin_speaks_dedup(), bool)
True
"""

from __future__ import annotations

from typing import Any

from stabmon.alerts.message import Alert
from stabmon.alerts.redact import scrub

SUMMARY_MAX = 1024  # Events v2 limit on payload.summary
_OK = (200, 201, 202)


def plugin_speaks_dedup() -> bool:
    """Whether apprise's PagerDuty plugin accepts ``action=`` and ``dedup=`` URL parameters."""
    from apprise.plugins.pagerduty import NotifyPagerDuty

    return {"action", "dedup"} <= set(getattr(NotifyPagerDuty, "template_args", {}))


def events_v2_body(parsed: dict[str, Any], alert: Alert, action: str) -> dict[str, Any]:
    """The Events v2 request body for ``alert`` (``action``: ``trigger`` or ``resolve``)."""
    body: dict[str, Any] = {
        "routing_key": parsed["integrationkey"],
        "event_action": action,
        "dedup_key": alert.dedup_key,
    }
    if action == "trigger":
        body["client"] = "stabmon"
        body["payload"] = {
            "summary": f"{alert.title}\n{alert.body}"[:SUMMARY_MAX],
            "severity": parsed.get("severity") or alert.severity.value,
            "source": parsed.get("source") or "stabmon",
            "component": parsed.get("component") or alert.run_name,
            "custom_details": {
                "run": alert.run_name,
                "run_id": alert.run_id,
                "step": alert.step,
                "incident": alert.incident_key,
                "kind": alert.kind,
            },
        }
    return body


def send_events_v2(url: str, *, alert: Alert, action: str, timeout: float) -> tuple[bool, str | None]:
    """POST one Events v2 event for the ``pagerduty://`` URL; (delivered, scrubbed error)."""
    import requests
    from apprise.plugins import pagerduty as pd

    parsed = pd.NotifyPagerDuty.parse_url(url)
    if not parsed or not parsed.get("integrationkey") or not parsed.get("apikey"):
        return False, "the pagerduty:// URL lacks a routing key or an API key"
    region = str(parsed.get("region_name") or "us").lower()
    endpoint = pd.PAGERDUTY_API_LOOKUP.get(region)
    if endpoint is None:
        return False, f"unknown PagerDuty region {region!r}"
    try:
        r = requests.post(
            endpoint,
            json=events_v2_body(parsed, alert, action),
            timeout=(timeout, timeout),
            headers={"Authorization": f"Token token={parsed['apikey']}"},
        )
    except requests.RequestException as exc:
        return False, scrub(f"{type(exc).__name__}: {exc}")
    if r.status_code in _OK:
        return True, None
    return False, scrub(f"PagerDuty Events v2 answered HTTP {r.status_code}: {r.text[:200]}")
