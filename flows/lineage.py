"""Artifact lineage: what an artifact was made from (above it), and what was made from it (below it).

``python -m flows.lineage URI`` prints both as a tree. By default it reads the lineage records
stored beside the run's artifacts on S3 (``{artifact}.lineage.json``, written by
``tasks.lineage.as_asset``), which last as long as the run; ``--source prefect`` reads the Prefect
API's ``prefect.asset.materialization.succeeded`` events instead (kept 7 days by default).
Example: a checkpoint's inputs are its trajectories and, above them, their task images; its
output is its eval report.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import httpx

EVENT = "prefect.asset.materialization.succeeded"
_RUN_FOLDERS = ("trajectories", "checkpoints", "dropped", "divergence", "summaries", "episodes")


def _events(api_url: str, body_filter: dict) -> list[dict]:
    body = {"filter": {"event": {"name": [EVENT]}, "occurred": {"since": "2000-01-01T00:00:00Z"}, **body_filter},
            "limit": 50}
    response = httpx.post(f"{api_url}/events/filter", json=body, timeout=30)
    response.raise_for_status()
    page = response.json()
    events = page["events"]
    while page.get("next_page"):  # the API pages at 50 events
        response = httpx.get(page["next_page"], timeout=30)
        response.raise_for_status()
        page = response.json()
        events += page["events"]
    return events


def upstream_of(api_url: str, uri: str) -> set[str]:
    """Assets the materializations of ``uri`` declared as dependencies."""
    return {r["prefect.resource.id"] for e in _events(api_url, {"resource": {"id": [uri]}})
            for r in e["related"] if r.get("prefect.resource.role") == "asset"}


def downstream_of(api_url: str, uri: str) -> set[str]:
    """Assets whose materializations declared ``uri`` as a dependency."""
    events = _events(api_url, {"related": {"resources_in_roles": [[uri, "asset"]]}})
    return {e["resource"]["prefect.resource.id"] for e in events} - {uri}


def walk(api_url: str, uri: str, direction: str, max_depth: int = 10) -> list[tuple[int, str]]:
    """Breadth-first (depth, asset) pairs reachable from ``uri`` upstream or downstream (Prefect events)."""
    step = upstream_of if direction == "upstream" else downstream_of
    seen, frontier, out = {uri}, [uri], []
    for depth in range(1, max_depth + 1):
        nxt = []
        for node in frontier:
            for other in sorted(step(api_url, node) - seen):
                seen.add(other)
                out.append((depth, other))
                nxt.append(other)
        if not nxt:
            break
        frontier = nxt
    return out


def run_root(uri: str) -> str:
    """The run folder holding an ``s3://`` artifact (``s3://bucket/prefix/run_id``).

    Raises:
        ValueError: ``uri`` is not an artifact inside a run folder.
    """
    parts = uri.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if part in _RUN_FOLDERS and i > 3:
            return "/".join(parts[:i])
    raise ValueError(f"{uri}: not an artifact of a run (expected s3://bucket/prefix/run_id/"
                     f"{{{','.join(_RUN_FOLDERS)}}}/...)")


def stored_inputs(fs, root: str) -> dict[str, list[str]]:
    """Every lineage record under the run folder ``root``: artifact -> its declared inputs."""
    fs.invalidate_cache()
    out = {}
    for path in (p for p in fs.find(root.removeprefix("s3://")) if p.endswith(".lineage.json")):
        record = json.loads(fs.cat_file(path))
        out[record["asset"]] = list(record["inputs"])
    return out


def tree(uri: str, inputs_of: Callable[[str], list[str]], outputs_of: Callable[[str], list[str]],
         max_depth: int = 10) -> list[str]:
    """Lines of the lineage tree of ``uri``: its inputs, recursively, above it; its outputs below it."""
    def branch(node: str, children: Callable[[str], list[str]], prefix: str, depth: int, seen: set) -> list[str]:
        kids = sorted(set(children(node)) - seen) if depth < max_depth else []
        lines = []
        for i, kid in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f"{prefix}{'└── ' if last else '├── '}{kid}")
            lines += branch(kid, children, prefix + ("    " if last else "│   "), depth + 1, seen | {node})
        return lines

    above = branch(uri, inputs_of, "  ", 0, set())
    below = branch(uri, outputs_of, "  ", 0, set())
    return ["made from (inputs):", *(above or ["  (none recorded)"]), uri,
            "used by (outputs):", *(below or ["  (none recorded)"])]


def main(argv: list[str] | None = None) -> int:
    """Print the lineage tree of an artifact URI."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri", help="asset key, e.g. s3://agentrl/runs/quickstart/checkpoints/v1")
    parser.add_argument("--source", choices=["s3", "prefect"], default="s3",
                        help="lineage records on S3 beside the artifacts (default) or Prefect's asset events")
    parser.add_argument("--api-url", default=None, help="Prefect API URL (default: PREFECT_API_URL)")
    args = parser.parse_args(argv)
    if args.source == "prefect":
        from prefect.settings import PREFECT_API_URL

        api_url = args.api_url or PREFECT_API_URL.value()
        if not api_url:
            print("error: no Prefect API: set PREFECT_API_URL or pass --api-url", file=sys.stderr)
            return 2
        lines = tree(args.uri, lambda n: list(upstream_of(api_url, n)), lambda n: list(downstream_of(api_url, n)))
    else:
        from infra.storage import s3_filesystem

        try:
            root = run_root(args.uri)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        records = stored_inputs(s3_filesystem(root.removeprefix("s3://").split("/")[0]), root)
        if args.uri.rstrip("/") not in records and not any(args.uri.rstrip("/") in v for v in records.values()):
            print(f"error: {args.uri}: no lineage record under {root} ({len(records)} artifact(s) have one)",
                  file=sys.stderr)
            return 2
        users: dict[str, list[str]] = {}
        for asset, inputs in records.items():
            for i in inputs:
                users.setdefault(i, []).append(asset)
        lines = tree(args.uri.rstrip("/"), lambda n: records.get(n, []), lambda n: users.get(n, []))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
