"""Real apprise delivery to a local HTTP receiver: json://, form://, Slack and PagerDuty payloads, hanging and
failing endpoints, retries recorded, secrets kept out of the database, logs and command output."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import pytest
from apprise.plugins import pagerduty as apprise_pagerduty
from apprise.plugins.slack import NotifySlack
from typer.testing import CliRunner

from stabmon.alerts import AlertsConfig, MemoryRecorder, Notifier, SqlRecorder, send_test
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


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def wait_until(condition: Any, limit: float = 20.0) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def fast(**kw: Any) -> AlertsConfig:
    base = dict(timeout=0.5, backoff_initial=0.02, backoff_max=0.1, max_attempts=8)
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


# -- real delivery ----
def test_json_and_form_delivery_to_local_receiver(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    n = Notifier(
        [f"json://{receiver.netloc}/json", f"form://{receiver.netloc}/form"], config=fast(), recorder=rec
    )
    n.handle(run_id="run1", run_name="tiny", events=incident())
    assert n.flush(10)
    n.close(5)
    by_path = {r["path"]: r for r in receiver.delivered()}
    j = json.loads(by_path["/json"]["body"])
    assert "scale_lr applied at step 120" in j["title"]
    for line in (
        "run: tiny (id run1)",
        "score=11.5 threshold=6",
        "120=8.75",
        "changed: lr 0.0006 → 0.0003",
        "stabmon trace run1",
    ):
        assert line in j["message"]
    form = parse_qs(by_path["/form"]["body"].decode())
    assert "changed: lr 0.0006 → 0.0003" in form["message"][0]
    assert sorted(r["status"] for r in rec.rows.values()) == ["sent", "sent"]
    assert {r["channel"] for r in rec.rows.values()} == {
        f"json://{receiver.netloc}/***",
        f"form://{receiver.netloc}/***",
    }


def test_proposal_carries_approve_and_reject_commands(receiver: Receiver) -> None:
    n = Notifier([f"json://{receiver.netloc}/p"], config=fast())
    n.handle(run_id="run2", run_name="tiny", events=incident(status=DecisionStatus.PROPOSED))
    assert n.flush(10)
    n.close(5)
    [msg] = receiver.json_bodies()
    assert "stabmon approve run2 d1" in msg["message"] and "stabmon reject run2 d1" in msg["message"]


def test_slack_payload_through_patched_webhook(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NotifySlack, "webhook_url", f"http://{receiver.netloc}/services")
    n = Notifier(["slack://" + "/".join(SLACK_TOKENS)], config=fast())
    n.handle(run_id="run3", run_name="tiny", events=[anomaly(50, "w1", Severity.WARNING)])
    n.handle(
        run_id="run3", run_name="tiny", events=[anomaly(51, "w2", Severity.WARNING)]
    )  # same alert: dedup
    assert n.flush(10)
    n.close(5)
    [req] = receiver.delivered()
    assert req["path"] == "/services/" + "/".join(SLACK_TOKENS)
    payload = json.loads(req["body"])
    text = json.dumps(payload)
    assert "spike in loss at step 50" in text and "50=8.75" in text and "stabmon trace run3" in text


def test_pagerduty_trigger_once_then_resolve(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    rec = MemoryRecorder()
    n = Notifier([f"pagerduty://{PD_ROUTING}@{PD_API}"], config=fast(), recorder=rec)
    n.handle(run_id="run4", run_name="tiny", events=[anomaly(100, "a0", Severity.WARNING)])  # below error
    n.handle(run_id="run4", run_name="tiny", events=incident())
    n.handle(run_id="run4", run_name="tiny", events=[anomaly(125, "a5"), anomaly(126, "a6")])  # repeats
    n.handle(run_id="run4", run_name="tiny", events=[resolved()])
    assert n.flush(10)
    n.close(5)
    trigger, resolve = receiver.json_bodies()
    assert trigger["event_action"] == "trigger" and resolve["event_action"] == "resolve"
    # the incident was first seen as a bare anomaly, so its key is that signal's, from first sight to resolve
    assert trigger["dedup_key"] == resolve["dedup_key"] == "stabmon-run4-spike:loss"
    assert trigger["routing_key"] == PD_ROUTING and trigger["payload"]["severity"] == "error"
    assert "changed: lr 0.0006 → 0.0003" in trigger["payload"]["summary"]
    assert all(r["path"] == "/v2/enqueue" for r in receiver.delivered())
    assert [r["dedup_key"] for r in rec.rows.values()] == ["stabmon-run4-spike:loss"] * 2
    assert n.stats["suppressed"]["pagerduty://***"]["dedup"] == 2


def test_pagerduty_stop_updates_the_same_incident(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    n = Notifier([f"pagerduty://{PD_ROUTING}@{PD_API}"], config=fast())
    n.handle(run_id="r", run_name="tiny", events=incident())
    stop = Decision(
        step=300,
        action="checkpoint_and_stop",
        params={},
        status=DecisionStatus.APPLY,
        runbook="opt175b",
        rule="loss_spike",
        rung=3,
        reason="ladder exhausted",
        anomaly_id="a1",
        incident_id="inc1",
        id="d3",
    )
    n.handle(run_id="r", run_name="tiny", events=[stop])
    assert n.flush(10)
    n.close(5)
    first, second = receiver.json_bodies()
    assert (
        first["dedup_key"] == second["dedup_key"]
    )  # same PagerDuty alert, updated to critical, not a new page
    assert second["payload"]["severity"] == "critical"


# -- never blocking, retries, nothing lost ----
def test_hanging_endpoint_never_holds_the_training_thread(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    receiver.hang = True
    n = Notifier([f"json://{receiver.netloc}/h"], config=fast(timeout=0.3), recorder=rec)
    n.handle(run_id="r", run_name="tiny", events=[anomaly(10, "x1", metric="m1")])
    assert receiver.entered.wait(10)  # the delivery thread is now stuck inside the endpoint
    # handle() returns although the endpoint cannot answer until release is set (below): it never waits.
    for i in range(2, 6):
        n.handle(run_id="r", run_name="tiny", events=[anomaly(10 + i, f"x{i}", metric=f"m{i}")])
    assert not receiver.release.is_set()
    assert n.counters["queued"] == 5
    assert wait_until(lambda: len(receiver.requests) >= 2)  # the first attempt timed out; a retry came
    with receiver.lock:
        receiver.hang = False
    receiver.release.set()
    assert n.flush(20)
    n.close(5)
    titles = [b["title"] for b in receiver.json_bodies()]
    assert sorted(t.split(" in ")[1].split(" at ")[0] for t in set(titles)) == [f"m{i}" for i in range(1, 6)]
    first = next(r for r in rec.rows.values() if r["title"].find(" m1 ") > 0)
    assert first["status"] == "sent" and first["attempts"] >= 2
    assert any(status == "retrying" and err for _, status, _, err in rec.history)


def test_500_endpoint_retries_with_backoff_and_loses_nothing(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    receiver.fail_next = 3
    n = Notifier([f"json://{receiver.netloc}/f"], config=fast(), recorder=rec)
    n.handle(run_id="r", run_name="tiny", events=[anomaly(1, "e1", metric="first")])
    n.handle(run_id="r", run_name="tiny", events=[anomaly(2, "e2", metric="second")])
    assert n.flush(20)
    n.close(5)
    assert [b["title"].split(" in ")[1].split(" at ")[0] for b in receiver.json_bodies()] == [
        "first",
        "second",
    ]
    rows = sorted(rec.rows.values(), key=lambda r: r["title"])
    assert [(r["status"], r["attempts"]) for r in rows] == [("sent", 4), ("sent", 1)]
    retries = [h for h in rec.history if h[1] == "retrying"]
    assert [h[2] for h in retries] == [1, 2, 3] and all("500" in h[3] for h in retries)
    assert n.counters["retries"] == 3


def test_gives_up_after_max_attempts_and_close_abandons_the_rest(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    receiver.fail_next = 1000
    n = Notifier([f"json://{receiver.netloc}/x"], config=fast(max_attempts=2), recorder=rec)
    n.handle(run_id="r", run_name="tiny", events=[anomaly(1, "e1", metric="a")])
    assert n.flush(10)
    assert [(r["status"], r["attempts"]) for r in rec.rows.values()] == [("failed", 2)]
    receiver.hang = True
    n.handle(run_id="r", run_name="tiny", events=[anomaly(2, "e2", metric="b"), anomaly(3, "e3", metric="c")])
    assert receiver.entered.wait(10)
    n.close(timeout=0.1)
    statuses = sorted(r["status"] for r in rec.rows.values())
    assert "abandoned" in statuses


def test_only_rank_zero_sends(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    n = Notifier([f"json://{receiver.netloc}/r"], config=fast())
    n.handle(run_id="r", run_name="tiny", events=incident())
    assert n.flush(5) and n.counters.get("queued", 0) == 0
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    n.handle(run_id="r", run_name="tiny", events=incident())
    assert n.flush(10)
    n.close(5)
    assert len(receiver.delivered()) == 1


def test_notifier_state_round_trip(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    url = f"pagerduty://{PD_ROUTING}@{PD_API}"
    n = Notifier([url], config=fast())
    n.handle(run_id="r", run_name="tiny", events=incident())
    assert n.flush(10)
    n.close(5)
    resumed = Notifier([url], config=fast())
    resumed.load_state_dict(n.state_dict())
    assert resumed.state_dict() == n.state_dict()
    resumed.handle(run_id="r", run_name="tiny", events=[anomaly(400, "z1")])  # same open incident: no page
    resumed.handle(run_id="r", run_name="tiny", events=[resolved(450)])
    assert resumed.flush(10)
    resumed.close(5)
    assert [b["event_action"] for b in receiver.json_bodies()] == ["trigger", "resolve"]


# -- secrets ----
def test_no_token_in_database_logs_or_command_output(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, sqlite_url: str
) -> None:
    import sqlalchemy as sa

    from stabmon.cli import app
    from stabmon.store.store import open_store

    monkeypatch.setattr(NotifySlack, "webhook_url", f"http://{receiver.netloc}/services")
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    store = open_store(sqlite_url)
    run_id = store.start_run(name="secret-test")
    assert store.flush(10)
    urls = [
        "slack://" + "/".join(SLACK_TOKENS),
        f"pagerduty://{PD_ROUTING}@{PD_API}",
        f"json://{receiver.netloc}/JsonPathSecret77",
    ]
    receiver.fail_next = 2  # failures put error text (from apprise and requests) into the rows and the logs
    caplog.set_level(logging.DEBUG)  # apprise logs URLs and payloads at DEBUG
    n = Notifier(urls, config=fast(), recorder=SqlRecorder(sqlite_url))
    n.handle(run_id=run_id, run_name="secret-test", events=incident())
    n.handle(run_id=run_id, run_name="secret-test", events=[resolved()])
    assert n.flush(20)
    n.close(5)
    store.close()
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("select * from alerts"))]
    engine.dispose()
    assert len(rows) == 6 and all(r["status"] == "sent" for r in rows)
    assert any(r["error"] is None and r["attempts"] > 1 for r in rows)  # a retried one, finally sent
    dump = json.dumps(rows, default=str) + caplog.text
    assert "slack://***" in dump and "pagerduty://***" in dump
    result = CliRunner().invoke(app, ["alert", "test", *urls])
    dump += result.output
    for secret in SECRETS:
        assert secret not in dump, secret


# -- stabmon alert test ----
def test_send_test_reports_each_channel(receiver: Receiver) -> None:
    receiver.fail_next = 1
    results = send_test(
        [f"json://{receiver.netloc}/a", f"json://{receiver.netloc}/b", "nosuch://x"], timeout=2
    )
    assert [(r.channel, r.ok) for r in results] == [
        (f"json://{receiver.netloc}/***", False),
        (f"json://{receiver.netloc}/***", True),
        ("nosuch://***", False),
    ]
    assert "500" in (results[0].error or "")


def test_alert_test_command_exit_codes(receiver: Receiver) -> None:
    from stabmon.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["alert", "test", f"json://{receiver.netloc}/ok"])
    assert ok.exit_code == 0, ok.output
    assert f"json://{receiver.netloc}/***: ok" in ok.output
    receiver.fail_next = 1
    bad = runner.invoke(
        app, ["alert", "test", "--json", f"form://{receiver.netloc}/bad", f"json://{receiver.netloc}/ok"]
    )
    assert bad.exit_code == 1
    lines = [json.loads(line) for line in bad.output.strip().splitlines()]
    assert [(x["channel"], x["ok"]) for x in lines] == [
        (f"form://{receiver.netloc}/***", False),
        (f"json://{receiver.netloc}/***", True),
    ]
