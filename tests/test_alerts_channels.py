"""Slack and PagerDuty payloads through their patched endpoints, secrets kept out of the database, logs
and command output, and ``stabmon alert test``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from apprise.plugins import pagerduty as apprise_pagerduty
from apprise.plugins.slack import NotifySlack
from test_alerts_support import (
    PD_API,
    PD_ROUTING,
    SECRETS,
    SLACK_TOKENS,
    Receiver,
    anomaly,
    fast,
    incident,
    resolved,
)
from typer.testing import CliRunner

from stabmon.alerts import ChannelConfig, MemoryRecorder, Notifier, send_test
from stabmon.events import Anomaly, Decision, DecisionStatus, Severity


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


# -- Slack and PagerDuty ----
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


@pytest.mark.parametrize("native", [True, False], ids=["apprise-plugin", "events-v2-fallback"])
def test_pagerduty_trigger_once_then_resolve(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    if not native:  # an apprise whose pagerduty plugin knows no dedup/action: stabmon posts Events v2 itself
        monkeypatch.setattr("stabmon.alerts.delivery.plugin_speaks_dedup", lambda: False)
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
    assert len(trigger["payload"]["summary"]) <= 1024
    assert all(r["path"] == "/v2/enqueue" for r in receiver.delivered())
    assert [r["dedup_key"] for r in rec.rows.values()] == ["stabmon-run4-spike:loss"] * 2
    assert n.stats["suppressed"]["pagerduty://***"]["dedup"] == 2


def test_pagerduty_summary_fits_events_v2(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    n = Notifier([f"pagerduty://{PD_ROUTING}@{PD_API}"], config=fast())
    long = Anomaly(kind="nonfinite", metric="loss", step=7, score=1.0, severity=Severity.CRITICAL,
                   detector="nan", message="x" * 3000, id="n1")
    n.handle(run_id="r", run_name="tiny", events=[long])
    assert n.flush(10)
    n.close(5)
    [body] = receiver.json_bodies()
    assert body["payload"]["summary"].startswith("[stabmon] CRITICAL: nonfinite in loss at step 7")
    assert len(body["payload"]["summary"]) <= 1024


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


# -- secrets ----
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    from stabmon.store.database import upgrade

    url = request.getfixturevalue("pg_url")
    upgrade(url)
    return url


def test_no_token_in_database_logs_or_command_output(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, db_url: str
) -> None:
    import sqlalchemy as sa

    from stabmon.alerts import make_notifier
    from stabmon.cli import app
    from stabmon.store.store import open_store

    monkeypatch.setattr(NotifySlack, "webhook_url", f"http://{receiver.netloc}/services")
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    store = open_store(db_url)
    run_id = store.start_run(name="secret-test")
    assert store.flush(10)
    urls = [
        "slack://" + "/".join(SLACK_TOKENS),
        f"pagerduty://{PD_ROUTING}@{PD_API}",
        f"json://{receiver.netloc}/JsonPathSecret77",
    ]
    receiver.fail_next = 2  # failures put error text (from apprise and requests) into the rows and the logs
    caplog.set_level(logging.DEBUG)  # apprise logs URLs and payloads at DEBUG
    # the way a Monitor builds it: channels from its alerts= argument, attempts recorded into its store
    n = make_notifier(fast(channels=[ChannelConfig.parse(u) for u in urls]), store=store)
    assert n is not None and n.recorder is store  # attempts go through the store's writer
    n.handle(run_id=run_id, run_name="secret-test", events=incident())
    n.handle(run_id=run_id, run_name="secret-test", events=[resolved()])
    assert n.flush(20)
    n.close(5)
    store.close()
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("select * from alerts"))]
    engine.dispose()
    assert len(rows) == 6 and all(r["status"] == "sent" for r in rows)
    assert any(r["error"] is None and r["attempts"] > 1 for r in rows)  # a retried one, finally sent
    dump = json.dumps(rows, default=str) + caplog.text
    assert "slack://***" in dump and "pagerduty://***" in dump
    runner = CliRunner()
    for args in (["alert", "test", *urls], ["trace", run_id, "--db", db_url], ["runs", "--db", db_url]):
        dump += runner.invoke(app, args).output  # what a person reads about the run
    for secret in SECRETS:
        assert secret not in dump, secret


# -- stabmon alert test ----
def test_send_test_reports_each_channel(receiver: Receiver) -> None:
    receiver.fail_next = 1
    results = send_test(
        [f"json://{receiver.netloc}/a", f"json://{receiver.netloc}/b", "nosuch://x"], timeout=5
    )
    assert [(r.channel, r.ok) for r in results] == [
        (f"json://{receiver.netloc}/***", False),
        (f"json://{receiver.netloc}/***", True),
        ("nosuch://***", False),
    ]
    assert "500" in (results[0].error or "")


def test_send_test_to_pagerduty_triggers_and_resolves(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    [r] = send_test([f"pagerduty://{PD_ROUTING}@{PD_API}"], timeout=5)
    assert (r.channel, r.ok, r.error) == ("pagerduty://***", True, None)
    trigger, resolve = receiver.json_bodies()
    assert (trigger["event_action"], resolve["event_action"]) == ("trigger", "resolve")
    assert trigger["dedup_key"] == resolve["dedup_key"]


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
