"""Alerts through Slack, PagerDuty and any apprise URL, delivered on background threads.

>>> from stabmon.alerts import redact
>>> redact("slack://T000/B000/XXXXXXXX")
'slack://***'
"""

from __future__ import annotations

from stabmon.alerts.check import TestResult, send_test
from stabmon.alerts.config import ALERT_KINDS, AlertsConfig, ChannelConfig, load_config, resolve_config
from stabmon.alerts.message import Alert, Composer
from stabmon.alerts.notifier import Notifier, is_nonzero_rank, make_notifier
from stabmon.alerts.record import AlertRecorder, MemoryRecorder
from stabmon.alerts.redact import redact, scrub

__all__ = [
    "ALERT_KINDS",
    "Alert",
    "AlertRecorder",
    "AlertsConfig",
    "ChannelConfig",
    "Composer",
    "MemoryRecorder",
    "Notifier",
    "TestResult",
    "is_nonzero_rank",
    "load_config",
    "make_notifier",
    "redact",
    "resolve_config",
    "scrub",
    "send_test",
]
