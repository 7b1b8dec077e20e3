"""The summary bench/gpu_check.sh writes: one JSON file from pytest's JUnit XML of the cuda
tier, the figures its tests recorded (tests/support/gpu_figures.py) and the peer benchmarks' results
(``python -m bench.peers``' JSON, one per model)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import xml.etree.ElementTree as ET
from typing import Optional

import torch

from .runs import machine

LIMIT_S = 480
"""What the whole check (the tier and the peers) should take on one H200."""


def outcomes(junit_path: str) -> list[dict]:
    """Each test case: its pytest id, outcome, seconds and, unless it passed, the first line
    of why."""
    if not os.path.exists(junit_path):
        return []
    cases = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        outcome, why = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                why = (found.get("message") or found.text or "").strip().splitlines()[:1]
                why = why[0] if why else ""
                break
        cases.append({"test": f"{module}.py::{case.get('name')}", "outcome": outcome,
                      "seconds": round(float(case.get("time", 0.0)), 2), "why": why})
    return cases


def count_outcomes(tests: list[dict]) -> dict[str, int]:
    """How many of ``outcomes()``'s tests passed, failed, errored, were skipped."""
    return dict(collections.Counter(t["outcome"] for t in tests))


def figures(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def peer_runs(paths: list[str]) -> dict:
    """Each peer benchmark by its file's name: its rows, targets and notes, and whether it
    failed (its file missing, a peer that crashed or ran out of time, losses that disagree)."""
    runs = {}
    for path in paths:
        name = os.path.basename(path)[:-len(".json")]
        if not os.path.exists(path):
            runs[name] = {"failed": True, "why": f"{path} was not written: the run crashed"}
            continue
        with open(path) as f:
            result = json.load(f)
        failed_peers = result.get("failed_peers", [])
        runs[name] = {"failed": bool(failed_peers or result.get("loss_failures")),
                      "failed_peers": failed_peers,
                      "loss_failures": result.get("loss_failures", []),
                      "description": result.get("description"),
                      "summaries": [{k: v for k, v in s.items() if k not in ("losses", "step_s")}
                                    for s in result.get("summaries", [])],
                      "targets": result.get("targets", []), "notes": result.get("notes", [])}
    return runs


def verdict(status: int, counts: dict, peers: Optional[dict] = None) -> str:
    """"passed" only when pytest exited 0 and every test that ran passed; "skipped" when none
    ran (no GPU); "failed" otherwise (a failure, an error, an interrupted or crashed run, a peer
    benchmark that failed: ``peer_runs``)."""
    if counts.get("failed") or counts.get("error") or status not in (0, 5):
        return "failed"
    if any(run["failed"] for run in (peers or {}).values()):
        return "failed"
    return "passed" if counts.get("passed") or peers else "skipped"


def device() -> dict:
    if not torch.cuda.is_available():
        return {"name": None, "note": "torch sees no CUDA device: the tier was skipped"}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory, "count": torch.cuda.device_count()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--junit", required=True)
    p.add_argument("--figures", required=True)
    p.add_argument("--status", type=int, required=True, help="pytest's exit status")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--commit", default="unknown", help="the git commit the tier ran at")
    p.add_argument("--peers", nargs="*", default=[], metavar="JSON",
                   help="the peer benchmarks' results (python -m bench.peers --name ...)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    tests = outcomes(args.junit)
    counts = count_outcomes(tests)
    peers = peer_runs(args.peers)
    summary = {"verdict": verdict(args.status, counts, peers), "commit": args.commit,
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
               "device": device(), "machine": machine(), "pytest_status": args.status,
               "seconds": args.seconds, "within_limit": args.seconds <= LIMIT_S,
               "counts": counts, "tests": tests, "figures": figures(args.figures),
               "peers": peers}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    for name, run in peers.items():
        print(f"{name}: {'FAILED' if run['failed'] else 'ran'} "
              f"{', '.join(s['peer'] for s in run.get('summaries', []))}")
    print(f"{args.out}: {summary['verdict']}: {counts or 'no tests ran'} in {args.seconds:.0f} s "
          f"({'within' if summary['within_limit'] else 'OVER'} the {LIMIT_S} s limit)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
