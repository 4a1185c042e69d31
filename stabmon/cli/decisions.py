"""``stabmon approve RUN DECISION`` / ``stabmon reject RUN DECISION``: answer a proposal in propose mode.

The answer is written to the store; the training process picks it up at its next flush (``poll_answers``) and
applies an approved decision there; a run that has ended (status other than ``running``) only records it.
``DECISION`` may be a unique prefix of the decision id.
"""

from __future__ import annotations

import getpass
from typing import Annotated

import typer

from stabmon.cli._common import DbOption, RunArg, echo, fail, print_json, store_session

DecisionArg = Annotated[str, typer.Argument(help="Decision id (or a unique prefix).")]
ByOption = Annotated[str | None, typer.Option("--by", help="Who answers (default: the current user).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the answered decision as JSON.")]


def _answer(run: str, decision: str, approved: bool, db: str | None, by: str | None, as_json: bool) -> None:
    from stabmon.events import Decision, to_dict
    from stabmon.store import AnswerError, RunNotFoundError, repo

    with store_session(db) as s:
        try:
            found = repo.resolve_run(session=s, ref=run)
            run_id, status = found.id, found.status
            ids = {e.id for e in repo.load_events(session=s, run_id=run_id) if isinstance(e, Decision)}
            matches = sorted(i for i in ids if i.startswith(decision))
            if decision in ids:
                matches = [decision]
            if len(matches) != 1:
                fail(f"run {run_id} has {'no' if not matches else 'several'} decisions matching {decision!r}"
                     + (f": {', '.join(matches)}" if matches else ""))
            answered = repo.answer_decision(session=s, run_id=run_id, decision_id=matches[0],
                                            approved=approved, by=by or _user())
        except (AnswerError, RunNotFoundError) as exc:
            fail(str(exc))
    if as_json:
        print_json(to_dict(answered))
        return
    verb = "approved" if approved else "rejected"
    then = ("the run picks it up at its next flush" if status == "running"
            else f"the run has ended (status {status}), so the answer is recorded only")
    echo(f"{verb} {answered.id}: {answered.action} {dict(answered.params)} (run {run_id}, rule "
               f"{answered.rule}, rung {answered.rung + 1}); {then}")


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        return "cli"


def approve(run: RunArg, decision: DecisionArg, db: DbOption = None, by: ByOption = None,
            as_json: JsonOption = False) -> None:
    """Approve a proposed decision; the run applies it at its next flush."""
    _answer(run, decision, True, db, by, as_json)


def reject(run: RunArg, decision: DecisionArg, db: DbOption = None, by: ByOption = None,
           as_json: JsonOption = False) -> None:
    """Reject a proposed decision; the run drops it, its incident closes, and what the incident changed so far
    is reverted (or kept, with the runbook's approval.on_reject: keep)."""
    _answer(run, decision, False, db, by, as_json)


def register(app: typer.Typer) -> None:
    app.command("approve")(approve)
    app.command("reject")(reject)
