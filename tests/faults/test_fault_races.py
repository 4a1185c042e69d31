"""Races between processes, run for real and many times: two answers to one decision given at the same instant
(exactly one wins), two writers resuming one run (one is refused up front; nothing is lost silently).

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

from fault_support import FAST, report

from stabmon.events import Decision, DecisionStatus
from stabmon.store import AnswerError, StoreConfig, open_store, repo

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
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_answerer, args=(url, run, ids, ok, barrier, out)) for ok in (True, False)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(2 * ROUNDS)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
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
