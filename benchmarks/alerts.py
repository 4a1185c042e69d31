"""Training-step cost of alerting at a bad endpoint, as median step-time ratios (one run, no assertions).

    python benchmarks/alerts.py [--blocks 12] [--block-steps 25]

The tiny GPT of ``examples/tiny_gpt.py`` (a small MLP when the example cannot be imported) trains while a
Notifier is handed an anomaly + decision + intervention on EVERY step (deduplication and rate limits
switched off, so each step queues a real alert). Three arms run interleaved in blocks, so drift in machine
load hits all of them alike:

* ``none``: a Notifier with no channel (what training costs without alerting);
* ``hang``: one json:// channel whose endpoint accepts the connection and never answers (30 s timeout), so the
  delivery thread is blocked for the whole run and the queue fills up (then alerts are dropped and counted);
* ``500``: one json:// channel that answers HTTP 500 at once; retries back off from 0.1 s to at most 1 s, so
  the delivery thread keeps retrying all run long.

Printed: per arm the median step time (training step + ``handle()``) and the median time ``handle()`` itself
took on the training thread; then the ratios hang/none and 500/none (1.00 = no effect).
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


class _Fail(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def hanging_endpoint() -> tuple[socket.socket, int, list[socket.socket]]:
    """A listening socket that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return srv, srv.getsockname()[1], held


def make_step() -> tuple[str, Any]:
    """One training step of the tiny GPT example (or an MLP), as a closure."""
    import torch

    path = REPO / "examples" / "tiny_gpt.py"
    try:
        spec = importlib.util.spec_from_file_location("tiny_gpt", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["tiny_gpt"] = mod
        spec.loader.exec_module(mod)
        model, opt, sched, batches = mod.build(mod.TrainConfig(steps=100_000))
        it = iter(batches)

        def gpt_step() -> None:
            x, y = next(it)
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

        return "tiny GPT (examples/tiny_gpt.py)", gpt_step
    except Exception as exc:  # noqa: BLE001 - fall back to an MLP
        print(f"(tiny GPT unavailable: {type(exc).__name__}: {exc}; using an MLP)")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    adam = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    x = torch.randn(64, 256)

    def mlp_step() -> None:
        loss = mlp(x).pow(2).mean()
        loss.backward()
        adam.step()
        adam.zero_grad(set_to_none=True)

    return "MLP 256-512-256", mlp_step


def events_for(step: int) -> list[Any]:
    from stabmon.events import Anomaly, Decision, DecisionStatus, InterventionRecord, Severity

    aid, did = f"a{step}", f"d{step}"
    return [
        Anomaly(
            kind="spike",
            metric="grad_norm",
            step=step,
            score=12.0,
            severity=Severity.ERROR,
            detector="zscore",
            evidence=tuple((step - i, 1.0 + i) for i in range(16)),
            threshold=6.0,
            id=aid,
        ),
        Decision(
            step=step,
            action="scale_lr",
            params={"factor": 0.5},
            status=DecisionStatus.APPLY,
            runbook="default",
            rule="grad_spike",
            rung=1,
            reason="bench",
            anomaly_id=aid,
            incident_id=f"inc{step}",
            id=did,
        ),
        InterventionRecord(
            decision_id=did, step=step, action="scale_lr", before={"lr": 1e-3}, after={"lr": 5e-4}
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=12, help="blocks per arm")
    p.add_argument("--block-steps", type=int, default=25, help="steps per block")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from stabmon.alerts import AlertsConfig, Notifier

    unlimited = dict(dedup_window=0, rate_per_minute=1e9, burst=10**6, incident_limit=10**9)
    srv, hang_port, held = hanging_endpoint()
    fail = ThreadingHTTPServer(("127.0.0.1", 0), _Fail)
    fail.daemon_threads = True
    threading.Thread(target=fail.serve_forever, args=(0.05,), daemon=True).start()
    arms = {
        "none": Notifier([], config=AlertsConfig(**unlimited)),
        "hang": Notifier(
            [f"json://127.0.0.1:{hang_port}/hook"],
            config=AlertsConfig(timeout=30, max_attempts=2, **unlimited),
        ),
        "500": Notifier(
            [f"json://127.0.0.1:{fail.server_address[1]}/hook"],
            config=AlertsConfig(
                timeout=5, backoff_initial=0.1, backoff_max=1.0, max_attempts=10**6, **unlimited
            ),
        ),
    }
    label, step_fn = make_step()
    for _ in range(10):  # warm-up
        step_fn()
    times: dict[str, list[float]] = {k: [] for k in arms}
    handle_us: dict[str, list[float]] = {k: [] for k in arms}
    step = 0
    names = list(arms)
    for block in range(args.blocks):
        for name in names[block % 3 :] + names[: block % 3]:  # rotate which arm runs first
            notifier = arms[name]
            for _ in range(args.block_steps):
                events = events_for(step)
                t0 = time.perf_counter()
                step_fn()
                t1 = time.perf_counter()
                notifier.handle(run_id="bench", run_name="bench", events=events)
                t2 = time.perf_counter()
                times[name].append(t2 - t0)
                handle_us[name].append((t2 - t1) * 1e6)
                step += 1
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"model: {label}; {args.blocks} blocks x {args.block_steps} steps per arm, interleaved; "
        "one alert queued per step"
    )
    for name in arms:
        st = arms[name].stats
        h_us = statistics.median(handle_us[name])
        print(
            f"  {name:>4}: median step {med[name] * 1e3:8.3f} ms, handle() {h_us:7.1f} us"
            f"  (queued {st.get('queued', 0)}, "
            f"sent {st.get('sent', 0)}, retries {st.get('retries', 0)}, dropped {st.get('dropped', 0)})"
        )
    print(f"ratio hang/none: {med['hang'] / med['none']:.3f}")
    print(f"ratio  500/none: {med['500'] / med['none']:.3f}")
    for notifier in arms.values():
        notifier.close(timeout=0.5)
    srv.close()
    for conn in held:
        conn.close()
    fail.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
