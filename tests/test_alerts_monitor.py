"""The notifier inside a real monitored training run: the tiny GPT with a silently corrupted weight (NaN from
step 100 on, by construction: every seed, every machine)."""

from __future__ import annotations

import importlib.util
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tiny_gpt() -> Any:
    spec = importlib.util.spec_from_file_location("tiny_gpt_for_alerts", REPO / "examples" / "tiny_gpt.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_monitored_corrupted_run_alerts_and_records_every_attempt(sqlite_url: str) -> None:
    import sqlalchemy as sa

    from stabmon.monitor import Monitor, MonitorConfig

    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    tiny = _tiny_gpt()
    config = tiny.TrainConfig(steps=150, fault="corrupt_weight", fault_step=100)
    url = f"json://127.0.0.1:{server.server_address[1]}/SecretHookPath123"

    def factory(model: Any, opt: Any, sched: Any) -> Monitor:
        # alerts= as a user writes it: the monitor builds the notifier and records attempts in its own store
        return Monitor(model, opt, scheduler=sched, store=sqlite_url, runbook="default", mode="apply",
                       config=MonitorConfig(clip=config.clip), alerts=[url], run_name="alerts-e2e")

    try:
        result = tiny.train(config, factory)
        notifier = result.monitor.notifier
        assert notifier is not None and notifier.flush(20)
        notifier.close(5)
    finally:
        server.shutdown()
        server.server_close()
    run_id = result.monitor.run_id
    assert bodies, "the corrupted run produced no alert"
    assert notifier.counters.get("sent", 0) == len(bodies)
    for body in bodies:
        assert "run: alerts-e2e (id " in body["message"] and f"stabmon trace {run_id}" in body["message"]
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("select * from alerts"))]
    engine.dispose()
    assert len(rows) == len(bodies) and {r["status"] for r in rows} == {"sent"}
    assert {r["run_id"] for r in rows} == {run_id}
    assert "SecretHookPath123" not in json.dumps(rows, default=str)
