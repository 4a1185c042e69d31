"""The events a replay produces on every recorded run of a folder, one digest per file: the check that a change
to the replay path (a faster detector, a leaner suite) leaves every anomaly, decision and outcome as it was.

    python benchmarks/replay_events.py DIR [--save FILE] [--check FILE] [--runbook default]

Each file stabmon can import is replayed with the default detectors and the runbook, interventions simulated;
its events (random ids replaced by ordinals, :func:`stabmon.replay.replay.canonical`) are serialised as JSON
and hashed. ``--save`` writes ``{file: digest}``; ``--check`` compares with a saved one and lists every file
whose events differ (exit status 1 if any). A file no importer recognises (a README) is listed as skipped; under
``--check`` a run file that stops being recognised still shows, as one whose events differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SKIP = {"LABELS.csv", "SOURCES.md", "metadata.tsv", "runs.tsv"}


def digest(path: Path, runbook: str) -> tuple[str, int]:
    """The sha256 of the canonical events of one file's replay, and how many events there were."""
    from stabmon.replay.importers.sniff import import_file
    from stabmon.replay.replay import canonical, replay, simulated_pipeline

    with import_file(path) as imported:
        pipeline, target = simulated_pipeline(runbook=runbook)
        records = (r for batch in imported.batches(4096) for r in batch)
        events = replay(records, pipeline=pipeline, target=target).events
    text = json.dumps(canonical(events), sort_keys=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest(), len(events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--runbook", default="default")
    ap.add_argument("--save", type=Path, default=None)
    ap.add_argument("--check", type=Path, default=None)
    args = ap.parse_args()
    files = sorted(p for p in args.folder.rglob("*") if p.is_file() and p.name not in SKIP)
    found: dict[str, str] = {}
    from stabmon.replay.importers.sniff import UnknownFormatError

    for path in files:
        name = str(path.relative_to(args.folder))
        try:
            found[name], count = digest(path, args.runbook)
        except UnknownFormatError:
            print(f"{'skipped':16}  not a recorded run  {name}")
            continue
        print(f"{found[name][:16]}  {count:5d} events  {name}")
    if args.save is not None:
        args.save.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    if args.check is not None:
        saved = json.loads(args.check.read_text())
        differ = sorted(n for n in saved.keys() | found.keys() if saved.get(n) != found.get(n))
        print(f"{len(found) - len(differ)} of {len(found)} files give the same events"
              + (f"; differ: {', '.join(differ)}" if differ else ""))
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
