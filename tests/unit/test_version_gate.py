"""The server-side version stamp and update drain (infra.rollout.version_gate), on a stand-in ASGI app."""

import asyncio

import httpx
import pytest

from infra.rollout.version_gate import VERSION_ENV, VERSION_HEADER, VersionGateMiddleware


class SlowApp:
    """Answers 200 to anything; a generation request waits for ``release`` (a request in flight)."""

    def __init__(self):
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(self, scope, receive, send):
        if scope["path"] == "/v1/completions":
            self.started += 1
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")


def test_an_update_waits_for_every_request_in_flight_and_later_ones_carry_the_new_version(monkeypatch):
    monkeypatch.setenv(VERSION_ENV, "3")

    async def scenario():
        inner = SlowApp()
        gate = VersionGateMiddleware(inner)
        async with _client(gate) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={}))
            while not inner.started:
                await asyncio.sleep(0.01)
            pause = asyncio.create_task(c.post("/agentrl/pause"))
            await asyncio.sleep(0.1)
            assert not pause.done()  # the request in flight holds the update
            held = asyncio.create_task(c.post("/v1/completions", json={}))
            await asyncio.sleep(0.1)
            assert inner.started == 1  # admitted only after resume
            inner.release.set()
            r1 = await first
            assert r1.headers[VERSION_HEADER] == "3"  # sampled by the weights it was admitted under
            assert (await pause).json() == {"version": 3, "paused": True, "in_flight": 0, "unversioned": False}
            await asyncio.sleep(0.1)
            assert not held.done()
            resumed = await c.post("/agentrl/resume", params={"version": 4})
            assert resumed.json()["version"] == 4 and not resumed.json()["paused"]
            assert (await held).headers[VERSION_HEADER] == "4"
            other = await c.get("/health")
            assert VERSION_HEADER not in other.headers  # only generation responses are stamped
            assert (await c.get("/agentrl/version")).json() == {"version": 4, "paused": False, "in_flight": 0,
                                                                "unversioned": False}

    asyncio.run(scenario())


def test_a_pause_never_resumed_ends_with_its_lease():
    async def scenario():
        inner = SlowApp()
        inner.release.set()
        async with _client(VersionGateMiddleware(inner)) as c:
            await c.post("/agentrl/pause", params={"lease_s": 0.2})
            held = asyncio.create_task(c.post("/v1/completions", json={}))
            await asyncio.sleep(0.05)
            assert not held.done()
            r = await asyncio.wait_for(held, timeout=5)
            assert r.status_code == 200 and r.headers[VERSION_HEADER] == "0"  # the version did not change

    asyncio.run(scenario())


def test_the_lease_runs_from_the_end_of_the_drain_and_a_pause_resumed_meanwhile_says_so():
    async def scenario():
        inner = SlowApp()
        async with _client(VersionGateMiddleware(inner)) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={}))
            while not inner.started:
                await asyncio.sleep(0.01)
            pause = asyncio.create_task(c.post("/agentrl/pause", params={"lease_s": 0.1}))
            await asyncio.sleep(0.4)  # longer than the lease: still draining, still paused
            inner.release.set()
            assert (await pause).json()["paused"] is True
            await first
            inner.release.clear()
            second = asyncio.create_task(c.post("/v1/completions", json={}))  # admitted once the lease ends
            while inner.started < 2:
                await asyncio.sleep(0.01)
            pause = asyncio.create_task(c.post("/agentrl/pause"))
            await asyncio.sleep(0.1)
            await c.post("/agentrl/resume", params={"version": 1})  # another client ends the pause mid-drain
            inner.release.set()
            assert (await pause).status_code == 409
            await second

    asyncio.run(scenario())


def test_weights_changed_under_a_lapsed_pause_refuse_samples_until_a_version_is_set():
    async def scenario():
        inner = SlowApp()
        inner.release.set()
        async with _client(VersionGateMiddleware(inner)) as c:
            await c.post("/agentrl/pause", params={"lease_s": 0.1})
            await c.post("/collective_rpc", json={})  # the updating client dies after this
            await asyncio.sleep(0.3)
            refused = await c.post("/v1/completions", json={})
            assert refused.status_code == 503 and "never said their version" in refused.json()["error"]
            assert (await c.get("/agentrl/version")).json()["unversioned"] is True
            await c.post("/agentrl/version", params={"version": 2})  # the run's engine, reconnecting, says it
            assert (await c.post("/v1/completions", json={})).headers[VERSION_HEADER] == "2"
            await c.post("/agentrl/pause", params={"lease_s": 0.1})  # a pause that changed nothing just ends
            await asyncio.sleep(0.3)
            assert (await c.post("/v1/completions", json={})).status_code == 200

    asyncio.run(scenario())


def test_bad_control_requests_are_refused_by_name(monkeypatch):
    async def scenario():
        async with _client(VersionGateMiddleware(SlowApp())) as c:
            r = await c.post("/agentrl/resume")
            assert r.status_code == 400 and "?version=<int>" in r.json()["error"]
            assert (await c.post("/agentrl/resume", params={"version": "x"})).status_code == 400
            r = await c.post("/agentrl/pause", params={"lease_s": "soon"})
            assert r.status_code == 400 and "lease_s" in r.json()["error"]
            r = await c.get("/agentrl/pause")
            assert r.status_code == 404 and "GET /agentrl/pause" in r.json()["error"]
            assert (await c.post("/agentrl/version")).status_code == 400

    asyncio.run(scenario())
    monkeypatch.setenv(VERSION_ENV, "v2")
    with pytest.raises(ValueError, match=VERSION_ENV):
        VersionGateMiddleware(SlowApp())


def test_a_declared_version_is_stamped_and_leaves_an_update_in_progress_alone():
    async def scenario():
        inner = SlowApp()
        inner.release.set()
        async with _client(VersionGateMiddleware(inner)) as c:
            assert (await c.post("/agentrl/version", params={"version": 7})).json()["version"] == 7
            assert (await c.post("/v1/completions", json={})).headers[VERSION_HEADER] == "7"
            await c.post("/agentrl/pause")
            declared = await c.post("/agentrl/version", params={"version": 8})
            assert declared.json() == {"version": 8, "paused": True, "in_flight": 0, "unversioned": False}

    asyncio.run(scenario())
