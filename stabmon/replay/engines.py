"""Where the offline commands run their independent pieces of work: this process, a local process pool, or Ray.

``stabmon eval`` and ``stabmon tune`` replay many runs; a replay is sequential within a run and independent
across runs, so each run is one piece of work (one task), and an engine maps a function over them, returning the
results in the order of the items whatever order they finish in::

    evaluate(..., engine=...) ──> engine.map(fn, [run 1, run 2, ...]) ──> [result 1, result 2, ...]
                                    │
                                    ├─ LocalEngine(jobs=1): in this process, one after another
                                    ├─ LocalEngine(jobs>1): a pool of spawned processes (the default: ``--jobs``)
                                    └─ RayEngine: one Ray task per item (``--engine ray``, the ``ray`` extra)

``fn`` and the items cross to other processes (pickled), so they are module-level functions (or
``functools.partial`` of one) and plain values; each task reads its run's files itself. Ray is imported only
when a :class:`RayEngine` runs: nothing else needs it installed.

A :class:`RayEngine` joins the cluster at ``address`` (or ``RAY_ADDRESS``) when one is given; otherwise it starts
a local Ray instance with ``workers`` CPUs and no dashboard, and shuts it down when the map is done. A Ray already
initialised by the caller is used as it is and left running.

>>> LocalEngine(jobs=1).map(abs, [-2, 3, -4])
[2, 3, 4]
>>> make_engine("spark")
Traceback (most recent call last):
...
ValueError: --engine must be one of local, ray, got 'spark'
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

ENGINES = ("local", "ray")
RAY_MISSING = "--engine ray needs the ray extra: pip install 'stabmon[ray]'"


class Engine(Protocol):
    """Maps a function over independent items; results in the items' order."""

    name: str
    distributed: bool
    """Items may run on other machines: each task reads its own input, and nothing is loaded once per worker
    beforehand (a local pool's workers may load shared input once, in an initializer)."""

    def map(
        self, fn: Callable[[T], R], items: Sequence[T], *, progress: Callable[[int], None] | None = None
    ) -> list[R]: ...


def spawn_context() -> Any:
    """Worker processes are spawned, never forked: polars' thread pool (used to read the logs) does not
    survive a fork of a process that already used it, and the workers would hang."""
    return multiprocessing.get_context("spawn")


class LocalEngine:
    """``jobs`` processes on this machine (1: this process, no pool).

    >>> LocalEngine(jobs=2).map(str, [7])  # one item: no pool is started for it
    ['7']
    """

    name = "local"
    distributed = False

    def __init__(self, jobs: int = 1) -> None:
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        self.jobs = jobs

    def map(
        self, fn: Callable[[T], R], items: Sequence[T], *, progress: Callable[[int], None] | None = None
    ) -> list[R]:
        if self.jobs == 1 or len(items) <= 1:
            out = []
            for item in items:
                out.append(fn(item))
                if progress:
                    progress(1)
            return out
        results: dict[int, R] = {}
        with ProcessPoolExecutor(max_workers=self.jobs, mp_context=spawn_context()) as pool:
            futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if progress:
                    progress(1)
        return [results[i] for i in range(len(items))]


class RayEngine:
    """One Ray task (1 CPU) per item, on the cluster at ``address`` / ``RAY_ADDRESS``, else on a local instance
    of ``workers`` CPUs; raises ValueError (:data:`RAY_MISSING`) when ray is not installed."""

    name = "ray"
    distributed = True

    def __init__(self, workers: int = 1, address: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"--jobs must be >= 1, got {workers}")
        if importlib.util.find_spec("ray") is None:
            raise ValueError(RAY_MISSING)
        self.workers = workers
        self.address = address or os.environ.get("RAY_ADDRESS") or None

    def map(
        self, fn: Callable[[T], R], items: Sequence[T], *, progress: Callable[[int], None] | None = None
    ) -> list[R]:
        if not items:
            return []
        ray = _import_ray()
        started = not ray.is_initialized()
        if started:
            if self.address:
                ray.init(address=self.address, logging_level=logging.WARNING)
            else:
                ray.init(num_cpus=self.workers, include_dashboard=False, logging_level=logging.WARNING)
        try:
            task = ray.remote(num_cpus=1, max_retries=0)(_call)
            fn_ref = ray.put(fn)  # shipped once, not with every task
            pending = {task.remote(fn_ref, item): i for i, item in enumerate(items)}
            results: dict[int, R] = {}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    results[pending.pop(ref)] = ray.get(ref)
                    if progress:
                        progress(1)
            return [results[i] for i in range(len(items))]
        finally:
            if started:
                ray.shutdown()


def _call(fn: Callable[[T], R], item: T) -> R:
    """A Ray task: ``fn(item)`` (Ray wraps plain functions only; ``fn`` may be a ``functools.partial``)."""
    return fn(item)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    return ray


def make_engine(name: str, *, jobs: int = 1, address: str | None = None) -> Engine:
    """The engine named by ``--engine``: ``local`` (``jobs`` processes) or ``ray`` (``jobs`` CPUs of a local
    instance, or the cluster at ``address`` / ``RAY_ADDRESS``); a one-line ValueError otherwise."""
    if name == "local":
        return LocalEngine(jobs)
    if name == "ray":
        return RayEngine(jobs, address)
    raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {name!r}")
