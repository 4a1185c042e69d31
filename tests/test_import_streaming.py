"""Importers read in bounded memory: the step table that spills to a temporary file, CSV read in blocks, and
the same records either way - on generated operations, on tricky CSV text and on every real recorded run."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stabmon.replay.importers import table as table_mod
from stabmon.replay.importers import tabular
from stabmon.replay.importers.sniff import UnknownFormatError, import_file, sniff_format
from stabmon.replay.importers.table import StepTable

steps_ = st.integers(-3, 12)
metrics_ = st.dictionaries(st.sampled_from(["loss", "lr", "grad_norm"]), st.floats(allow_nan=False), max_size=2)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("merge"), steps_, metrics_, st.one_of(st.none(), st.floats(0, 1e9))),
        st.tuples(st.just("put"), steps_, metrics_, st.none()),
        st.tuples(st.just("put_new"), steps_, metrics_, st.none()),
        st.tuples(st.just("drop_from"), steps_, st.just({}), st.none()),
    ),
    max_size=60,
)


def _model(operations: list[tuple[str, int, dict[str, float], float | None]]) -> list[tuple[int, dict, float | None]]:
    """What a plain dict does with the same operations (the importers' code before the table)."""
    rows: dict[int, tuple[dict[str, float], float | None]] = {}
    for op, step, metrics, time in operations:
        if op == "merge":
            old = rows.get(step, ({}, None))
            rows[step] = ({**old[0], **metrics}, time)
        elif op == "put" or (op == "put_new" and step not in rows):
            rows[step] = (dict(metrics), None)
        elif op == "drop_from":
            rows = {s: v for s, v in rows.items() if s < step}
    return [(s, m, t) for s, (m, t) in sorted(rows.items())]


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 4))
def test_the_table_holds_what_a_dict_holds_however_often_it_spills(operations: list, hot_limit: int) -> None:
    t = StepTable(hot_limit=hot_limit)
    for op, step, metrics, time in operations:
        if op == "merge":
            t.merge(step, metrics, time)
        elif op == "drop_from":
            t.drop_from(step)
        else:
            getattr(t, op)(step, metrics)
    want = _model(operations)
    got = [(r.step, dict(r.metrics), r.time) for b in t.batches(3) for r in b]
    assert got == want and len(t) == len(want)
    assert t.bounds() == ((want[0][0], want[-1][0]) if want else (None, None))
    t.close()


def test_bad_hot_limit_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match=r"^StepTable.hot_limit: must be at least 1, got 0$"):
        StepTable(hot_limit=0)


@pytest.mark.parametrize(
    "text",
    [
        b"step,loss\n1,2.0\n2,1.9\n3,1.8",
        b"\xef\xbb\xbfstep,loss\r\n1,2.0\r\n\r\n2,1.9\r\n",
        b"\n\r\nstep,note\n1,\"two\nlines, and a comma\"\n2,\"\"\"quoted\"\"\"\n3,x\n",
        b'"step","lo\nss"\n"1","2.5"\n"2",""\n',
        b"step,loss\n1,2.0,extra\n2\n\xff\xfe,3\n",
        b"step\tloss\n1\t2.0\n",
    ],
    ids=["plain", "bom-crlf-blank", "quoted-newlines", "quoted-header", "ragged-bad-utf8", "tsv"],
)
@pytest.mark.parametrize("block", [1, 7, 1 << 20])
def test_csv_read_in_blocks_gives_the_rows_of_one_whole_read(tmp_path: Path, text: bytes, block: int) -> None:
    p = tmp_path / "t.csv"
    p.write_bytes(text)
    sep = "\t" if b"\t" in text.split(b"\n")[0] else ","
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = pl.read_csv(io.BytesIO(text), separator=sep, infer_schema=False, truncate_ragged_lines=True,
                            encoding="utf8-lossy", ignore_errors=True, quote_char='"')
    t = tabular.open_table(p, block_bytes=block)
    assert t.columns == whole.columns
    assert list(t.rows) == list(whole.iter_rows(named=True))


def _records(path: Path) -> tuple:
    r = import_file(path)
    records = [(x.step, list(x.metrics.items()), x.time) for x in r.records]
    return r.format, records, r.malformed, r.problems, r.restarts, r.events


def _sniffs(path: Path) -> bool:
    try:
        sniff_format(path)
    except UnknownFormatError:
        return False
    return path.name != "LABELS.csv"


def test_every_real_run_reads_the_same_with_tiny_blocks_and_a_spilling_table(
    real_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [p for p in sorted(real_runs.rglob("*")) if p.is_file() and p.suffix != ".md" and _sniffs(p)]
    default = {p: _records(p) for p in files}
    monkeypatch.setattr(table_mod, "HOT_LIMIT", 3)
    monkeypatch.setattr(tabular, "BLOCK_BYTES", 4096)
    monkeypatch.setitem(tabular.open_table.__kwdefaults__, "block_bytes", 4096)
    spilled = 0
    for p in files:
        assert _records(p) == default[p], p.name
        spilled += len(default[p][1]) > 3
    assert spilled >= 10 and sum(len(v[1]) for v in default.values()) > 100_000


def test_events_are_kept_up_to_a_bound_and_counted(tmp_path: Path) -> None:
    from stabmon.replay.importers import megatron
    from stabmon.replay.importers.base import ImportResult

    over = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4096.0, reducing to 2048.0\n"
    it = " iteration {}/ 5000 | lm loss: 2.0 | loss scale: 2048.0 | grad norm: 1.0 |\n"
    p = tmp_path / "log.txt"
    p.write_text("".join(over + it.format(s) for s in range(1, 1501)))
    r = megatron.read(p)
    assert len(r.events) == ImportResult.MAX_EVENTS and r.events_total == 1500
    assert len(r) == 1500 and all(x.metrics["overflow"] == 1.0 for x in r.records)
