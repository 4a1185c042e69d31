"""Fault injection for the fault suite: a TCP proxy that can cut or refuse the database, counts read back
from the store, and a tiny monitored training loop that measures the training thread's longest step."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.engine import make_url

from stabmon.factory import NullDetectors

FAST = {"flush_interval": 0.02, "retry_initial": 0.05, "retry_max": 0.2}

SPIKE_RUNBOOK = """
name: faults
mode: {mode}
cooldown: 0
approval: {{timeout: {timeout}, on_timeout: expire}}
rules:
  - name: spike
    when: {{kind: spike}}
    ladder: [{{action: set_clip, params: {{max_norm: 0.5}}, observe: 3}}]
"""


class TcpProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target``: ``forward`` relays, ``pause`` holds every byte (a
    silent network cut: sockets stay open, nothing arrives), ``refuse`` closes every connection at once."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "forward"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._pump, daemon=True).start()

    def url(self, db_url: str) -> str:
        return make_url(db_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def set(self, mode: str) -> None:
        assert mode in ("forward", "pause", "refuse")
        self.mode = mode
        if mode == "refuse":
            self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            a.close()
            b.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))

    def _pump(self) -> None:
        while not self._stop:
            with self._lock:
                pairs = list(self._pairs)
            if self.mode != "forward" or not pairs:
                time.sleep(0.01)
                continue
            peer = {a: b for a, b in pairs} | {b: a for a, b in pairs}
            try:
                ready, _, _ = select.select(list(peer), [], [], 0.01)
            except (OSError, ValueError):
                continue
            for sock in ready:
                try:
                    data = sock.recv(65536)
                    if data:
                        peer[sock].sendall(data)
                        continue
                except OSError:
                    pass
                self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            for pair in [p for p in self._pairs if sock in p]:
                self._pairs.remove(pair)
                for s in pair:
                    s.close()

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        self._drop_all()


@contextmanager
def proxy_for(db_url: str) -> Iterator[TcpProxy]:
    u = make_url(db_url)
    proxy = TcpProxy((u.host or "127.0.0.1", u.port or 5432))
    try:
        yield proxy
    finally:
        proxy.close()


def count(url: str, sql: str, **params: Any) -> int:
    """One integer from the database at ``url``."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql), params).scalar() or 0)
    finally:
        engine.dispose()


def stored_steps(url: str, run_id: str) -> list[int]:
    """The steps of ``run_id`` in the store, in record order."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("select s.step from steps s join runs r on r.key = s.run_key where r.id = :r order by s.seq"),
                {"r": run_id},
            )
            return [int(r[0]) for r in rows]
    finally:
        engine.dispose()


def wait_for(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


SEED = int(os.environ.get("STABMON_TEST_SEED", "0"))
THREADS = int(os.environ.get("STABMON_TEST_THREADS", "0"))  # 0: torch's own default


@pytest.fixture
def test_threads() -> Iterator[None]:
    """torch on ``STABMON_TEST_THREADS`` threads for the test, as it was afterwards (use it with
    ``pytestmark = pytest.mark.usefixtures("test_threads")``)."""
    before = torch.get_num_threads()
    if THREADS:
        torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


def seeded_tiny() -> torch.nn.Module:
    """The fault suite's tiny model, its weights moved by ``STABMON_TEST_SEED``: what is checked holds for every
    seed (and every thread count, ``STABMON_TEST_THREADS``)."""
    model = Tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(SEED)), alpha=0.1)
    return model


def data(n: int) -> list[torch.Tensor]:
    return [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(n)]


@dataclass
class Trained:
    """What a loop did: steps trained and the training thread's longest step (seconds)."""

    steps: int = 0
    longest: float = 0.0
    durations: list[float] = field(default_factory=list)


def train(
    mon: Any,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    n: int,
    *,
    spike_at: tuple[int, ...] = (),
    each: Any = None,
) -> Trained:
    """``n`` steps; the observed loss is raised by 1e6 at the steps in ``spike_at`` (an injected spike). ``each(step)``
    runs after every step; its own time is left out of the step durations."""
    out = Trained()
    last, spent = time.perf_counter(), 0.0
    for step, x in mon.steps(data(mon.step + n)):  # the data cursor resumes at mon.step: n new steps
        now = time.perf_counter()
        if step:
            out.durations.append(now - last - spent)
        last, spent = now, 0.0
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss + (1e6 if step in spike_at else 0.0))  # the spike is in the record only
        opt.step()
        opt.zero_grad()
        out.steps += 1
        if each is not None:
            t = time.perf_counter()
            each(step)
            spent = time.perf_counter() - t
    out.longest = max(out.durations, default=0.0)
    return out


class SpikeDetectors(NullDetectors):
    """Flags every loss above 1e3 (the injected spikes), nothing else."""

    def update(self, record: Any) -> list[Any]:
        from stabmon.events import Anomaly, Severity

        v = record.get("loss")
        if v is None or not v > 1e3:
            return []
        return [
            Anomaly(kind="spike", metric="loss", step=record.step, score=v, severity=Severity.ERROR, detector="fault")
        ]


def spike_runbook(mode: str = "apply", timeout: int = 200) -> Any:
    from stabmon.runbook import loads_runbook

    return loads_runbook(SPIKE_RUNBOOK.format(mode=mode, timeout=timeout))


def report(fault: str, **figures: Any) -> None:
    """One ``FAULT`` line with what a test measured (``pytest -s tests/faults | grep FAULT`` collects them for
    docs/RELIABILITY.md)."""
    shown = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    print(f"FAULT {fault}: {shown}")


_PEAK = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[2:], capture_output=True, text=True)
open(sys.argv[1], "w").write(f"{done.returncode} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}")
sys.stdout.write(done.stdout)
sys.stderr.write(done.stderr)
"""


def peak_run(cmd: list[str], cwd: Any) -> tuple[int, str, str, float]:
    """``cmd`` in a subprocess: (exit code, stdout, stderr, peak RSS in MiB). It is started by a small Python
    process in between, because a child's ``ru_maxrss`` starts at its parent's RSS (a test process holds
    torch)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    figures = Path(cwd) / "peak.txt"
    done = subprocess.run([sys.executable, "-c", _PEAK, str(figures), *cmd], env=env, cwd=cwd,
                          capture_output=True, text=True)
    code, kib = figures.read_text().split()
    return int(code), done.stdout, done.stderr, int(kib) / 1024
