"""Alert configuration: channels (apprise URLs with routing), delivery and limits.

Channels come from, in order (the first source that names any channel wins): the ``urls`` given in code (the
Monitor's ``alerts=`` argument), the config file (``config_file=`` or ``$STABMON_ALERTS_CONFIG``), then
``$STABMON_ALERTS`` (URLs separated by commas or whitespace). Delivery settings always come from the config
file when there is one, else the defaults below.

Routing can be written into a URL with ``stabmon_``-prefixed query parameters, which are removed before
apprise sees the URL::

    slack://T000/B000/XXXX?stabmon_min_severity=error&stabmon_events=intervention,stop

>>> cfg = AlertsConfig(channels=[ChannelConfig.parse("pagerduty://rk@key")])
>>> cfg.channels[0].effective_min_severity().value
'error'
>>> ChannelConfig.parse("json://127.0.0.1/x?stabmon_min_severity=info").min_severity
'info'
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

from stabmon.events import Severity

SEVERITIES = tuple(s.value for s in Severity)
# What an alert is about; channels can subscribe to a subset with ``events``.
ALERT_KINDS = ("anomaly", "proposal", "decision", "intervention", "stop", "outcome", "test")
ENV_URLS = "STABMON_ALERTS"
ENV_CONFIG = "STABMON_ALERTS_CONFIG"
_PREFIX = "stabmon_"
_DEFAULT_MIN = {"pagerduty": Severity.ERROR}


def split_query(url: str) -> tuple[str, list[str]]:
    """``url`` before its first ``?``, and the raw ``key=value`` pieces after it (apprise's convention; pieces
    are kept raw so that apprise's own ``+key``/``-key`` parameters survive untouched)."""
    base, _, query = url.partition("?")
    return base, [p for p in query.split("&") if p]


def query_key(piece: str) -> str:
    return unquote_plus(piece.split("=", 1)[0])


def query_value(piece: str) -> str:
    return unquote_plus(piece.split("=", 1)[1]) if "=" in piece else ""


def join_query(base: str, pieces: Sequence[str]) -> str:
    return f"{base}?{'&'.join(pieces)}" if pieces else base


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


@dataclass
class ChannelConfig:
    """One destination.

    ``url``: the apprise URL (secrets included; never logged or stored, see :func:`stabmon.alerts.redact`).
    ``min_severity``: lowest severity sent here; default ``error`` for ``pagerduty://`` and ``warning``
    elsewhere, so PagerDuty pages for interventions, proposals awaiting a human and stops while Slack also
    hears warnings.
    ``events``: alert kinds sent here (subset of ``ALERT_KINDS``); default all.
    ``name``: label shown in the database and logs; default the redacted URL.

    >>> ChannelConfig(url="slack://a/b/c", events=("stop",)).validate("alerts.channels[0]")
    """

    url: str
    min_severity: str | None = None
    events: tuple[str, ...] | None = None
    name: str | None = None

    @classmethod
    def parse(cls, url: str, **overrides: Any) -> ChannelConfig:
        """Build from a URL, lifting ``stabmon_*`` query parameters into fields (explicit overrides win)."""
        base, pieces = split_query(url.strip())
        ours = {
            query_key(p)[len(_PREFIX) :]: query_value(p) for p in pieces if query_key(p).startswith(_PREFIX)
        }
        kept = [p for p in pieces if not query_key(p).startswith(_PREFIX)]
        clean = join_query(base, kept) if ours else url.strip()
        fields: dict[str, Any] = {"url": clean}
        if "min_severity" in ours:
            fields["min_severity"] = ours["min_severity"]
        if "events" in ours:
            fields["events"] = tuple(e for e in re.split(r"[,\s]+", ours["events"]) if e)
        if "name" in ours:
            fields["name"] = ours["name"]
        unknown = set(ours) - {"min_severity", "events", "name"}
        if unknown:
            raise ValueError(f"alerts.channels: unknown URL parameter {_PREFIX}{sorted(unknown)[0]}")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    @property
    def scheme(self) -> str:
        return scheme_of(self.url)

    @property
    def is_pagerduty(self) -> bool:
        return self.scheme == "pagerduty"

    def effective_min_severity(self) -> Severity:
        if self.min_severity is not None:
            return Severity(self.min_severity)
        return _DEFAULT_MIN.get(self.scheme, Severity.WARNING)

    def accepts(self, kind: str) -> bool:
        return self.events is None or kind in self.events

    def validate(self, path: str) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ValueError(
                f"{path}.url: must be an apprise URL like slack://... (got a value without '://')"
            )
        if self.min_severity is not None and self.min_severity not in SEVERITIES:
            raise ValueError(
                f"{path}.min_severity: must be one of {', '.join(SEVERITIES)} (got {self.min_severity!r})"
            )
        if self.events is not None:
            bad = [e for e in self.events if e not in ALERT_KINDS]
            if bad or not self.events:
                raise ValueError(
                    f"{path}.events: must be a non-empty subset of {', '.join(ALERT_KINDS)} (got {bad})"
                )


@dataclass
class AlertsConfig:
    """Delivery settings shared by all channels.

    ``timeout``: seconds per delivery attempt (connect and read).
    ``max_attempts``: attempts per alert before it is recorded as failed (retries back off exponentially:
    ``backoff_initial * 2**(attempt-1)``, capped at ``backoff_max``; the defaults cover about four minutes of
    outage).
    ``queue_size``: alerts waiting per channel; beyond it new alerts are dropped and counted (never blocks).
    ``dedup_window``: seconds within which the same alert for the same incident goes to a channel once.
    ``rate_per_minute`` / ``burst``: token bucket per channel. ``incident_limit``: most messages per incident
    per channel. Stops and resolutions are exempt from both limits: they must arrive.

    >>> AlertsConfig(timeout=0).validate()
    Traceback (most recent call last):
    ValueError: alerts.timeout: must be > 0 (got 0)
    """

    channels: list[ChannelConfig] = field(default_factory=list)
    timeout: float = 10.0
    max_attempts: int = 8
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    queue_size: int = 1000
    dedup_window: float = 900.0
    rate_per_minute: float = 20.0
    burst: int = 10
    incident_limit: int = 10

    def validate(self) -> AlertsConfig:
        for name in ("timeout", "backoff_initial", "backoff_max", "rate_per_minute"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"alerts.{name}: must be > 0 (got {value!r})")
        for name in ("max_attempts", "queue_size", "burst", "incident_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"alerts.{name}: must be an integer >= 1 (got {value!r})")
        if not isinstance(self.dedup_window, (int, float)) or self.dedup_window < 0:
            raise ValueError(f"alerts.dedup_window: must be >= 0 (got {self.dedup_window!r})")
        for i, ch in enumerate(self.channels):
            ch.validate(f"alerts.channels[{i}]")
        return self

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> AlertsConfig:
        """Build from a parsed YAML/TOML mapping (the ``alerts`` table, or the whole document)."""
        data = data.get("alerts", data)
        if not isinstance(data, Mapping):
            raise ValueError("alerts: must be a mapping")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"alerts.{unknown[0]}: unknown setting")
        kwargs = {k: v for k, v in data.items() if k != "channels"}
        channels = [
            _channel_from(item, f"alerts.channels[{i}]") for i, item in enumerate(data.get("channels") or [])
        ]
        return cls(channels=channels, **kwargs).validate()


def _channel_from(item: Any, path: str) -> ChannelConfig:
    if isinstance(item, str):
        return ChannelConfig.parse(item)
    if not isinstance(item, Mapping) or "url" not in item:
        raise ValueError(f"{path}: must be a URL or a mapping with 'url'")
    unknown = sorted(set(item) - {"url", "min_severity", "events", "name"})
    if unknown:
        raise ValueError(f"{path}.{unknown[0]}: unknown setting")
    events = item.get("events")
    if isinstance(events, str):
        events = tuple(e for e in re.split(r"[,\s]+", events) if e)
    elif events is not None:
        events = tuple(events)
    return ChannelConfig.parse(
        item["url"], min_severity=item.get("min_severity"), events=events, name=item.get("name")
    )


def load_config(path: str | os.PathLike[str]) -> AlertsConfig:
    """Read an alerts config file: ``.toml``, else YAML."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        data = tomllib.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text) or {}
    return AlertsConfig.from_mapping(data)


def split_urls(value: str) -> list[str]:
    """URLs from a ``$STABMON_ALERTS``-style string: separated by commas or whitespace."""
    return [u for u in re.split(r"[,\s]+", value) if u]


def resolve_config(
    urls: str | Iterable[str | ChannelConfig] | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> AlertsConfig:
    """Merge the three sources (see the module docstring) into one validated :class:`AlertsConfig`."""
    env = os.environ if env is None else env
    path = config_file or env.get(ENV_CONFIG) or None
    cfg = load_config(path) if path else AlertsConfig()
    explicit = _as_channels(split_urls(urls) if isinstance(urls, str) else list(urls or []))
    if explicit:
        cfg.channels = explicit
    elif not cfg.channels and env.get(ENV_URLS):
        cfg.channels = _as_channels(split_urls(env[ENV_URLS]))
    return cfg.validate()


def _as_channels(items: Sequence[str | ChannelConfig]) -> list[ChannelConfig]:
    return [c if isinstance(c, ChannelConfig) else ChannelConfig.parse(c) for c in items]
