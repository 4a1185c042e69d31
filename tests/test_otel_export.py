"""Live OTLP export (stabmon.integrations.otel): a real Monitor training a tiny model exports to an OTLP/HTTP
receiver started here on 127.0.0.1, whose requests are decoded as ``ExportMetricsServiceRequest``; a dead endpoint
costs a counted drop; a bad ``otlp=`` is one line naming the option; the fleet dashboard's JSON is linted."""

from __future__ import annotations

import http.server
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("opentelemetry.sdk.metrics")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.metric_exporter")
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest  # noqa: E402

from stabmon.collect.build import build_outbox  # noqa: E402
from stabmon.collect.failsafe import Failsafe  # noqa: E402
from stabmon.events import (  # noqa: E402
    Anomaly,
    Decision,
    DecisionStatus,
    InterventionRecord,
    Outcome,
    Severity,
    StepRecord,
    Verdict,
)
from stabmon.integrations.otel import OtlpConfig, OtlpExporter, config_of  # noqa: E402
from stabmon.monitor import Monitor, MonitorConfig  # noqa: E402
from stabmon.spec import MonitorSpec  # noqa: E402

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "stabmon-fleet.json"
ENV = ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED")


class Receiver:
    """An OTLP/HTTP metrics receiver on 127.0.0.1 (a free port): keeps every decoded request."""

    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.paths: list[str] = []
        received = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                received.requests.append(request)
                received.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def metrics(self) -> dict[str, list[tuple[Any, Any]]]:
        """Instrument name -> [(metric, resource attributes)] over every request received."""
        out: dict[str, list[tuple[Any, Any]]] = {}
        for request in self.requests:
            for rm in request.resource_metrics:
                resource = {a.key: _value(a.value) for a in rm.resource.attributes}
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out.setdefault(m.name, []).append((m, resource))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value"))


def _attrs(point: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in point.attributes}


def _points(m: Any) -> list[Any]:
    return list(getattr(m, m.WhichOneof("data")).data_points)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def _dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _train(steps: int, *, nan_at: int | None = None, **options: Any) -> Monitor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    options.setdefault("config", MonitorConfig(clip=1.0, flush_every=5))
    with Monitor(model, opt, store=None, run_name="otel-test", **options) as mon:
        for step, x in mon.steps([torch.randn(16, 4) for _ in range(steps)]):
            loss = model(x).pow(2).mean()
            if step == nan_at:
                loss = loss * float("nan")
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
    return mon


def test_a_live_run_exports_megatrons_instruments_with_the_run_on_every_point(
        receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)  # the standard variable, a base URL
    mon = _train(40, nan_at=30, runbook="default", mode="apply")
    exporter = mon.outbox.exporter
    assert isinstance(exporter, OtlpExporter) and exporter.url == receiver.url + "/v1/metrics"
    assert exporter.exports >= 2 and not exporter.drops and not mon.errors
    assert set(receiver.paths) == {"/v1/metrics"}
    got = receiver.metrics()

    expected = {  # name -> (OTLP data kind, unit): Megatron's types and units
        "stabmon.training.loss": ("gauge", ""),
        "stabmon.training.grad_norm": ("gauge", ""),
        "stabmon.training.learning_rate": ("gauge", ""),
        "stabmon.training.skipped_iters": ("sum", ""),
        "stabmon.training.step_duration_ms": ("histogram", "ms"),
        "stabmon.training.step": ("gauge", ""),
        "stabmon.anomalies": ("sum", ""),
        "stabmon.goodput": ("gauge", "1"),
        "stabmon.goodput.seconds": ("sum", "s"),
    }
    for name, (kind, unit) in expected.items():
        assert name in got, (name, sorted(got))
        m, resource = got[name][-1]
        assert (m.WhichOneof("data"), m.unit) == (kind, unit), name
        assert resource["service.name"] == "stabmon" and resource["stabmon.run.id"] == mon.run_id
        for p in _points(m):
            a = _attrs(p)
            assert (a["run.name"], a["run.id"], a["rank"]) == ("otel-test", mon.run_id, 0), name
    for name in ("stabmon.training.skipped_iters", "stabmon.anomalies", "stabmon.goodput.seconds"):
        m = got[name][-1][0]
        assert m.sum.is_monotonic and m.sum.aggregation_temporality == 2  # cumulative counters

    last = {n: got[n][-1][0] for n in got}
    assert _points(last["stabmon.training.step"])[0].as_int == 39  # the last flush's last step
    hist = _points(last["stabmon.training.step_duration_ms"])[0]
    assert hist.count == 40 and hist.sum > 0
    assert 0 < _points(last["stabmon.training.learning_rate"])[0].as_double <= 0.05  # a runbook may lower it
    anomalies = {(_attrs(p)["severity"], _attrs(p)["kind"]): p.as_int for p in _points(last["stabmon.anomalies"])}
    assert anomalies and all(n >= 1 for n in anomalies.values())
    assert any(severity in ("error", "critical") for severity, _ in anomalies)  # the NaN loss
    per_module = {_attrs(p)["module"] for p in _points(last["stabmon.layer.act_rms"])}
    assert per_module
    causes = {_attrs(p)["cause"] for p in _points(last["stabmon.goodput.seconds"])}
    assert "productive" in causes
    share = _points(last["stabmon.goodput"])[0].as_double
    assert 0 < share <= 1
    # the runbook answered the NaN loss: its decisions and changes are counted by action and status
    changes = {(_attrs(p)["action"], _attrs(p)["status"]) for p in _points(last["stabmon.interventions"])}
    assert changes and all(status in ("applied", "reverted", "failed", "not_applied") for _, status in changes)
    assert {_attrs(p)["status"] for p in _points(last["stabmon.decisions"])} <= {s.value for s in DecisionStatus}


def test_events_become_counters_by_severity_action_status_and_verdict(receiver: Receiver) -> None:
    exporter = OtlpExporter(OtlpConfig(endpoint=receiver.url, interval=0), rank=0, run_name="events")
    a = Anomaly("spike", "grad_norm", 3, 9.0, Severity.ERROR, "zscore", ((3, 9.0),))
    d = Decision(3, "scale_lr", {"factor": 0.5}, DecisionStatus.APPLY, "default", "grad_spike", 0, "r", a.id)
    applied = InterventionRecord(d.id, 4, "scale_lr", {"lr": 1e-3}, {"lr": 5e-4})
    failed = InterventionRecord(d.id, 4, "rollback", {}, {}, error="RuntimeError: boom")
    o = Outcome(applied.id, d.id, 20, Verdict.RESOLVED, {})
    exporter.events(run_id="r1", events=[a, a, d, applied, failed, o])
    exporter.steps(run_id="r1", records=[StepRecord(step=4, metrics={"skipped": 1.0, "step_time": 0.5,
                                                                      "checkpoint_time": 0.5})])
    exporter.close()
    last = {n: v[-1][0] for n, v in receiver.metrics().items()}

    def counts(name: str, *keys: str) -> dict[tuple[Any, ...], int]:
        return {tuple(_attrs(p)[k] for k in keys): int(p.as_int or p.as_double) for p in _points(last[name])}

    assert counts("stabmon.anomalies", "severity", "kind", "metric") == {("error", "spike", "grad_norm"): 2}
    assert counts("stabmon.decisions", "action", "status") == {("scale_lr", "apply"): 1}
    assert counts("stabmon.interventions", "action", "status") == {("scale_lr", "applied"): 1,
                                                                   ("rollback", "failed"): 1}
    assert counts("stabmon.outcomes", "verdict") == {("resolved",): 1}
    assert counts("stabmon.training.skipped_iters", "rank") == {(0,): 1}
    seconds = {_attrs(p)["cause"]: p.as_double for p in _points(last["stabmon.goodput.seconds"])}
    assert seconds == {"skipped_update": 0.5, "checkpoint": 0.5}
    assert _points(last["stabmon.goodput"])[0].as_double == 0.0


def test_a_dead_endpoint_costs_a_counted_drop_and_one_line(caplog: pytest.LogCaptureFixture) -> None:
    url = _dead_url()
    caplog.set_level(logging.WARNING)
    started = time.perf_counter()
    mon = _train(30, otlp=url)
    took = time.perf_counter() - started
    exporter = mon.outbox.exporter
    assert isinstance(exporter, OtlpExporter)
    assert mon.step == 30 and not mon.errors  # training completed; nothing failed in the monitor
    assert exporter.exports == 0 and exporter.drops["exports"] >= 1 and exporter.drops["points"] >= 1
    assert took < 10, took  # close() waits for no retry of a dead endpoint
    text = caplog.text
    assert "Traceback" not in text and not any(r.exc_info for r in caplog.records)
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and "OTLP" in r.getMessage()]
    assert len(failed) == 1 and url in failed[0] and "\n" not in failed[0]
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]  # the SDK's lines became ours


def test_per_rank_export_is_an_option(receiver: Receiver) -> None:
    failsafe = Failsafe()
    rank1 = build_outbox(MonitorSpec(store=None, otlp=receiver.url), rank=1, failsafe=failsafe, run_name="r")
    assert rank1.exporter is None  # the reduced metrics are exported once, by rank 0
    spec = MonitorSpec(store=None, otlp=OtlpConfig(endpoint=receiver.url, per_rank=True, interval=0))
    rank1 = build_outbox(spec, rank=1, failsafe=failsafe, run_name="r")
    assert isinstance(rank1.exporter, OtlpExporter)
    rank1.run_id = "run-7"
    rank1.write_steps([StepRecord(step=0, metrics={"loss": 1.5, "step_time": 0.2})])
    rank1.close("finished")
    m = receiver.metrics()["stabmon.training.loss"][-1][0]
    assert [(_attrs(p)["rank"], _attrs(p)["run.id"], p.as_double) for p in _points(m)] == [(1, "run-7", 1.5)]


def _ranked(rank: int, size: int, url: str, per_rank: bool) -> tuple[str, bool, int]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = MonitorConfig(flush_every=5, hang_timeout=None)
    otlp = OtlpConfig(endpoint=url, per_rank=per_rank, interval=0)
    gen = torch.Generator().manual_seed(rank)
    with Monitor(model, opt, store=None, mode="observe", run_name="ranks", config=config, otlp=otlp) as mon:
        for _, x in mon.steps([torch.randn(8, 4, generator=gen) for _ in range(10)]):
            loss = model(x).pow(2).mean()
            loss.backward()
            mon.observe(loss=loss)
            opt.step()
            opt.zero_grad()
    exporter = mon.outbox.exporter
    return mon.run_id, exporter is not None, exporter.exports if exporter is not None else 0


@pytest.mark.slow
@pytest.mark.parametrize("per_rank", [False, True])
def test_under_ddp_one_rank_exports_or_each_rank_under_its_own(receiver: Receiver, per_rank: bool) -> None:
    from dist_support import run_ranks

    results = run_ranks(_ranked, 2, receiver.url, per_rank, timeout=180)
    run_ids = {run_id for run_id, _, _ in results}
    assert len(run_ids) == 1  # every rank takes rank 0's run id
    (run_id,) = run_ids
    assert [has for _, has, _ in results] == [True, per_rank]
    assert all(exports >= 1 for _, has, exports in results if has)
    points = [_attrs(p) for m, _ in receiver.metrics()["stabmon.training.loss"] for p in _points(m)]
    ranks = [0, 1] if per_rank else [0]
    assert {(a["rank"], a["run.id"]) for a in points} == {(r, run_id) for r in ranks}


def test_the_option_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_of(None) is None  # no variable set: no export
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://collector:4318/custom")
    assert config_of(None).url == "http://collector:4318/custom"  # type: ignore[union-attr]
    assert config_of(False) is None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert config_of(None) is None
    assert config_of("https://otel.example/").url == "https://otel.example/v1/metrics"  # type: ignore[union-attr]
    assert build_outbox(MonitorSpec(store=None, otlp=False), rank=0, failsafe=Failsafe(), run_name="r").exporter \
        is None


@pytest.mark.parametrize(("value", "message"), [
    ("collector:4318", "otlp: expected None, True, False, an http(s):// URL or an OtlpConfig, got 'collector:4318'"),
    (4318, "otlp: expected None, True, False, an http(s):// URL or an OtlpConfig, got 4318"),
    (OtlpConfig(interval=-1), "otlp.interval: must be a number >= 0, got -1"),
    (OtlpConfig(timeout=0), "otlp.timeout: must be a number > 0, got 0"),
    (OtlpConfig(endpoint="ftp://x"), "otlp.endpoint: expected an http(s):// URL, got 'ftp://x'"),
    (OtlpConfig(queue=0), "otlp.queue: must be an int >= 1, got 0"),
])
def test_a_bad_option_is_one_line_naming_it(value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        MonitorSpec(store=None, otlp=value)
    assert str(info.value) == message


def test_without_the_sdk_one_warning_and_training_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    import builtins

    real_import = builtins.__import__

    def no_sdk(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", _dead_url())
    caplog.set_level(logging.WARNING)
    mon = _train(10)
    assert mon.outbox.exporter is None and mon.step == 10
    lines = [r.getMessage() for r in caplog.records if "OTLP" in r.getMessage()]
    assert len(lines) == 1 and "pip install 'stabmon[otel]'" in lines[0]


# -- the dashboard --

def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row's panels
    return out


def test_the_fleet_dashboard_is_a_grafana_dashboard_over_the_exported_names() -> None:
    dash = json.loads(DASHBOARD.read_text())
    for key in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert key in dash, key
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    run = variables["run"]
    assert run["type"] == "query" and run["multi"] and run["includeAll"] and "run_name" in json.dumps(run["query"])
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = []
    for p in panels:
        assert {"id", "type", "title", "gridPos"} <= set(p), p.get("title")
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"] and t["datasource"]["uid"] == "${datasource}"
            assert "$run" in t["expr"] or "${run" in t["expr"], (p["title"], t["expr"])
            exprs.append(t["expr"])
    for p in panels:
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
    annotations = [a for a in dash["annotations"]["list"] if not a.get("builtIn")]
    assert annotations and all(a["datasource"]["uid"] == "${datasource}" and a["expr"] for a in annotations)
    exprs += [a["expr"] for a in annotations]
    exprs += [v["query"]["query"] for v in variables.values() if v["type"] == "query"]
    used = {m.group(1) or m.group(2) for e in exprs for m in re.finditer(r"\$\{(\w+)[}:]|\$(\w+)", e)}
    builtin = {n for n in used if n.startswith("__")}
    assert used - builtin <= set(variables), used - builtin - set(variables)  # no undefined variable
    # the Prometheus names the OTLP receiver gives stabmon's instruments (dots -> underscores, units suffixed)
    text = "\n".join(exprs)
    for name in ("${prefix}_training_loss", "${prefix}_training_grad_norm", "${prefix}_training_learning_rate",
                 "${prefix}_training_skipped_iters_total", "${prefix}_training_step_duration_ms_milliseconds_bucket",
                 "stabmon_anomalies_total", "stabmon_interventions_total", "stabmon_goodput_ratio"):
        assert name in text, name
    assert {"stabmon", "megatron"} <= {o["value"] for o in variables["prefix"]["options"]}
