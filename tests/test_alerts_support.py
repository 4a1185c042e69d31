"""Shared by the alert tests: a local HTTP receiver that can fail or hang, and event builders."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stabmon.alerts import AlertsConfig
from stabmon.events import Anomaly, Decision, DecisionStatus, InterventionRecord, Outcome, Severity, Verdict

SLACK_TOKENS = ("T0SECRETA", "B0SECRETB", "SlackSecretTokenC0123456")
PD_ROUTING, PD_API = "PdRoutingSecret0123456789", "PdApiSecretKey42"
SECRETS = (*SLACK_TOKENS, PD_ROUTING, PD_API, "JsonPathSecret77")


class Receiver:
    """A tiny threaded HTTP server that records requests; it can fail (500) or hang on demand."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next = 0
        self.hang = False
        self.release = threading.Event()
        self.entered = threading.Event()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    hang = receiver.hang
                    status = 200
                    if receiver.fail_next > 0 and not hang:
                        receiver.fail_next -= 1
                        status = 500
                    entry = {
                        "path": self.path,
                        "headers": dict(self.headers),
                        "body": body,
                        "status": "hung" if hang else status,
                    }
                    receiver.requests.append(entry)
                if hang:
                    receiver.entered.set()
                    receiver.release.wait(30)
                    entry["status"] = status  # answered at last (the client may have given up already)
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def netloc(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def delivered(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["status"] == 200]

    def json_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r["body"]) for r in self.delivered()]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def wait_until(condition: Any, limit: float = 20.0) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def fast(**kw: Any) -> AlertsConfig:
    base = dict(timeout=5.0, backoff_initial=0.02, backoff_max=0.1, max_attempts=8)
    base.update(kw)
    return AlertsConfig(**base)


def anomaly(step: int, aid: str, severity: Severity = Severity.ERROR, metric: str = "loss") -> Anomaly:
    return Anomaly(
        kind="spike",
        metric=metric,
        step=step,
        score=11.5,
        severity=severity,
        detector="zscore",
        evidence=((step - 2, 2.31), (step - 1, 2.29), (step, 8.75)),
        threshold=6.0,
        id=aid,
    )


def incident(step: int = 120, status: DecisionStatus = DecisionStatus.APPLY) -> list[Any]:
    a = anomaly(step, "a1")
    d = Decision(
        step=step,
        action="scale_lr",
        params={"factor": 0.5},
        status=status,
        runbook="opt175b",
        rule="loss_spike",
        rung=1,
        reason="loss jumped 3.8x",
        anomaly_id="a1",
        incident_id="inc1",
        id="d1",
    )
    events: list[Any] = [a, d]
    if status is not DecisionStatus.PROPOSED:
        events.append(
            InterventionRecord(
                decision_id="d1",
                step=step,
                action="scale_lr",
                before={"lr": 6e-4},
                after={"lr": 3e-4},
                id="i1",
            )
        )
    return events


def resolved(step: int = 180) -> Outcome:
    return Outcome(
        intervention_id="i1",
        decision_id="d1",
        step=step,
        verdict=Verdict.RESOLVED,
        evidence={"loss_max": 2.4},
        incident_id="inc1",
    )
