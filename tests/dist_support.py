"""Run a function on N real gloo ranks (forked processes on 127.0.0.1) with a hard timeout.

Every rank's return value comes back through a queue; a rank that raises sends its traceback instead, and a
run that does not finish within ``timeout`` seconds is killed (so a bug can never hang the test suite).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, size: int, port: int, out: Any, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=size)
        try:
            # plain pickle: tensors travel by value, not through shared memory that dies with the process
            out.put((rank, True, pickle.dumps(fn(rank, size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report to the parent, whatever it was
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``fn(rank, size, *args)`` on ``size`` ranks; their results, by rank. Fails on any error or timeout."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, size, port, out, args), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < size:
            try:
                rank, ok, value = out.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    pytest.fail(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                if time.monotonic() > deadline:
                    pytest.fail(f"ranks {sorted(set(range(size)) - set(results))} did not finish in {timeout} s")
                continue
            if not ok:
                pytest.fail(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(size)]


def _bare(fn: Callable[..., Any], rank: int, size: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    fn(rank, size, *args)
    dist.destroy_process_group()


def exit_codes(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 120.0) -> list[int | None]:
    """Run ``fn(rank, size, *args)`` on ``size`` ranks for its side effects; each process's exit code (None:
    still running at ``timeout``, then killed)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_bare, args=(fn, r, size, port, args), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


class Scripted:
    """Test double of the runbook engine: one decision (``action`` with ``params``), applied the first time the
    record of step ``at`` comes through (``once=False``: every time it does)."""

    def __init__(self, action: str, params: dict[str, Any], at: int, *, once: bool = True) -> None:
        self.action, self.params, self.at, self.once = action, params, at, once
        self.done = False

    def process(self, record: Any, anomalies: Any) -> list[Any]:
        from stabmon.events import Decision, DecisionStatus

        if record.step != self.at or (self.once and self.done):
            return []
        self.done = True
        return [Decision(step=record.step, action=self.action, params=dict(self.params), status=DecisionStatus.APPLY,
                         runbook="t", rule="r", rung=0, reason="scripted")]

    def answer(self, decision_id: str, approved: bool, step: int) -> list[Any]:
        return []

    def applied(self, decision: Any, record: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
