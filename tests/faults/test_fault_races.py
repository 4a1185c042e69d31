"""Races between processes, run for real and many times: two answers to one decision given at the same instant
(exactly one wins), two processes resuming one run at the same instant (exactly one writes; the other is refused
with one line before it writes anything; every step of the one that writes is stored).

Every race is between real processes on a real SQLite file and the real PostgreSQL server. The interleaving
varies from run to run; the asserted outcome does not (exactly one winner per decision, every row accounted for).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fault_support import FAST, report

from stabmon.events import Decision, DecisionStatus, StepRecord
from stabmon.store import AnswerError, RunInUseError, StoreConfig, open_store, repo

ROUNDS = 40  # decisions raced per backend


def _proposal(step: int) -> Decision:
    return Decision(step=step, action="set_clip", params={"max_norm": 0.5}, status=DecisionStatus.PROPOSED,
                    runbook="faults", rule="spike", rung=0, reason="injected")


def _proposals(url: str, n: int) -> tuple[str, list[str]]:
    with open_store(url, config=StoreConfig(**FAST)) as store:
        run = store.start_run(name="race", environment={})
        decisions = [_proposal(i) for i in range(n)]
        store.write_events(run_id=run, events=decisions)
        assert store.flush(30)
    return run, [d.id for d in decisions]


def _race(target: Any, args: list[tuple[Any, ...]], *, results: int) -> list[Any]:
    """Run ``target(*a, barrier, out)`` in one spawned process per ``a`` (sharing one barrier, so that each
    round starts at the same instant in all) and collect ``results`` items they put in ``out``."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(args)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in range(results)]
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    return got


def _answerer(url: str, run: str, ids: list[str], approved: bool, barrier: Any, out: Any) -> None:
    """One process answering every decision in ``ids``, each at the same instant as its rival."""
    from sqlalchemy.orm import Session

    from stabmon.store import make_engine

    engine = make_engine(url)
    who = "ann" if approved else "bob"
    for decision in ids:
        barrier.wait(timeout=60)
        try:
            with Session(engine) as s, s.begin():
                repo.answer_decision(session=s, run_id=run, decision_id=decision, approved=approved, by=who)
            out.put((decision, who, "won"))
        except AnswerError as exc:
            out.put((decision, who, str(exc)))
    engine.dispose()


def test_approve_and_reject_at_the_same_instant_exactly_one_wins(backend_url: str) -> None:
    url = backend_url
    run, ids = _proposals(url, ROUNDS)
    results = _race(_answerer, [(url, run, ids, True), (url, run, ids, False)], results=2 * ROUNDS)
    by_decision: dict[str, dict[str, str]] = {}
    for decision, who, what in results:
        by_decision.setdefault(decision, {})[who] = what
    with open_store(url) as store, store.session() as s:
        stored = {d.id: d for d in repo.load_events(session=s, run_id=run) if isinstance(d, Decision)}
    winners = {"ann": 0, "bob": 0}
    for decision, answers in by_decision.items():
        won = [who for who, what in answers.items() if what == "won"]
        assert len(won) == 1, f"decision {decision}: {answers}"
        loser = "bob" if won == ["ann"] else "ann"
        verb = "approved" if won == ["ann"] else "rejected"
        assert answers[loser] == answers[loser].splitlines()[0]
        assert f"already {verb} by {won[0]}" in answers[loser]
        assert stored[decision].status is DecisionStatus(verb)  # the row says what the winner was told
        winners[won[0]] += 1
    report("approve/reject race", backend=url.split(":")[0], decisions=ROUNDS, one_winner=len(by_decision),
           approve_won=winners["ann"], reject_won=winners["bob"])


def test_the_cli_loser_gets_one_line_naming_the_winner(sqlite_url: str, tmp_path: Path) -> None:
    run, (decision,) = _proposals(sqlite_url, 1)
    env = {**os.environ, "STABMON_DB_URL": sqlite_url}
    cmds = [[sys.executable, "-m", "stabmon", verb, run, decision, "--by", who]
            for verb, who in (("approve", "ann"), ("reject", "bob"))]
    procs = [subprocess.Popen(c, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    done = [(p.wait(120), *p.communicate()) for p in procs]
    assert sorted(rc for rc, _, _ in done) == [0, 1]
    (_, out, _), = [d for d in done if d[0] == 0]
    (_, _, err), = [d for d in done if d[0] == 1]
    verb = out.split()[0]
    assert err.count("\n") == 1 and f"was already {verb} by" in err, err


RESUME_ROUNDS = 6  # resumes raced per backend
RESUME_STEPS = 30  # steps the admitted writer trains each round


def _resumer(url: str, run: str, barrier: Any, out: Any) -> None:
    """One process resuming ``run`` in every round at the same instant as its rival; the one admitted trains
    RESUME_STEPS steps. Both claims are made before either writer closes (the second barrier)."""
    from fault_support import data, stored_steps
    from test_fault_monitor import monitor

    for _ in range(RESUME_ROUNDS):
        barrier.wait(timeout=120)
        last = stored_steps(url, run)[-1]
        try:
            mon, model, opt = monitor(url, resume_run_id=run)
        except RunInUseError as exc:
            out.put(("refused", str(exc)))
            mon = None
        barrier.wait(timeout=120)
        if mon is not None:
            mon.sync_step(last + 1)
            trained = 0
            for _step, x in mon.steps(data(RESUME_STEPS)):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                trained += 1
            mon.close()
            out.put(("admitted", f"{trained} {mon.outbox.store.stats.dropped_rows}"))
        barrier.wait(timeout=120)


def test_two_processes_resuming_one_run_exactly_one_writes(backend_url: str) -> None:
    from fault_support import stored_steps

    url = backend_url
    with open_store(url, config=StoreConfig(**FAST)) as store:
        run = store.start_run(name="resumed", environment={})
        store.write_steps(run_id=run, records=[StepRecord(s, {"loss": 1.0}) for s in range(10)])
        store.end_run(run_id=run, status="interrupted")
        assert store.flush(30)
    results = _race(_resumer, [(url, run)] * 2, results=2 * RESUME_ROUNDS)
    admitted = [what for kind, what in results if kind == "admitted"]
    refused = [what for kind, what in results if kind == "refused"]
    assert len(admitted) == RESUME_ROUNDS and len(refused) == RESUME_ROUNDS, results  # exactly one per round
    assert all(a == f"{RESUME_STEPS} 0" for a in admitted), admitted  # every step trained, none dropped
    assert all(r == r.splitlines()[0] and f"run {run} is being written by another process" in r for r in refused)
    expected = 10 + RESUME_ROUNDS * RESUME_STEPS
    assert stored_steps(url, run) == list(range(expected))  # every step of every admitted writer, in order
    report("two writers resuming one run", backend=url.split(":")[0], rounds=RESUME_ROUNDS,
           admitted=len(admitted), refused=len(refused), stored=f"{len(stored_steps(url, run))}/{expected}")


_HOLD = """
import sys, time
from stabmon.store import open_store
store = open_store(sys.argv[1])
store.start_run(name="held", resume_run_id=sys.argv[2], environment={})
print("holding", flush=True)
time.sleep(600)
"""


def test_a_lease_ends_with_its_holder(sqlite_url: str, tmp_path: Path) -> None:
    import time

    import sqlalchemy as sa

    with open_store(sqlite_url, config=StoreConfig(**FAST)) as store:
        run = store.start_run(name="held", environment={})
        store.end_run(run_id=run, status="interrupted")
        assert store.flush(30)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, sqlite_url, run], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with open_store(sqlite_url) as store, pytest.raises(RunInUseError, match=f"pid {holder.pid}"):
            store.start_run(name="held", resume_run_id=run, environment={})
    finally:
        holder.kill()  # SIGKILL: no close, the lease is left in the row
        holder.wait(30)
    with open_store(sqlite_url) as store:  # the holder is gone: taken over at once
        assert store.start_run(name="held", resume_run_id=run, environment={}) == run
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:  # a holder on another host is trusted until its lease runs out
        conn.execute(sa.text("update runs set lease_owner = 'elsewhere:7:abc', lease_until = :t"),
                     {"t": time.time() + 60})
    with open_store(sqlite_url) as store, pytest.raises(RunInUseError, match="elsewhere pid 7"):
        store.start_run(name="held", resume_run_id=run, environment={})
    with engine.begin() as conn:
        conn.execute(sa.text("update runs set lease_until = :t"), {"t": time.time() - 1})
    engine.dispose()
    with open_store(sqlite_url) as store:
        assert store.start_run(name="held", resume_run_id=run, environment={}) == run


def test_a_writer_whose_run_was_taken_over_says_so(sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    import sqlalchemy as sa
    from fault_support import wait_for

    with open_store(sqlite_url, config=StoreConfig(lease_ttl=0.4, **FAST)) as store:
        run = store.start_run(name="stalled", environment={})
        assert store.flush(30)
        engine = sa.create_engine(sqlite_url)
        with engine.begin() as conn:  # what another host does once this writer's lease ran out
            conn.execute(sa.text("update runs set lease_owner = 'elsewhere:7:abc'"))
        engine.dispose()
        wait_for(lambda: any("was taken over by elsewhere pid 7" in r.getMessage() for r in caplog.records))
    assert run not in store.lease.runs
