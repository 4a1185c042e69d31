"""Alert configuration, redaction, message composition and routing (no network)."""

from __future__ import annotations

import logging

import pytest

from stabmon.alerts import AlertsConfig, ChannelConfig, Composer, load_config, redact, resolve_config, scrub
from stabmon.alerts.redact import install_log_scrubber, register_secrets, secrets_of
from stabmon.alerts.routing import NOTIFY, RESOLVE, TRIGGER, Gate
from stabmon.events import (
    Anomaly,
    Decision,
    DecisionStatus,
    InterventionRecord,
    Outcome,
    Severity,
    Verdict,
)

SLACK = "slack://T0AAAAAAA/B0BBBBBBB/CcCcCcCcCcCcCcCcCcCcCcCc"
PD = "pagerduty://RoutingKey0123456789@ApiKeyAbcdef"


# -- redaction ----
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (SLACK, "slack://***"),
        (PD, "pagerduty://***"),
        ("discord://webhook_id/webhook_token", "discord://***"),
        ("json://127.0.0.1:8080", "json://127.0.0.1:8080"),
        ("json://127.0.0.1:8080/", "json://127.0.0.1:8080"),
        ("jsons://user:pw@hooks.example.com/path/tok?x=1", "jsons://hooks.example.com/***"),
        ("form://h.example.com?token=abc", "form://h.example.com/***"),
        ("not a url", "***"),
    ],
)
def test_redact_keeps_only_scheme_and_network_host(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_secrets_of_covers_every_token_part() -> None:
    s = secrets_of(PD)
    assert {"RoutingKey0123456789", "ApiKeyAbcdef"} <= s
    assert {"T0AAAAAAA", "B0BBBBBBB", "CcCcCcCcCcCcCcCcCcCcCcCc"} <= secrets_of(SLACK)
    assert "127.0.0.1:9000" not in secrets_of("json://127.0.0.1:9000/hook")


def test_scrub_masks_registered_fragments_but_not_substrings_of_words() -> None:
    register_secrets("json://127.0.0.1:9000/hookpath/Sekr3tT0ken")
    text = "POST http://127.0.0.1:9000/hookpath/Sekr3tT0ken failed; see hookpaths docs; id=Sekr3tT0ken"
    out = scrub(text)
    assert "Sekr3tT0ken" not in out
    assert "hookpaths docs" in out


def test_log_scrubber_masks_apprise_records(caplog: pytest.LogCaptureFixture) -> None:
    register_secrets(PD)
    install_log_scrubber()
    with caplog.at_level(logging.DEBUG, logger="apprise"):
        logging.getLogger("apprise").warning("payload %s", {"routing_key": "RoutingKey0123456789"})
    assert "RoutingKey0123456789" not in caplog.text
    assert "routing_key" in caplog.text


# -- configuration ----
def test_channel_defaults_route_pagerduty_to_error_and_others_to_warning() -> None:
    assert ChannelConfig.parse(PD).effective_min_severity() is Severity.ERROR
    assert ChannelConfig.parse(SLACK).effective_min_severity() is Severity.WARNING


def test_stabmon_query_parameters_are_lifted_and_removed() -> None:
    ch = ChannelConfig.parse(SLACK + "?stabmon_min_severity=critical&stabmon_events=stop,outcome&format=text")
    assert ch.min_severity == "critical"
    assert ch.events == ("stop", "outcome")
    assert "stabmon_" not in ch.url and "format=text" in ch.url


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"timeout": 0}, "alerts.timeout: must be > 0 (got 0)"),
        ({"max_attempts": 0}, "alerts.max_attempts: must be an integer >= 1 (got 0)"),
        ({"dedup_window": -1}, "alerts.dedup_window: must be >= 0 (got -1)"),
        ({"bogus": 1}, "alerts.bogus: unknown setting"),
        (
            {"channels": [{"url": SLACK, "min_severity": "loud"}]},
            "alerts.channels[0].min_severity: must be one of",
        ),
        (
            {"channels": [SLACK, {"url": PD, "events": ["page"]}]},
            "alerts.channels[1].events: must be a non-empty",
        ),
        ({"channels": [{"url": "nope"}]}, "alerts.channels[0].url: must be an apprise URL"),
        ({"channels": [{"url": SLACK, "colour": "red"}]}, "alerts.channels[0].colour: unknown setting"),
    ],
)
def test_invalid_config_names_the_dotted_field(data: dict, message: str) -> None:
    with pytest.raises(
        ValueError,
        match="^" + message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)"),
    ):
        AlertsConfig.from_mapping(data)


def test_yaml_and_toml_config_files(tmp_path) -> None:
    y = tmp_path / "alerts.yaml"
    y.write_text(
        f"alerts:\n  timeout: 3\n  channels:\n    - {SLACK}\n    - url: {PD}\n      events: [stop]\n"
    )
    cfg = load_config(y)
    assert cfg.timeout == 3 and cfg.channels[1].events == ("stop",) and cfg.channels[0].url == SLACK
    t = tmp_path / "alerts.toml"
    t.write_text(
        f'[alerts]\nmax_attempts = 2\n[[alerts.channels]]\nurl = "{PD}"\nmin_severity = "critical"\n'
    )
    cfg = load_config(t)
    assert cfg.max_attempts == 2 and cfg.channels[0].min_severity == "critical"


def test_sources_first_one_naming_channels_wins(tmp_path) -> None:
    f = tmp_path / "a.yml"
    f.write_text(f"timeout: 2\nchannels: [{PD}]\n")
    env = {"STABMON_ALERTS": f"{SLACK}, json://127.0.0.1:1/x", "STABMON_ALERTS_CONFIG": str(f)}
    assert [c.url for c in resolve_config(["form://127.0.0.1:2/y"], env=env).channels] == [
        "form://127.0.0.1:2/y"
    ]
    cfg = resolve_config(None, env=env)
    assert [c.url for c in cfg.channels] == [PD] and cfg.timeout == 2
    cfg = resolve_config(None, env={"STABMON_ALERTS": f"{SLACK}, json://127.0.0.1:1/x"})
    assert [c.url for c in cfg.channels] == [SLACK, "json://127.0.0.1:1/x"]
    assert resolve_config(None, env={}).channels == []


# -- composing ----
def _anomaly(step: int = 120, severity: Severity = Severity.ERROR, aid: str = "a1") -> Anomaly:
    return Anomaly(
        kind="spike",
        metric="loss",
        step=step,
        score=9.25,
        severity=severity,
        detector="zscore",
        evidence=tuple((s, 2.0 + 0.01 * s) for s in range(step - 11, step)) + ((step, 7.5),),
        threshold=6.0,
        id=aid,
    )


def _decision(
    status: DecisionStatus, *, action: str = "scale_lr", did: str = "d1", step: int = 120
) -> Decision:
    return Decision(
        step=step,
        action=action,
        params={"factor": 0.5},
        status=status,
        runbook="opt175b",
        rule="loss_spike",
        rung=1,
        reason="loss spike",
        anomaly_id="a1",
        incident_id="inc1",
        id=did,
    )


def test_decision_message_holds_anomaly_evidence_change_and_commands() -> None:
    c = Composer()
    events = [_anomaly(), _decision(DecisionStatus.PROPOSED)]
    [alert] = c.compose(run_id="run9", run_name="gpt-small", events=events)
    assert alert.kind == "proposal" and alert.severity is Severity.ERROR
    body = alert.body
    assert "run: gpt-small (id run9)" in body and "step: 120" in body
    assert "score=9.25 threshold=6" in body and "120=7.5" in body and "(last 8 of 12)" in body
    assert "stabmon approve run9 d1" in body and "stabmon reject run9 d1" in body
    assert "stabmon trace run9" in body
    rec = InterventionRecord(
        decision_id="d2", step=121, action="scale_lr", before={"lr": 3e-4}, after={"lr": 1.5e-4}, id="i1"
    )
    [applied] = c.compose(
        run_id="run9",
        run_name="gpt-small",
        events=[_decision(DecisionStatus.APPROVED, did="d2", step=121), rec],
    )
    assert applied.kind == "intervention" and "changed: lr 0.0003 → 0.00015" in applied.body
    assert "stabmon approve" not in applied.body


def test_a_rung_that_was_not_applicable_is_said_at_info_never_paged_as_applied() -> None:
    c = Composer()
    c.compose(run_id="r", run_name="n", events=[_anomaly(severity=Severity.ERROR)])
    rec = InterventionRecord(decision_id="d3", step=121, action="scale_layer_lr", before={}, after={},
                             not_applied="not applicable: no layer is flagged", id="i3")
    [alert] = c.compose(run_id="r", run_name="n",
                        events=[_decision(DecisionStatus.APPLY, action="scale_layer_lr", did="d3"), rec])
    assert alert.severity is Severity.INFO and "skipped (not applicable)" in alert.title
    assert "applied" not in alert.title.replace("not applicable", "")
    assert "not applicable: no layer is flagged" in alert.body


def test_incident_key_is_stable_from_bare_anomaly_to_resolution() -> None:
    c = Composer()
    [first] = c.compose(run_id="r", run_name="n", events=[_anomaly(aid="a1")])
    [dec] = c.compose(run_id="r", run_name="n", events=[_decision(DecisionStatus.APPLY)])
    [again] = c.compose(run_id="r", run_name="n", events=[_anomaly(step=130, aid="a9")])
    out = Outcome(
        intervention_id="i1",
        decision_id="d1",
        step=150,
        verdict=Verdict.RESOLVED,
        evidence={"loss_max": 2.4},
        incident_id="inc1",
    )
    [res] = c.compose(run_id="r", run_name="n", events=[out])
    assert first.dedup_key == dec.dedup_key == again.dedup_key == res.dedup_key
    assert res.resolves and "judged on: loss_max=2.4" in res.body
    [later] = c.compose(run_id="r", run_name="n", events=[_anomaly(step=900, aid="a10")])
    assert later.dedup_key == first.dedup_key  # same signal, but the old incident is closed in every gate


def test_composer_state_round_trip() -> None:
    c = Composer()
    c.compose(run_id="r", run_name="n", events=[_anomaly(aid="a1"), _decision(DecisionStatus.APPLY)])
    c2 = Composer()
    c2.load_state_dict(c.state_dict())
    assert c2.state_dict() == c.state_dict()
    [a] = c2.compose(run_id="r", run_name="n", events=[_anomaly(step=200, aid="a2")])
    assert a.incident_key == "inc1"


# -- routing ----
class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _alerts(kind_events):
    c = Composer()
    return [a for evs in kind_events for a in c.compose(run_id="r", run_name="n", events=evs)]


def test_pagerduty_gate_triggers_once_then_resolves() -> None:
    clock = FakeClock()
    gate = Gate(ChannelConfig.parse(PD), AlertsConfig(), clock)
    warn, page, repeat, resolved = _alerts(
        [
            [_anomaly(severity=Severity.WARNING, aid="a0")],
            [_anomaly(aid="a1"), _decision(DecisionStatus.APPLY)],
            [_anomaly(step=125, aid="a2")],
            [
                Outcome(
                    intervention_id=None,
                    decision_id="d1",
                    step=160,
                    verdict=Verdict.RESOLVED,
                    evidence={},
                    incident_id="inc1",
                )
            ],
        ]
    )
    assert gate.admit(warn) is None  # below the channel's severity
    assert gate.admit(page) == TRIGGER
    clock.t += 10_000  # far beyond the dedup window: still no re-page while the incident is open
    assert gate.admit(repeat) is None
    assert gate.admit(resolved) == RESOLVE
    assert gate.suppressed["dedup"] == 1 and gate.suppressed["filtered"] == 1


def test_resolution_only_reaches_channels_told_about_the_incident() -> None:
    gate = Gate(ChannelConfig.parse(PD), AlertsConfig(), FakeClock())
    [resolved] = _alerts(
        [
            [
                Outcome(
                    intervention_id=None,
                    decision_id="dx",
                    step=1,
                    verdict=Verdict.RESOLVED,
                    evidence={},
                    incident_id="other",
                )
            ]
        ]
    )
    assert gate.admit(resolved) is None


def test_slack_gate_dedups_within_window_and_rate_limits() -> None:
    clock = FakeClock()
    cfg = AlertsConfig(dedup_window=60, rate_per_minute=6, burst=2, incident_limit=100)
    gate = Gate(ChannelConfig.parse(SLACK), cfg, clock)
    same = _alerts([[_anomaly(severity=Severity.WARNING)]])[0]
    assert gate.admit(same) == NOTIFY
    assert gate.admit(same) is None
    clock.t += 61
    assert gate.admit(same) == NOTIFY  # window over: one reminder
    c = Composer()
    distinct = [
        c.compose(
            run_id="r",
            run_name="n",
            events=[
                Anomaly(
                    kind="spike",
                    metric=f"grad_norm/l{i}",
                    step=i,
                    score=1,
                    severity=Severity.WARNING,
                    detector="z",
                )
            ],
        )[0]
        for i in range(3)
    ]
    assert [gate.admit(a) for a in distinct] == [NOTIFY, None, None]  # bucket had 1 token left (burst 2)
    assert gate.suppressed["rate_limit"] == 2 and gate.take_held_back() == 2
    clock.t += 10  # 6/min -> one token per 10 s
    assert gate.admit(distinct[1]) == NOTIFY


def test_incident_limit_and_priority_alerts() -> None:
    cfg = AlertsConfig(incident_limit=1, dedup_window=0)
    gate = Gate(ChannelConfig.parse(SLACK), cfg, FakeClock())
    a1, a2 = _alerts([[_anomaly(aid="a1")], [_anomaly(step=130, aid="a2")]])
    assert gate.admit(a1) == NOTIFY and gate.admit(a2) is None
    [stop] = _alerts([[_anomaly(aid="a1"), _decision(DecisionStatus.APPLY, action="checkpoint_and_stop")]])
    assert stop.kind == "stop" and stop.priority and gate.admit(stop) == NOTIFY


def test_channel_events_filter() -> None:
    gate = Gate(ChannelConfig.parse(SLACK + "?stabmon_events=stop"), AlertsConfig(), FakeClock())
    [a] = _alerts([[_anomaly()]])
    assert gate.admit(a) is None


def test_gate_state_round_trip() -> None:
    clock = FakeClock()
    gate = Gate(ChannelConfig.parse(PD), AlertsConfig(), clock)
    [page] = _alerts([[_anomaly(aid="a1"), _decision(DecisionStatus.APPLY)]])
    assert gate.admit(page) == TRIGGER
    gate2 = Gate(ChannelConfig.parse(PD), AlertsConfig(), clock)
    gate2.load_state_dict(gate.state_dict())
    assert gate2.state_dict() == gate.state_dict()
    assert gate2.admit(page) is None  # a resumed run does not page again for the open incident


# -- notifier construction and robustness --------------------------------------------------------------
def test_make_notifier_reads_every_source(tmp_path) -> None:
    from stabmon.alerts import Notifier, make_notifier

    assert make_notifier(None, env={}) is None
    assert make_notifier([], env={}) is None
    n = make_notifier(None, env={"STABMON_ALERTS": SLACK})
    assert n is not None and [c.name for c in n.channels] == ["slack://***"]
    f = tmp_path / "alerts.toml"
    f.write_text(f'[alerts]\ntimeout = 4\n[[alerts.channels]]\nurl = "{PD}"\n')
    n = make_notifier(str(f), env={})
    assert n is not None and n.config.timeout == 4 and [c.name for c in n.channels] == ["pagerduty://***"]
    assert make_notifier(n) is n
    with pytest.raises(ValueError, match=r"^alerts\.channels\[0\]\.url: apprise cannot use nosuch://\*\*\*"):
        Notifier(["nosuch://abc/def"])


def test_handle_never_raises_into_training(caplog: pytest.LogCaptureFixture) -> None:
    from stabmon.alerts import Notifier

    n = Notifier(["json://127.0.0.1:9/x"])
    with caplog.at_level(logging.ERROR, logger="stabmon.alerts"):
        n.handle(run_id="r", run_name="n", events=[object()])  # type: ignore[list-item]
        bad = Decision(step=1, action="scale_lr", params=None, status=DecisionStatus.PROPOSED,  # type: ignore[arg-type]
                       runbook="x", rule="y", rung=1, reason="z")
        n.handle(run_id="r", run_name="n", events=[bad])
    assert n.counters["errors"] == 1 and "composing alerts" in caplog.text
    n.close(timeout=0.1)


def test_alert_only_decision_reads_as_an_anomaly_alert() -> None:
    a = _anomaly(severity=Severity.WARNING)
    d = Decision(step=120, action="alert_only", params={}, status=DecisionStatus.APPLY, runbook="default",
                 rule="other", rung=0, reason="tell people", anomaly_id="a1", incident_id="inc7", id="d7")
    rec = InterventionRecord(decision_id="d7", step=120, action="alert_only", before={}, after={})
    [alert] = Composer().compose(run_id="r", run_name="n", events=[a, d, rec])
    assert alert.kind == "anomaly" and alert.severity is Severity.WARNING
    assert alert.title == "[stabmon] WARNING: spike in loss at step 120 (n)"
    assert "rule other" in alert.body and "changed:" not in alert.body


def test_apprise_parameters_survive_untouched() -> None:
    from stabmon.alerts.delivery import Channel
    from stabmon.alerts.routing import RESOLVE

    ch = ChannelConfig.parse(PD + "?+team=ml%20ops&stabmon_min_severity=critical&region=eu")
    assert ch.url == PD + "?+team=ml%20ops&region=eu" and ch.min_severity == "critical"
    [alert] = _alerts([[_anomaly()]])
    url = Channel(ch, timeout=1).url_for(alert, RESOLVE)
    assert url.startswith(PD + "?+team=ml%20ops&region=eu&action=resolve&dedup=stabmon-r-spike%3Aloss")
    assert "severity=error" in url and "overflow=truncate" in url
    slack = ChannelConfig.parse(SLACK + "/#general?stabmon_events=stop")
    assert slack.url == SLACK + "/#general" and slack.events == ("stop",)


@pytest.mark.parametrize(("action", "severity"), [("release", Severity.INFO), ("reapply", Severity.WARNING)])
def test_giving_changes_back_is_news_not_a_page(action: str, severity: Severity) -> None:
    """A resolved incident's release returns the run to its recipe (info: no channel by default); a re-application
    after the trouble came back is a warning (Slack, never PagerDuty), with or without its record yet."""
    a = _anomaly(severity=Severity.ERROR)
    d = Decision(step=300, action=action, params={"intervention_ids": ["iv1"], "steps": 100}, runbook="default",
                 status=DecisionStatus.APPLY, rule="instability", rung=1, reason="resolved: release",
                 anomaly_id="a1", incident_id="inc7", id="d9")
    rec = InterventionRecord(decision_id="d9", step=300, action=action, before={"lr_scale": 0.5},
                             after={"lr_scale": 1.0})
    for events in ([a, d], [a, d, rec]):
        alerts = [x for x in Composer().compose(run_id="r", run_name="n", events=events) if x.kind == "intervention"]
        assert [x.severity for x in alerts] == [severity]
