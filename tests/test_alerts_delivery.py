"""Real apprise delivery to a local HTTP receiver: json:// and form://, endpoints that hang or fail,
retries and backoff, draining on close, rate-limit notes, rank 0 only, state round-trip."""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import parse_qs

import pytest
from apprise.plugins import pagerduty as apprise_pagerduty
from test_alerts_support import (
    PD_API,
    PD_ROUTING,
    Receiver,
    anomaly,
    fast,
    incident,
    resolved,
    wait_until,
)

from stabmon.alerts import MemoryRecorder, Notifier
from stabmon.events import DecisionStatus


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


# -- real delivery ----
def test_json_and_form_delivery_to_local_receiver(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    n = Notifier(
        [f"json://{receiver.netloc}/json", f"form://{receiver.netloc}/form"], config=fast(), recorder=rec
    )
    n.handle(run_id="run1", run_name="tiny", events=incident())
    assert n.flush(10)
    n.close(5)
    by_path = {r["path"]: r for r in receiver.delivered()}
    j = json.loads(by_path["/json"]["body"])
    assert "scale_lr applied at step 120" in j["title"]
    for line in (
        "run: tiny (id run1)",
        "score=11.5 threshold=6",
        "120=8.75",
        "changed: lr 0.0006 → 0.0003",
        "stabmon trace run1",
    ):
        assert line in j["message"]
    form = parse_qs(by_path["/form"]["body"].decode())
    assert "changed: lr 0.0006 → 0.0003" in form["message"][0]
    assert sorted(r["status"] for r in rec.rows.values()) == ["sent", "sent"]
    assert {r["channel"] for r in rec.rows.values()} == {
        f"json://{receiver.netloc}/***",
        f"form://{receiver.netloc}/***",
    }


def test_proposal_carries_approve_and_reject_commands(receiver: Receiver) -> None:
    n = Notifier([f"json://{receiver.netloc}/p"], config=fast())
    n.handle(run_id="run2", run_name="tiny", events=incident(status=DecisionStatus.PROPOSED))
    assert n.flush(10)
    n.close(5)
    [msg] = receiver.json_bodies()
    assert "stabmon approve run2 d1" in msg["message"] and "stabmon reject run2 d1" in msg["message"]


# -- never blocking, retries, nothing lost ----
def test_hanging_endpoint_never_holds_the_training_thread(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    receiver.hang = True
    n = Notifier([f"json://{receiver.netloc}/h"], config=fast(timeout=0.3), recorder=rec)
    n.handle(run_id="r", run_name="tiny", events=[anomaly(10, "x1", metric="m1")])
    assert receiver.entered.wait(10)  # the delivery thread is now stuck inside the endpoint
    # handle() returns although the endpoint cannot answer until release is set (below): it never waits.
    for i in range(2, 6):
        n.handle(run_id="r", run_name="tiny", events=[anomaly(10 + i, f"x{i}", metric=f"m{i}")])
    assert not receiver.release.is_set()
    assert n.counters["queued"] == 5
    assert wait_until(lambda: len(receiver.requests) >= 2)  # the first attempt timed out; a retry came
    with receiver.lock:
        receiver.hang = False
    receiver.release.set()
    assert n.flush(20)
    n.close(5)
    titles = [b["title"] for b in receiver.json_bodies()]
    assert sorted(t.split(" in ")[1].split(" at ")[0] for t in set(titles)) == [f"m{i}" for i in range(1, 6)]
    first = next(r for r in rec.rows.values() if r["title"].find(" m1 ") > 0)
    assert first["status"] == "sent" and first["attempts"] >= 2
    assert any(status == "retrying" and err for _, status, _, err in rec.history)


def test_a_hanging_channel_does_not_delay_another(receiver: Receiver) -> None:
    other = Receiver()
    try:
        receiver.hang = True
        n = Notifier([f"json://{receiver.netloc}/h", f"json://{other.netloc}/ok"], config=fast(timeout=10))
        n.handle(run_id="r", run_name="tiny", events=incident())
        assert receiver.entered.wait(10)
        assert wait_until(lambda: len(other.delivered()) == 1)
        assert not receiver.release.is_set()  # first channel still stuck; the second did not wait
        receiver.release.set()
        n.close(5)
    finally:
        other.close()


def test_500_endpoint_retries_with_backoff_and_loses_nothing(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    receiver.fail_next = 3
    n = Notifier([f"json://{receiver.netloc}/f"], config=fast(), recorder=rec)
    n.handle(run_id="r", run_name="tiny", events=[anomaly(1, "e1", metric="first")])
    n.handle(run_id="r", run_name="tiny", events=[anomaly(2, "e2", metric="second")])
    assert n.flush(20)
    n.close(5)
    assert [b["title"].split(" in ")[1].split(" at ")[0] for b in receiver.json_bodies()] == [
        "first",
        "second",
    ]
    rows = sorted(rec.rows.values(), key=lambda r: r["title"])
    assert [(r["status"], r["attempts"]) for r in rows] == [("sent", 4), ("sent", 1)]
    retries = [h for h in rec.history if h[1] == "retrying"]
    assert [h[2] for h in retries] == [1, 2, 3] and all("500" in h[3] for h in retries)
    assert n.counters["retries"] == 3


def test_close_drains_pending_retries(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    receiver.fail_next = 3
    n = Notifier([f"json://{receiver.netloc}/d"], config=fast(backoff_max=30.0), recorder=rec)
    for i in range(3):
        n.handle(run_id="r", run_name="tiny", events=[anomaly(i, f"c{i}", metric=f"q{i}")])
    n.close(timeout=20)  # no flush first: close itself delivers what is queued, retrying as it goes
    assert sorted(r["status"] for r in rec.rows.values()) == ["sent"] * 3
    assert len(receiver.delivered()) == 3


def test_rate_limited_alerts_are_counted_in_the_next_message(receiver: Receiver) -> None:
    now = [1000.0]
    cfg = fast(rate_per_minute=1, burst=1)
    n = Notifier([f"json://{receiver.netloc}/rl"], config=cfg, clock=lambda: now[0])
    for i in range(3):
        n.handle(run_id="r", run_name="tiny", events=[anomaly(i, f"r{i}", metric=f"g{i}")])
    now[0] += 60.0  # one token back
    n.handle(run_id="r", run_name="tiny", events=[anomaly(9, "r9", metric="g9")])
    assert n.flush(10)
    n.close(5)
    first, second = receiver.json_bodies()
    assert "held back" not in first["message"]
    assert "(2 earlier alert(s) on this channel held back by rate limits)" in second["message"]
    assert n.stats["suppressed"][f"json://{receiver.netloc}/***"]["rate_limit"] == 2


def test_gives_up_after_max_attempts_and_close_abandons_the_rest(receiver: Receiver) -> None:
    rec = MemoryRecorder()
    receiver.fail_next = 1000
    n = Notifier([f"json://{receiver.netloc}/x"], config=fast(max_attempts=2), recorder=rec)
    n.handle(run_id="r", run_name="tiny", events=[anomaly(1, "e1", metric="a")])
    assert n.flush(10)
    assert [(r["status"], r["attempts"]) for r in rec.rows.values()] == [("failed", 2)]
    receiver.hang = True
    n.handle(run_id="r", run_name="tiny", events=[anomaly(2, "e2", metric="b"), anomaly(3, "e3", metric="c")])
    assert receiver.entered.wait(10)
    n.close(timeout=0.1)
    statuses = sorted(r["status"] for r in rec.rows.values())
    assert "abandoned" in statuses


def test_only_rank_zero_sends(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    n = Notifier([f"json://{receiver.netloc}/r"], config=fast())
    n.handle(run_id="r", run_name="tiny", events=incident())
    assert n.flush(5) and n.counters.get("queued", 0) == 0
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    n.handle(run_id="r", run_name="tiny", events=incident())
    assert n.flush(10)
    n.close(5)
    assert len(receiver.delivered()) == 1


def test_notifier_state_round_trip(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(apprise_pagerduty.PAGERDUTY_API_LOOKUP, "us", f"http://{receiver.netloc}/v2/enqueue")
    url = f"pagerduty://{PD_ROUTING}@{PD_API}"
    n = Notifier([url], config=fast())
    n.handle(run_id="r", run_name="tiny", events=incident())
    assert n.flush(10)
    n.close(5)
    resumed = Notifier([url], config=fast())
    resumed.load_state_dict(n.state_dict())
    assert resumed.state_dict() == n.state_dict()
    resumed.handle(run_id="r", run_name="tiny", events=[anomaly(400, "z1")])  # same open incident: no page
    resumed.handle(run_id="r", run_name="tiny", events=[resolved(450)])
    assert resumed.flush(10)
    resumed.close(5)
    assert [b["event_action"] for b in receiver.json_bodies()] == ["trigger", "resolve"]
