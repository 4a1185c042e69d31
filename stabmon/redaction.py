"""One place that decides what of a URL or a message may be shown or stored: :func:`hide_secrets`.

Database URLs keep their scheme, user, host, port and database, and lose any password (in the user part or in
the query: ``?password=``, ``?sslkey=``, ...). Alert channel URLs (apprise) are reduced by
:func:`stabmon.alerts.redact.redact` (their path is their token). Every fragment registered as secret (the
channel URLs in use) is masked wherever it appears. Used for the environment fingerprint, error messages, log
lines and CLI output.

>>> hide_secrets("postgresql+psycopg://ann:pw123@db:5432/runs?sslmode=require&password=s3cr3t")
'postgresql+psycopg://ann:***@db:5432/runs?sslmode=require&password=***'
>>> hide_secrets("alerts: slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7, pagerduty://k3y@ap1k3y")
'alerts: slack://***, pagerduty://***'
>>> hide_secrets("sqlite:////tmp/stabmon.db")
'sqlite:////tmp/stabmon.db'
"""

from __future__ import annotations

import re

from stabmon.alerts.redact import MASK, redact, scrub

DB_SCHEMES = frozenset({"sqlite", "postgresql", "postgres", "mysql", "mariadb", "oracle", "mssql", "cockroachdb"})
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\",;<>()\[\]{}]+")
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|key|auth|credential|sig", re.IGNORECASE)


def hide_url(url: str) -> str:
    """``url`` with its secrets hidden (see the module docstring)."""
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    return hide_db_url(url) if scheme in DB_SCHEMES else redact(url)


def hide_db_url(url: str) -> str:
    """A database URL (any scheme) without its password, in the user part or the query; otherwise unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, qsep, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}:{MASK}@{host}" if ":" in user else netloc
    query = "&".join(
        f"{k}={MASK}" if eq and _SECRET_KEY.search(k) else f"{k}{eq}{v}"
        for k, eq, v in (piece.partition("=") for piece in query.split("&"))
    )
    return f"{scheme}://{netloc}{slash}{path}{qsep}{query}"


def hide_db_secrets(text: str) -> str:
    """Like :func:`hide_secrets` for text about a database: every URL in it is read as a database URL."""
    if not text:
        return text
    return scrub(_URL.sub(lambda m: hide_db_url(m.group(0)), text))


def hide_secrets(text: str) -> str:
    """``text`` with every URL's secrets hidden and every registered secret fragment masked."""
    if not text:
        return text
    return scrub(_URL.sub(lambda m: hide_url(m.group(0)), text))
