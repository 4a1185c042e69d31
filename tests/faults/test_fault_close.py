"""What happens at the end of a run: the notifier's last writes land before the store closes."""

from __future__ import annotations

import sys
from pathlib import Path

from fault_support import FAST, report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_alerts_support import Receiver, anomaly, fast  # noqa: E402

from stabmon.alerts import make_notifier  # noqa: E402
from stabmon.alerts.config import ChannelConfig  # noqa: E402
from stabmon.store import StoreConfig, open_store, repo  # noqa: E402

FINAL = {"sent", "failed", "abandoned"}


def test_the_last_alert_status_lands_before_the_store_closes(sqlite_url: str, tmp_path: Path) -> None:
    receiver = Receiver()
    receiver.hang = True  # accepts the connection, answers only after the client gave up
    store = open_store(sqlite_url, config=StoreConfig(spool_dir=str(tmp_path), **FAST))
    run = store.start_run(name="alerts", environment={})
    cfg = fast(channels=[ChannelConfig(url=f"json://{receiver.netloc}/hook")], timeout=1.5, dedup_window=0)
    notifier = make_notifier(cfg, store=store)
    assert notifier is not None
    notifier.handle(run_id=run, run_name="alerts", events=[anomaly(10, "a1"), anomaly(20, "a2")])
    assert receiver.entered.wait(20)  # the first alert's attempt is in flight, the second one queued
    notifier.close(timeout=0.3)  # the deadline passes while the attempt waits on the endpoint
    store.close()
    thread = notifier.workers[0]._thread
    assert thread is not None
    thread.join(20)  # the attempt gives up (timeout 1.5 s) after the store closed: nothing more may be written
    receiver.close()
    with open_store(sqlite_url) as again, again.session() as s:
        rows = repo.list_alerts(session=s, run_id=run)
    statuses = sorted(r["status"] for r in rows)
    report("alert in flight at close", alerts=len(rows), statuses=",".join(statuses),
           dropped=store.stats.dropped_rows)
    assert len(rows) == 2 and set(statuses) <= FINAL, rows  # before: the in-flight one stayed queued/retrying
    assert store.stats.dropped_rows == 0  # before: 1, the late status written after close()
    assert "still waiting for the endpoint" in " ".join(str(r["error"]) for r in rows)
