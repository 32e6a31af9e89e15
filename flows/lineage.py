"""Artifact lineage: what an artifact was made from (above it), and what was made from it (below it).

``python -m flows.lineage URI`` prints both as a tree (``--depth N`` bounds it). By default it reads the
lineage records stored beside the artifacts on S3 (``{artifact}.lineage.json``, written by
``tasks.lineage.as_asset``; ``infra.lineage``), which last as long as the run, following inputs into other
runs' folders; ``--source prefect`` reads the Prefect API's ``prefect.asset.materialization.succeeded``
events and their payloads instead (kept 7 days by default). Example: checkpoint v2's inputs are its
parent v1 and step 1's trajectories; those trajectories' inputs are their task images and the policy
versions that sampled their tokens (with the token counts); v1's parent is the base model; v2's output is
its eval report, made from v2 and the held-out task images in the serving dtype.
"""

from __future__ import annotations

import argparse
import functools
import sys

import httpx

from infra.config import StorageConfig
from infra.lineage import StoredLineage, run_root, tree

EVENT = "prefect.asset.materialization.succeeded"


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


def _newest(api_url: str, uri: str) -> dict | None:
    events = _events(api_url, {"resource": {"id": [uri]}})
    return max(events, key=lambda e: e["occurred"]) if events else None


def upstream_of(api_url: str, uri: str) -> set[str]:
    """Assets the newest materialization of ``uri`` declared as dependencies.

    The newest only, as the record stored beside the artifact: a stage run again (a resumed step, a run id
    reused) declares what it used then, and the older events are history, not inputs.
    """
    event = _newest(api_url, uri)
    return {r["prefect.resource.id"] for r in (event or {}).get("related", [])
            if r.get("prefect.resource.role") == "asset"}


def downstream_of(api_url: str, uri: str) -> set[str]:
    """Assets whose newest materialization declared ``uri`` as a dependency."""
    events = _events(api_url, {"related": {"resources_in_roles": [[uri, "asset"]]}})
    return {key for key in {e["resource"]["prefect.resource.id"] for e in events} - {uri}
            if uri in upstream_of(api_url, key)}


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


def payload_of(api_url: str, uri: str) -> dict:
    """The payload (materialization metadata) of the newest materialization of ``uri`` ({} when none)."""
    event = _newest(api_url, uri)
    return dict(event.get("payload") or {}) if event else {}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--depth {text}: expected a whole number of levels >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    """Print the lineage tree of an artifact URI."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri", help="asset key, e.g. s3://agentrl/runs/quickstart/checkpoints/v1")
    parser.add_argument("--source", choices=["s3", "prefect"], default="s3",
                        help="lineage records on S3 beside the artifacts (default) or Prefect's asset events")
    parser.add_argument("--api-url", default=None, help="Prefect API URL (default: PREFECT_API_URL)")
    parser.add_argument("--depth", type=_positive, default=None, help="levels shown above and below (default: all)")
    parser.add_argument("--runs", default=f"s3://{StorageConfig().bucket}/{StorageConfig().prefix}",
                        help="the folder of runs in which a model:// key's records and users are looked for "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    uri = args.uri.rstrip("/")
    if args.source == "prefect":
        from prefect.settings import PREFECT_API_URL

        api_url = args.api_url or PREFECT_API_URL.value()
        if not api_url:
            print("error: no Prefect API: set PREFECT_API_URL or pass --api-url", file=sys.stderr)
            return 2

        def cached(query):  # one API call per node and question
            return functools.lru_cache(maxsize=None)(lambda n: query(api_url, n))

        try:
            lines = tree(uri, cached(upstream_of), cached(downstream_of), cached(payload_of), args.depth)
        except httpx.HTTPError as e:
            print(f"error: Prefect API {api_url}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    else:
        from infra.storage import s3_filesystem

        try:
            root = args.runs.rstrip("/") if uri.startswith("model://") else run_root(uri)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        stored = StoredLineage(s3_filesystem(root.removeprefix("s3://").split("/")[0]), runs=args.runs)
        if uri.startswith("model://"):
            stored.load_runs(root)
        records = stored.load(root) if not uri.startswith("model://") else {}
        known = stored.record_of(uri) is not None or any(uri in r["inputs"] for r in records.values()) or (
            uri.startswith("model://") and stored.outputs(uri))
        if not known:
            print(f"error: {args.uri}: no lineage record under {root}", file=sys.stderr)
            return 2
        lines = tree(uri, stored.inputs, stored.outputs, stored.properties, args.depth)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
