"""Keeping channel secrets out of the database, the logs and every report.

Apprise URLs carry their credentials inline (``slack://TokenA/TokenB/TokenC``, ``pagerduty://key@apikey``).
The one function :func:`redact` turns a URL into what may be shown anywhere: the scheme, plus the host for the
few schemes whose host is a real network address (``json://``, ``form://``, ``xml://``, ``http(s)://``);
everything else becomes ``***``. :func:`scrub` removes the secret parts of every registered URL from free text
(error messages, apprise's own log records), and :func:`install_log_scrubber` attaches a filter that does so
to apprise's logger.

>>> redact("slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7")
'slack://***'
>>> redact("pagerduty://routingkey@apikey/source")
'pagerduty://***'
>>> redact("json://user:pass@127.0.0.1:8080/hook/s3cret")
'json://127.0.0.1:8080/***'
>>> register_secrets("slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7")
>>> scrub("POST https://hooks.slack.com/services/T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7 failed")
'POST https://hooks.slack.com/services/*** failed'
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import unquote, unquote_plus, urlsplit

# Schemes whose host part is a network address rather than a token.
HOST_SCHEMES = frozenset({"json", "jsons", "form", "forms", "xml", "xmls", "http", "https"})
MASK = "***"
_MIN_SECRET_LEN = 4  # shorter fragments ("a", "us") are not worth masking everywhere they occur
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

_lock = threading.Lock()
_secrets: set[str] = set()
_pattern: re.Pattern[str] | None = None


def redact(url: str) -> str:
    """The form of a channel URL that may be shown anywhere: ``scheme://***`` or ``scheme://host[:port]/***``."""
    m = _SCHEME.match(url.strip())
    if m is None:
        return MASK
    scheme = m.group(1).lower()
    if scheme not in HOST_SCHEMES:
        return f"{scheme}://{MASK}"
    rest = url.strip()[m.end() :]
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    host = netloc.rsplit("@", 1)[-1]
    tail = (
        f"/{MASK}"
        if (len(rest) > len(netloc) and rest[len(netloc) :] not in ("", "/")) or "@" in netloc
        else ""
    )
    return f"{scheme}://{host}{tail}"


def secrets_of(url: str) -> set[str]:
    """The fragments of ``url`` never to be shown: credentials, token hosts, path segments, query values."""
    url = url.strip()
    m = _SCHEME.match(url)
    found: set[str] = {url}
    if m is None:
        return found
    scheme = m.group(1).lower()
    rest = url[m.end() :]
    found.add(rest)
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, _, hostport = netloc.rpartition("@")
    if userinfo:
        found.update(userinfo.split(":", 1))
        found.add(userinfo)
    if scheme not in HOST_SCHEMES:
        found.add(hostport)
        found.add(hostport.split(":", 1)[0])
    found.update(seg for seg in parts.path.split("/") if seg)
    for piece in url.partition("?")[2].split("&"):
        if "=" in piece:
            found.add(piece.split("=", 1)[1])  # raw; the decoded form is added below
    found.update({unquote(s) for s in found} | {unquote_plus(s) for s in found})
    return {s for s in found if len(s) >= _MIN_SECRET_LEN}


def register_secrets(url: str) -> None:
    """Remember the secret fragments of ``url`` so that :func:`scrub` masks them from now on."""
    global _pattern
    new = secrets_of(url)
    with _lock:
        if new <= _secrets:
            return
        _secrets.update(new)
        ordered = sorted(_secrets, key=len, reverse=True)  # longest first: a whole URL before its parts
        # whole fragments only: a secret "hook" must not mask the middle of "hooks.example.com"
        alternatives = "|".join(re.escape(s) for s in ordered)
        _pattern = re.compile(rf"(?<![A-Za-z0-9])(?:{alternatives})(?![A-Za-z0-9])")


def scrub(text: str) -> str:
    """``text`` with every registered secret fragment replaced by ``***``."""
    pattern = _pattern
    if pattern is None or not text:
        return text
    return pattern.sub(MASK, text)


class ScrubFilter(logging.Filter):
    """A logging filter that masks registered secrets in a record's formatted message.

    >>> rec = logging.LogRecord("apprise", logging.WARNING, __file__, 1, "sent to %s", ("x",), None)
    >>> ScrubFilter().filter(rec)
    True
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is left to logging's own error path
            return True
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


_FILTER = ScrubFilter()
# Loggers that may see channel URLs or payloads: apprise, and the HTTP stack under it (urllib3 logs request
# paths at DEBUG, and a Slack webhook's path is its token). Logger filters apply to the records it creates.
SCRUBBED_LOGGERS = (
    "apprise",
    "stabmon.alerts",
    "urllib3",
    "urllib3.connectionpool",
    "urllib3.connection",
    "urllib3.poolmanager",
    "urllib3.response",
    "urllib3.util.retry",
    "requests",
)


QUIET_LEVEL = logging.INFO
"""The lowest level apprise's logger is left at: its DEBUG records show each URL with the first and last
character of every token (``slack://T...D/B...H/a...x``), fragments no scrubber can recognise."""


def install_log_scrubber() -> None:
    """Attach the scrubbing filter to the loggers in ``SCRUBBED_LOGGERS`` and keep apprise's logger at
    :data:`QUIET_LEVEL` or above, even under a root logger at DEBUG (idempotent)."""
    for name in SCRUBBED_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    apprise_log = logging.getLogger("apprise")
    if apprise_log.getEffectiveLevel() < QUIET_LEVEL:
        apprise_log.setLevel(QUIET_LEVEL)
