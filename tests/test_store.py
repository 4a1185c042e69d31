"""The SQL store against a real SQLite file and the real PostgreSQL server: round-trips, answers, config,
errors."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from stabmon.events import (
    Anomaly,
    Decision,
    DecisionStatus,
    InterventionRecord,
    Outcome,
    Severity,
    StepRecord,
    Verdict,
)
from stabmon.sinks import Sink
from stabmon.store import (
    AnswerError,
    RunNotFoundError,
    SchemaNotReadyError,
    Store,
    StoreConfig,
    open_store,
    repo,
    upgrade,
)

NAN, INF = math.nan, math.inf


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    pg = request.getfixturevalue("pg_url")
    upgrade(pg)
    return pg


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    s = open_store(url, config=StoreConfig(flush_interval=0.02))
    yield s
    s.close()


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def records_equal(got: list[StepRecord], want: list[StepRecord]) -> None:
    assert [(r.step, r.batch_index, r.time) for r in got] == [(r.step, r.batch_index, r.time) for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.metrics.keys() == w.metrics.keys()
        assert all(same(g.metrics[k], w.metrics[k]) for k in w.metrics), (g, w)


def chain() -> list:
    """One of each event type, NaN/inf inside evidence and params, linked as the engine links them."""
    a = Anomaly(
        "spike",
        "grad_norm",
        10,
        INF,
        Severity.ERROR,
        "zscore",
        ((8, 1.0), (9, NAN), (10, INF)),
        threshold=6.0,
        message="grad norm spiked",
    )
    d = Decision(
        10,
        "scale_lr",
        {"factor": 0.5, "note": None, "nested": {"x": -INF}},
        DecisionStatus.PROPOSED,
        "opt175b",
        "grad_spike",
        0,
        "grad norm spike",
        anomaly_id=a.id,
        incident_id="inc1",
    )
    i = InterventionRecord(d.id, 11, "scale_lr", {"lr": 1e-3}, {"lr": 5e-4})
    o = Outcome(i.id, d.id, 30, Verdict.RESOLVED, {"signal_max": 1.5, "loss": NAN}, incident_id="inc1")
    return [a, d, i, o]


def test_store_is_a_sink(store: Store) -> None:
    assert isinstance(store, Sink)


def test_steps_round_trip_exactly_with_nan_and_inf(store: Store) -> None:
    recs = [
        StepRecord(0, {"loss": 2.5, "grad_norm": 0.7, "loss_scale": 65536.0}, batch_index=0, time=1.7e9),
        StepRecord(1, {"loss": NAN, "grad_norm": INF, "loss_scale": -INF}, batch_index=1, time=None),
        StepRecord(2, {}, batch_index=None, time=1.7e9 + 2),
        StepRecord(3, {"grad_norm/transformer.h.0": 1e-300, "loss": -0.0, "overflow": 1.0}),
    ]
    run = store.start_run(name="r", environment={})
    store.write_steps(run_id=run, records=recs[:2])
    store.write_steps(run_id=run, records=recs[2:])
    assert store.flush(20)
    with store.session() as s:
        records_equal(repo.load_steps(session=s, run_id=run), recs)
        df = repo.get_metrics(session=s, run_id=run, names=["grad_norm"])
    assert df["step"].to_list() == [0, 1]
    assert df["value"][1] == INF


def test_rolled_back_steps_keep_both_trajectories(store: Store) -> None:
    run = store.start_run(name="r", environment={})
    first = [StepRecord(s, {"loss": float(s)}) for s in range(5)]
    again = [StepRecord(s, {"loss": 100.0 + s}) for s in range(3, 6)]  # rolled back to step 3
    store.write_steps(run_id=run, records=first)
    store.write_steps(run_id=run, records=again)
    assert store.flush(20)
    with store.session() as s:
        got = repo.load_steps(session=s, run_id=run)
    assert [(r.step, r.metrics["loss"]) for r in got] == [(r.step, r.metrics["loss"]) for r in first + again]


def test_every_event_type_round_trips_in_causal_order(store: Store) -> None:
    run = store.start_run(name="r", environment={})
    events = chain()
    store.write_steps(run_id=run, records=[StepRecord(10, {"loss": 1.0})])
    store.write_events(run_id=run, events=events[:2])
    store.write_events(run_id=run, events=events[2:])
    assert store.flush(20)
    with store.session() as s:
        got = repo.load_events(session=s, run_id=run)
    assert [type(e) for e in got] == [Anomaly, Decision, InterventionRecord, Outcome]
    a, d, i, o = got
    assert a.evidence[:1] == ((8, 1.0),) and math.isnan(a.evidence[1][1]) and a.evidence[2] == (10, INF)
    assert a.score == INF and a.severity is Severity.ERROR
    assert (a.id, a.kind, a.metric, a.step, a.detector, a.threshold, a.message) == (
        events[0].id,
        "spike",
        "grad_norm",
        10,
        "zscore",
        6.0,
        "grad norm spiked",
    )
    assert d == events[1]
    assert d.params["nested"]["x"] == -INF and d.params["note"] is None
    assert i == events[2]
    assert o.evidence["signal_max"] == 1.5 and math.isnan(o.evidence["loss"])
    assert (o.id, o.intervention_id, o.decision_id, o.verdict) == (events[3].id, i.id, d.id, Verdict.RESOLVED)


def test_later_decision_status_wins(store: Store) -> None:
    run = store.start_run(name="r", environment={})
    d = chain()[1]
    applied = Decision(**{**{f: getattr(d, f) for f in d.__slots__}, "status": DecisionStatus.APPLIED})
    store.write_events(run_id=run, events=[d, applied])  # same batch
    assert store.flush(20)
    with store.session() as s:
        got = repo.load_events(session=s, run_id=run)
    assert len(got) == 1 and got[0].status is DecisionStatus.APPLIED


def test_answers_reach_the_run_once(store: Store) -> None:
    run = store.start_run(name="r", environment={})
    d = chain()[1]
    store.write_events(run_id=run, events=[d])
    assert store.flush(20)
    with store.session() as s:
        assert [p.decision.id for p in repo.pending_answers(session=s)] == [d.id]
        answered = repo.answer_decision(session=s, run_id=run, decision_id=d.id, approved=True, by="alice")
    assert answered.status is DecisionStatus.APPROVED
    with store.session() as s:
        assert repo.pending_answers(session=s, run_id=run) == []
        with pytest.raises(AnswerError, match="already approved by alice"):
            repo.answer_decision(session=s, run_id=run, decision_id=d.id, approved=False, by="bob")
        with pytest.raises(AnswerError, match="has no decision 'nope'"):
            repo.answer_decision(session=s, run_id=run, decision_id="nope", approved=True, by="bob")
    assert store.refresh_answers(run_id=run, timeout=10.0)  # read by the writer thread
    assert store.poll_answers(run_id=run) == [(d.id, True)]
    assert store.refresh_answers(run_id=run, timeout=10.0)
    assert store.poll_answers(run_id=run) == []


def test_answers_are_not_polled_while_the_database_is_away(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    cfg = StoreConfig(flush_interval=0.02, retry_initial=0.05, retry_max=0.1, poll_interval=60.0)
    with open_store(url, config=cfg) as store:
        run = store.start_run(name="r", environment={})
        d = chain()[1]
        store.write_events(run_id=run, events=[d])
        assert store.flush(20)
        with store.session() as s:
            repo.answer_decision(session=s, run_id=run, decision_id=d.id, approved=False, by="a")
        monkeypatch.setattr(store._writer, "backlog", lambda: True)  # as during an outage
        store.refresh_answers(run_id=run, timeout=0.3)
        assert store.poll_answers(run_id=run) == []
        assert not store.answers_live
        monkeypatch.undo()
        assert store.refresh_answers(run_id=run, timeout=10.0)
        assert store.poll_answers(run_id=run) == [(d.id, False)]
        assert store.answers_live
        assert store.poll_answers(run_id=run) == []  # throttled by poll_interval, and nothing new anyway


def test_decision_not_proposed_cannot_be_answered(store: Store) -> None:
    run = store.start_run(name="r", environment={})
    d = chain()[1]
    d = Decision(**{**{f: getattr(d, f) for f in d.__slots__}, "status": DecisionStatus.APPLY})
    store.write_events(run_id=run, events=[d])
    assert store.flush(20)
    with store.session() as s, pytest.raises(AnswerError, match="not awaiting an answer"):
        repo.answer_decision(session=s, run_id=run, decision_id=d.id, approved=True, by="a")


def test_runs_checkpoints_skips_and_end(store: Store) -> None:
    parent = store.start_run(name="base", environment={"torch": {"version": "x"}}, config={"lr": NAN})
    child = store.start_run(name="replay-of-base", kind="replay", parent_run_id=parent, source="import.log")
    store.write_steps(run_id=parent, records=[StepRecord(s, {"loss": 1.0}) for s in range(4)])
    store.write_events(run_id=parent, events=chain()[:1])
    store.write_checkpoint(run_id=parent, step=2, path="ckpt/2.pt", nbytes=123, valid=True)
    store.write_skipped_batches(run_id=parent, step=3, batch_indices=[7, 8])
    store.write_skipped_batches(run_id=parent, step=3, batch_indices=[7, 8])  # idempotent
    store.end_run(run_id=parent, status="finished")
    assert store.flush(20)
    with store.session() as s:
        runs = {r.id: r for r in repo.list_runs(session=s)}
        assert runs[parent].steps == 4 and runs[parent].last_step == 3 and runs[parent].anomalies == 1
        assert runs[parent].status == "finished" and runs[parent].ended_at is not None
        assert runs[child].kind == "replay" and runs[child].parent_run_id == parent and runs[child].steps == 0
        config, env = repo.run_config(session=s, run_id=parent)
        assert math.isnan(config["lr"]) and env == {"torch": {"version": "x"}}
        assert [
            (c["step"], c["path"], c["nbytes"], c["valid"])
            for c in repo.list_checkpoints(session=s, run_id=parent)
        ] == [(2, "ckpt/2.pt", 123, True)]
        assert repo.skipped_batches(session=s, run_id=parent) == [(3, 7), (3, 8)]


def test_live_run_records_an_environment_fingerprint(store: Store) -> None:
    run = store.start_run(name="r")
    assert store.flush(20)
    with store.session() as s:
        _, env = repo.run_config(session=s, run_id=run)
    assert env["python"]["version"] and env["torch"]["version"]


def test_resume_continues_the_sequence(url: str) -> None:
    with open_store(url, config=StoreConfig(flush_interval=0.02)) as s1:
        run = s1.start_run(name="r", environment={})
        s1.write_steps(run_id=run, records=[StepRecord(0, {"loss": 1.0}), StepRecord(1, {"loss": 2.0})])
        s1.end_run(run_id=run, status="crashed")
    with open_store(url, config=StoreConfig(flush_interval=0.02)) as s2:
        assert s2.start_run(name="r", resume_run_id=run, environment={}) == run
        s2.write_steps(run_id=run, records=[StepRecord(1, {"loss": 3.0})])
        assert s2.flush(20)
        with s2.session() as s:
            assert [r.metrics["loss"] for r in repo.load_steps(session=s, run_id=run)] == [1.0, 2.0, 3.0]
            assert repo.get_run(session=s, run_id=run).status == "running"


def test_resolve_run_by_id_prefix_name_and_latest(store: Store) -> None:
    a = store.start_run(name="same", environment={})
    b = store.start_run(name="same", environment={})
    c = store.start_run(name="unique", environment={}, run_id="abcdef123456")
    assert store.flush(20)
    with store.session() as s:
        assert repo.resolve_run(session=s, ref=a).id == a
        assert repo.resolve_run(session=s, ref="unique").id == c
        assert repo.resolve_run(session=s, ref="abcdef").id == c
        assert repo.resolve_run(session=s, ref="latest").id in {a, b, c}
        with pytest.raises(RunNotFoundError, match="2 runs named 'same'"):
            repo.resolve_run(session=s, ref="same")
        with pytest.raises(RunNotFoundError, match="no run matches 'zzz'"):
            repo.resolve_run(session=s, ref="zzz")


def test_alerts_are_recorded_and_updated_through_the_writer(store: Store) -> None:
    store.add_alert(alert_id="al1", run_id="r1", channel="slack://***", severity="error", status="queued",
                    dedup_key="stabmon-r1-inc", incident_id="inc", event_id=None, title="grad spike")
    store.update_alert(alert_id="al1", status="failed", attempts=1, error="HTTP 500")
    store.update_alert(alert_id="al1", status="sent", attempts=2, error=None)
    assert store.flush(10)
    with store.session() as s:
        [row] = repo.list_alerts(session=s, run_id="r1")
    assert (row["status"], row["attempts"], row["error"], row["dedup_key"]) == (
        "sent",
        2,
        None,
        "stabmon-r1-inc",
    )


def test_writer_and_readers_concurrently(store: Store) -> None:
    run = store.start_run(name="r", environment={})
    assert store.flush(20)  # readers look the run up by id; unknown ids are an error
    stop, seen, errors = threading.Event(), [], []

    def reader() -> None:
        while not stop.is_set():
            try:
                with Session(store.engine) as s:
                    seen.append(len(repo.load_steps(session=s, run_id=run)))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for step in range(2000):
        store.write_steps(run_id=run, records=[StepRecord(step, {"loss": float(step), "grad_norm": 1.0})])
    assert store.flush(60)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert seen == sorted(seen)  # readers only ever see whole committed batches, growing
    with store.session() as s:
        got = repo.load_steps(session=s, run_id=run)
    assert [r.step for r in got] == list(range(2000))
    assert store.stats.rows_written >= 6000 and store.stats.failures == 0


def test_state_after_close_and_reopen(url: str) -> None:
    s1 = open_store(url)
    run = s1.start_run(name="r", environment={})
    s1.write_steps(run_id=run, records=[StepRecord(0, {"loss": 1.0})])
    s1.close()  # drains
    s1.close()  # idempotent
    with open_store(url) as s2, s2.session() as s:
        assert len(repo.load_steps(session=s, run_id=run)) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"flush_interval": 0}, "store.flush_interval must be > 0, got 0"),
        ({"batch_max_rows": 0}, "store.batch_max_rows must be >= 1, got 0"),
        ({"retry_initial": 2.0, "retry_max": 1.0}, "store.retry_max must be >= store.retry_initial, got 1.0"),
        ({"close_timeout": -1}, "store.close_timeout must be > 0, got -1"),
        ({"poll_interval": -1.0}, "store.poll_interval must be >= 0, got -1.0"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StoreConfig(**kwargs)


@pytest.mark.parametrize(
    "bad", ["xyz://nowhere", "postgresql+psycopg://postgres@127.0.0.1:1/none", "not a url"]
)
def test_unopenable_url_is_a_one_line_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^store: cannot open '.*': ") as info:
        open_store(bad, config=StoreConfig(fail_fast=True))  # without it, a server that is down is waited for
    assert "\n" not in str(info.value)


def test_postgres_without_schema_says_to_upgrade(pg_url: str) -> None:
    with pytest.raises(SchemaNotReadyError, match=r"has no stabmon schema; run `stabmon db upgrade --db "):
        open_store(pg_url)


def test_fresh_sqlite_file_is_upgraded_and_password_is_hidden(tmp_path, pg_url: str) -> None:
    with open_store(f"sqlite:///{tmp_path / 'sub' / 'new.db'}") as s:
        assert (tmp_path / "sub" / "new.db").exists() and s.stats.failures == 0
    with_password = pg_url.replace("postgres@", "postgres:hunter2@")
    with pytest.raises(ValueError) as info:
        open_store(with_password)
    assert "hunter2" not in str(info.value)


def test_reading_an_unknown_run_is_an_error(store: Store) -> None:
    with store.session() as s, pytest.raises(RunNotFoundError, match="no run with id 'nope'"):
        repo.load_steps(session=s, run_id="nope")


def test_unknown_run_kind(store: Store) -> None:
    with pytest.raises(ValueError, match="store.start_run.kind must be one of"):
        store.start_run(name="x", kind="bogus")


@pytest.fixture(scope="module")
def shared_sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    url = f"sqlite:///{tmp_path_factory.mktemp('prop') / 'prop.db'}"
    s = open_store(url, config=StoreConfig(flush_interval=0.01))
    yield s
    s.close()


_names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"),
                 min_size=1, max_size=40)  # a NUL is refused by the store (stabmon.store.limits)
_records = st.lists(
    st.builds(
        StepRecord,
        step=st.integers(min_value=0, max_value=2**40),
        metrics=st.dictionaries(_names, st.floats(allow_nan=True, allow_infinity=True), max_size=8),
        batch_index=st.none() | st.integers(min_value=0, max_value=2**40),
        time=st.none() | st.floats(min_value=0, max_value=4e9),
    ),
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=_records)
def test_any_records_round_trip(shared_sqlite_store: Store, records: list[StepRecord]) -> None:
    store = shared_sqlite_store
    run = store.start_run(name="prop", environment={})
    store.write_steps(run_id=run, records=records)
    assert store.flush(20)
    with store.session() as s:
        records_equal(repo.load_steps(session=s, run_id=run), records)


def test_two_threads_writing_one_run_lose_nothing(store: Store) -> None:
    run = store.start_run(name="r", environment={})

    def produce(offset: int) -> None:
        for i in range(500):
            store.write_steps(run_id=run, records=[StepRecord(offset + i, {"loss": float(offset + i)})])

    threads = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.flush(30)
    with store.session() as s:
        steps = sorted(r.step for r in repo.load_steps(session=s, run_id=run))
    assert steps == list(range(500)) + list(range(1000, 1500))


def test_writes_after_close_are_counted_not_silently_lost(sqlite_url: str) -> None:
    store = open_store(sqlite_url)
    run = store.start_run(name="r", environment={})
    store.close()
    store.write_steps(run_id=run, records=[StepRecord(0, {"loss": 1.0, "grad_norm": 2.0})])
    assert store.stats.dropped_rows == 3


def test_in_memory_sqlite_for_tests() -> None:
    with open_store("sqlite://", config=StoreConfig(flush_interval=0.01)) as store:
        run = store.start_run(name="mem", environment={})
        store.write_steps(run_id=run, records=[StepRecord(0, {"loss": NAN})])
        store.write_events(run_id=run, events=chain())
        assert store.flush(20)
        with store.session() as s:
            assert math.isnan(repo.load_steps(session=s, run_id=run)[0].metrics["loss"])
            assert len(repo.load_events(session=s, run_id=run)) == 4


def test_sqlite_file_is_in_wal_mode(sqlite_url: str) -> None:
    import sqlite3

    from stabmon.store.database import sqlite_path

    with open_store(sqlite_url) as store:
        store.start_run(name="r", environment={})
        assert store.flush(20)
        with sqlite3.connect(sqlite_path(sqlite_url)) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _same_json(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return same(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(value=_json)
def test_json_codec_round_trips_non_finite_floats(value: object) -> None:
    import json

    from stabmon.store.codec import decode, encode

    text = json.dumps(encode(value), allow_nan=False)  # strict JSON, as PostgreSQL requires
    assert _same_json(decode(json.loads(text)), value)


def test_numpy_scalars_are_stored_as_plain_numbers(store: Store) -> None:
    import numpy as np

    run = store.start_run(name="r", environment={})
    rec = StepRecord(np.int64(3), {"loss": np.float32(0.5), "x": np.float64("nan")}, batch_index=np.int64(7))
    store.write_steps(run_id=run, records=[rec])
    assert store.flush(20) and store.stats.rejected_batches == 0
    with store.session() as s:
        [got] = repo.load_steps(session=s, run_id=run)
    assert (got.step, got.batch_index, got.metrics["loss"]) == (3, 7, 0.5) and math.isnan(got.metrics["x"])


def test_spool_accepts_numpy_scalars() -> None:
    import numpy as np

    from stabmon.store.batch import Batch

    b = Batch(hi=1, steps=[("r", 0, 0, None, None, {"loss": np.float32(1.5)})])
    assert Batch.from_json(b.to_json()).steps[0][5] == {"loss": 1.5}
