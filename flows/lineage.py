"""Artifact lineage from Prefect asset events: what an artifact was made from, and what was made from it.

``python -m flows.lineage URI`` queries the Prefect API (``PREFECT_API_URL``) for
``prefect.asset.materialization.succeeded`` events and walks them both ways: upstream through the
assets an event names as related (``asset_deps``), downstream through events that name ``URI`` as
related. Example: a checkpoint's upstream is its trajectories and their task images; its
downstream is its eval report.
"""

from __future__ import annotations

import argparse
import sys

import httpx

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


def upstream_of(api_url: str, uri: str) -> set[str]:
    """Assets the materializations of ``uri`` declared as dependencies."""
    return {r["prefect.resource.id"] for e in _events(api_url, {"resource": {"id": [uri]}})
            for r in e["related"] if r.get("prefect.resource.role") == "asset"}


def downstream_of(api_url: str, uri: str) -> set[str]:
    """Assets whose materializations declared ``uri`` as a dependency."""
    events = _events(api_url, {"related": {"resources_in_roles": [[uri, "asset"]]}})
    return {e["resource"]["prefect.resource.id"] for e in events} - {uri}


def walk(api_url: str, uri: str, direction: str, max_depth: int = 10) -> list[tuple[int, str]]:
    """Breadth-first (depth, asset) pairs reachable from ``uri`` upstream or downstream."""
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


def main(argv: list[str] | None = None) -> int:
    """Print the upstream and downstream of an artifact URI."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri", help="asset key, e.g. s3://agentrl/runs/quickstart/checkpoints/v1")
    parser.add_argument("--api-url", default=None, help="Prefect API URL (default: PREFECT_API_URL)")
    args = parser.parse_args(argv)
    from prefect.settings import PREFECT_API_URL

    api_url = args.api_url or PREFECT_API_URL.value()
    if not api_url:
        print("error: no Prefect API: set PREFECT_API_URL or pass --api-url", file=sys.stderr)
        return 2
    for direction in ("upstream", "downstream"):
        print(f"{direction} of {args.uri}:")
        nodes = walk(api_url, args.uri, direction)
        for depth, node in nodes:
            print(f"{'  ' * depth}{node}")
        if not nodes:
            print("  (none recorded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
