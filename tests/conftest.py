"""Shared fixtures: real-data location, PostgreSQL availability, temporary SQLite stores.

PostgreSQL tests use the server named by ``STABMON_TEST_PG_URL`` (default: the local server at 127.0.0.1:5432,
database ``test``). Where it cannot be reached they skip with the reason, unless ``STABMON_REQUIRE_POSTGRES=1``
(set by ``.ci/run``), which turns the skip into a failure. Real recorded runs are read in place from
``STABMON_REAL_RUNS`` or ``../shared/data/real-runs`` beside the checkout; ``STABMON_REQUIRE_REAL_RUNS=1`` makes
their absence a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

collect_ignore = ["nanogpt"]  # nanoGPT's train.py runs at import; tests/test_nanogpt_patch.py runs it in a copy

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").lower() in {"1", "true", "yes"}


def _skip_or_fail(reason: str, required_by: str) -> None:
    if _truthy(required_by):
        pytest.fail(f"{reason} ({required_by}=1 forbids skipping)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def real_runs() -> Path:
    """The directory of third-party recorded runs with LABELS.csv."""
    path = Path(os.environ.get("STABMON_REAL_RUNS", REPO.parent / "shared" / "data" / "real-runs"))
    if not (path / "LABELS.csv").is_file():
        _skip_or_fail(f"real recorded runs not found at {path} (set STABMON_REAL_RUNS)", "STABMON_REQUIRE_REAL_RUNS")
    return path


@pytest.fixture(scope="session")
def real_finetunes() -> Path:
    """The directory of third-party Hugging Face ``trainer_state.json`` records with LABELS.csv."""
    path = Path(os.environ.get("STABMON_REAL_FINETUNES", REPO.parent / "shared" / "data" / "real-finetunes"))
    if not (path / "LABELS.csv").is_file():
        _skip_or_fail(f"real fine-tune records not found at {path} (set STABMON_REAL_FINETUNES)",
                      "STABMON_REQUIRE_REAL_RUNS")
    return path


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    """URL of a reachable PostgreSQL server, or skip (fail under STABMON_REQUIRE_POSTGRES=1)."""
    url = os.environ.get("STABMON_TEST_PG_URL", DEFAULT_PG_URL)
    try:
        import sqlalchemy as sa

        engine = sa.create_engine(url)
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        _skip_or_fail(f"PostgreSQL not reachable at {url}: {type(exc).__name__}: {exc}".splitlines()[0],
                      "STABMON_REQUIRE_POSTGRES")
    return url


@pytest.fixture
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = f"stabmon_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(pg_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A real SQLite file in a temporary directory."""
    return f"sqlite:///{tmp_path / 'stabmon.db'}"


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Examples pin torch's intra-op thread count for reproducibility; do not let that leak into other tests."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        yield
        return
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_url(request: pytest.FixtureRequest) -> str:
    """An upgraded store on each backend in turn: a real SQLite file, then a fresh PostgreSQL database."""
    from stabmon.store.database import upgrade

    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    upgrade(url)
    return url
