"""Hangs on real gloo ranks: one rank stuck in a collective that the other never joins, the other stuck in
Python code. Rank 0 is caught within the deadline learned from its step times and rings the job's hang alarm;
rank 1 reports on it, before its own later deadline; each rank's stacks land in the run's store and rank 0's
in an alert to a real HTTP receiver, and both processes exit with the configured code so a scheduler would
restart the job."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_support import exit_codes
from test_alerts_support import Receiver, wait_until
from torch import nn

from stabmon.collect.config import HANG_EXIT_CODE, HangConfig, MonitorConfig
from stabmon.collect.failsafe import Failsafe
from stabmon.collect.flushing import Flusher, Outbox
from stabmon.events import Anomaly, Severity, StepRecord
from stabmon.factory import NullDetectors
from stabmon.interventions.commit import FollowUps
from stabmon.monitor import Monitor
from stabmon.pipeline import Pipeline
from stabmon.store import open_store, repo

HANG_AT, STEP = 12, 0.02
FLOORS = (1.5, 3.0)  # rank 1 gives up later: a peer that exits first would break rank 0's collective


def stuck_in_python() -> None:
    while True:  # a rank spinning in its own code (a dead-locked data loader, an endless eval loop)
        time.sleep(0.01)


def _train(rank: int, size: int, url: str, alert_url: str, floors: tuple[float, ...] = FLOORS) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hang = HangConfig(factor=5.0, floor=floors[rank], learn_after=5, exit_code=HANG_EXIT_CODE)
    config = MonitorConfig(flush_every=4, hang_timeout=60.0, hang=hang)
    alerts = [alert_url] if rank == 0 and alert_url else None
    mon = Monitor(model, opt, store=url, alerts=alerts, run_name="hang-test", config=config)
    for step, x in mon.steps([torch.randn(8, 4) for _ in range(40)]):
        time.sleep(STEP)
        if step == HANG_AT:
            if rank == 0:
                dist.all_reduce(torch.ones(1))  # rank 1 never joins
            stuck_in_python()
        loss = model(x).pow(2).mean()
        loss.backward()
        mon.observe(loss=loss)
        opt.step()
        opt.zero_grad()
    mon.close()


def _hangs(url: str) -> list[Anomaly]:
    store = open_store(url)
    try:
        with store.session() as s:
            (run,) = repo.list_runs(session=s)
            return [e for e in repo.load_events(session=s, run_id=run.id) if isinstance(e, Anomaly)]
    finally:
        store.close()


@pytest.mark.slow
def test_hung_ranks_are_caught_dumped_alerted_and_exit(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'stabmon.db'}"
    receiver = Receiver()
    try:
        codes = exit_codes(_train, 2, url, f"json://{receiver.netloc}/hook", timeout=90)
        assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE]
        assert wait_until(lambda: receiver.delivered(), 5.0)
        bodies = [str(b) for b in receiver.json_bodies()]
    finally:
        receiver.close()
    hangs = sorted((a for a in _hangs(url) if a.kind == "hang"), key=lambda a: a.message)
    assert [a.message.split(":")[0] for a in hangs] == ["rank 0", "rank 1"]
    in_collective, in_python = hangs
    for a, floor in zip(hangs, FLOORS, strict=True):
        assert a.step == HANG_AT - 1  # the last step that completed
        assert a.threshold == floor  # learned: 5 x ~0.03 s steps is below the floor, far below 60 s
        assert "stacks of every thread" in a.message and "stabmon-hang-watchdog" not in a.message[:20]
    assert in_collective.threshold <= in_collective.score < in_collective.threshold + 1.0  # within a poll
    # rank 1 reports on rank 0's alarm (the job's c10d store), before its own later deadline
    assert in_python.score < in_python.threshold and "a peer rank is hung" in in_python.message
    assert "all_reduce" in in_collective.message and "_train" in in_collective.message
    assert "stuck_in_python" in in_python.message
    assert any("all_reduce" in b and "hang" in b for b in bodies)  # rank 0's stacks went out with the alert


def test_hang_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"config.hang.floor must be > 0, got 0"):
        MonitorConfig(hang=HangConfig(floor=0))
    with pytest.raises(ValueError, match=r"config.hang.exit_code must be in \[1, 255\] or None, got 0"):
        MonitorConfig(hang=HangConfig(exit_code=0))
    assert MonitorConfig.from_dict({"hang": {"factor": 3.0}}).hang.factor == 3.0


def test_learned_deadline_follows_step_times_within_floor_and_cap() -> None:
    from stabmon.detect.hang import HangWatchdog

    now = [0.0]
    dog = HangWatchdog(timeout=100.0, callback=lambda a: None, clock=lambda: now[0], factor=4.0, floor=2.0,
                       learn_after=3, stacks=False)
    assert dog.deadline() == 100.0  # not learned yet: the configured timeout
    for step in range(4):
        now[0] += 1.5
        dog.beat(step)
    assert dog.deadline() == 6.0  # 4 x the slowest step
    dog.beat(4, learn=False)  # a heartbeat from inside a long evaluation teaches nothing
    now[0] += 5.9
    assert dog.check() is None
    now[0] += 0.2
    found = dog.check()
    assert found is not None and found.step == 3 and found.threshold == 6.0
    for step in range(5, 300):
        now[0] += 100.0
        dog.beat(step)
    assert dog.deadline() == 100.0  # never above the cap


# -- the watchdog thread and the training thread never publish at the same time ---------------------------------
def anomaly(kind: str, step: int) -> Anomaly:
    return Anomaly(kind=kind, metric="loss", step=step, score=1.0, severity=Severity.WARNING, detector="test")


class FlagEverything(NullDetectors):
    """Detectors that flag every record, so that every flush publishes."""

    def update(self, record: StepRecord) -> list[Anomaly]:
        return [anomaly("test", record.step)]


class TimedSink:
    """A sink whose ``write_events`` holds the main (training) thread ``hold`` seconds; it notes every call's
    thread and interval, and how many calls were ever inside at once."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.calls: list[tuple[str, float, float, list[Any]]] = []
        self.inside = self.most_inside = 0
        self._count = threading.Lock()

    def write_events(self, *, run_id: str, events: Any) -> None:
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        start = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            time.sleep(self.hold)
        with self._count:
            self.inside -= 1
        self.calls.append((threading.current_thread().name, start, time.monotonic(), list(events)))

    def start_run(self, **_: Any) -> str:
        return "run-1"

    def write_steps(self, **_: Any) -> None:
        pass

    def poll_answers(self, **_: Any) -> list[tuple[str, bool]]:
        return []

    def end_run(self, **_: Any) -> None:
        pass

    def write_checkpoint(self, **_: Any) -> None:
        pass

    def write_skipped_batches(self, **_: Any) -> None:
        pass

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass


def test_the_watchdog_waits_for_a_flush_that_is_publishing() -> None:
    sink = TimedSink(hold=2.0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = MonitorConfig(flush_every=2, hang_timeout=0.3)
    mon = Monitor(model, opt, store=sink, detectors=FlagEverything(), config=config)
    for _, x in mon.steps([torch.randn(8, 4) for _ in range(2)]):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    # step 1's flush held the training thread in write_events for 2 s, well past the 0.3 s deadline
    deadline = time.monotonic() + 20
    while not any(a.kind == "hang" and a.step == 1 for a in mon.anomalies) and time.monotonic() < deadline:
        time.sleep(0.05)
    mon.close()
    (slow,) = [c for c in sink.calls if c[0] == threading.main_thread().name and c[2] - c[1] >= 2.0]
    (hang_call,) = [c for c in sink.calls if any(a.kind == "hang" and a.step == 1 for a in c[3])]
    hang = next(a for a in hang_call[3] if a.kind == "hang")
    assert hang_call[0] == "stabmon-hang-watchdog"
    assert slow[1] + hang.score < slow[2]  # it fired while the flush was writing ...
    assert hang_call[1] >= slow[2]  # ... and published only after that write was done
    assert sink.most_inside == 1


def test_the_watchdog_hands_its_events_to_the_next_flush_when_a_publish_is_stuck() -> None:
    release, entered = threading.Event(), threading.Event()
    written: list[str] = []

    class StuckOnce:
        def write_events(self, *, run_id: str, events: Any) -> None:
            if not written:
                entered.set()
                assert release.wait(20)
            written.extend(e.kind for e in events)

    safe = Failsafe()
    outbox = Outbox(StuckOnce(), None, failsafe=safe, run_name="stuck")  # type: ignore[arg-type]

    class Target:
        should_stop, stop_reason, step, follow_ups = False, None, 0, FollowUps()

    flusher = Flusher(Pipeline(NullDetectors()), outbox, target=Target(), failsafe=safe, handoff_after=0.2)
    stuck = threading.Thread(target=flusher.publish, args=([anomaly("spike", 1)],))
    stuck.start()
    assert entered.wait(20)
    try:
        flusher.publish_from_thread([anomaly("hang", 1)])  # gives up after 0.2 s: the training thread holds on
        assert written == [] and [a.kind for a in flusher.anomalies] == ["spike"]
    finally:
        release.set()
        stuck.join(20)
    flusher.flush([])
    assert written == ["spike", "hang"] and [a.kind for a in flusher.anomalies] == ["spike", "hang"]
    assert safe.errors == {}
