"""The control API over real HTTP (uvicorn on a port): auth on every mutating route (the
routes are enumerated from the app, not listed here), names never become paths, bodies
are bounded and validated, every authenticated change is audited with the token's name,
and an unconfirmed apply is reverted."""
from __future__ import annotations

import http.client
import json
import time

import httpx
import pytest
from support import api_routes

from gpuguard.control.actions import Actions
from gpuguard.control.auth import AccessPolicy, TokenStore
from gpuguard.sinks.api import build_app
from gpuguard.sinks.metrics import MetricsSink

pytestmark = [pytest.mark.network]  # registered in pyproject.toml


# A valid value per path parameter: a refused call must be refused for the auth, not the name.
VALID = {"gpu": "gpu0", "engine": "vllm-a", "cache": "vllm-compile"}
OPEN_GETS = {"/healthz", "/openapi.json"}
# one client for the module: a new httpx client per call costs an SSL context each
HTTP = httpx.Client(timeout=10)


def routes(app, mutating: bool) -> list[tuple[str, str]]:
    out = []
    for r in api_routes(app):
        for m in sorted(r.methods):
            if (m not in ("GET", "HEAD")) == mutating:
                out.append((m, r.path))
    return out


def fill(path: str, **override: str) -> str:
    names = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
    unknown = [n for n in names if n not in VALID]
    assert not unknown, f"add a valid value for path parameter(s) {unknown} to VALID"
    return path.format(**{n: override.get(n, VALID[n]) for n in names})


def body_for(path: str) -> dict:
    return {"profile": "quiet", "reason": "test"} if path.endswith("/apply") else {"reason": "test"}


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def raw(port: int, method: str, target: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, bytes]:
    """One request with the target sent byte for byte (httpx would normalise `..`)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.putrequest(method, target, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            c.putheader(k, v)
        c.putheader("Content-Length", str(len(body)))
        c.endheaders(body)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_the_issue_routes_exist(api):
    got = set(routes(api.app, True)) | set(routes(api.app, False))
    for m, p in [
        ("GET", "/v1/status"), ("GET", "/v1/gpus"), ("GET", "/v1/gpus/{gpu}"), ("GET", "/v1/pcie"),
        ("GET", "/v1/events"), ("GET", "/v1/engines"), ("GET", "/v1/profiles"), ("GET", "/healthz"),
        ("GET", "/metrics"), ("POST", "/v1/gpus/{gpu}/apply"), ("POST", "/v1/gpus/{gpu}/confirm"),
        ("POST", "/v1/gpus/{gpu}/reset"), ("POST", "/v1/engines/{engine}/kill"),
        ("POST", "/v1/engines/{engine}/restart"), ("POST", "/v1/caches/{cache}/quarantine"),
    ]:
        assert (m, p) in got, f"{m} {p} missing"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789abcdef"},
        {"Authorization": "Basic " + "a" * 8 + "-alice-token-0123456789"},
        {"Authorization": "Bearer"},
        "alice-token-plus-a-byte",
        "alice-token-minus-a-byte",
    ],
    ids=["none", "wrong", "wrong-scheme", "empty", "longer", "shorter"],
)
def test_every_mutating_route_refuses_without_a_valid_token(api, tokens, headers):
    if headers == "alice-token-plus-a-byte":
        headers = bearer(tokens["alice"] + "x")
    elif headers == "alice-token-minus-a-byte":
        headers = bearer(tokens["alice"][:-1])
    todo = routes(api.app, mutating=True)
    assert len(todo) >= 6
    for method, path in todo:
        r = HTTP.request(method, api.base + fill(path), json=body_for(path), headers=headers)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert api.host.mutating_calls() == []
    assert list(api.audit) == []


@pytest.mark.parametrize("listen", ["127.0.0.1", "0.0.0.0"])
def test_open_reads_opens_reads_only_never_a_change(api, listen):
    # api.open_reads lets a LAN dashboard read without a token; a change must still need one
    # wherever the daemon listens.
    api.app.state.policy = AccessPolicy(listen, open_reads=True)
    r = HTTP.get(api.base + "/v1/status")
    assert r.status_code == 200, r.text
    todo = routes(api.app, mutating=True)
    assert len(todo) >= 6
    for method, path in todo:
        r = HTTP.request(method, api.base + fill(path), json=body_for(path))
        assert r.status_code == 401, (listen, method, path, r.status_code, r.text)
    assert api.host.mutating_calls() == []
    assert list(api.audit) == []


def test_unauthenticated_beats_a_malformed_body(api):
    # FastAPI's own body parsing would answer 422 before checking the token
    for method, path in routes(api.app, mutating=True):
        r = HTTP.request(method, api.base + fill(path), content=b"{not json")
        assert r.status_code == 401, (path, r.text)


def test_every_mutating_route_is_audited_with_the_token_name(api, tokens):
    todo = routes(api.app, mutating=True)
    for method, path in todo:
        r = HTTP.request(method, api.base + fill(path), json=body_for(path), headers=bearer(tokens["ci"]))
        assert r.status_code in (200, 409), (path, r.text)  # confirm without a pending apply: 409
    started = [rec for rec in api.audit if rec["result"] == "started"]
    records = [rec for rec in api.audit if rec["result"] != "started"]
    assert len(records) == len(todo)
    # issue 12: each change was on disk before it was made (confirm without a pending apply: none)
    assert {r["what"] for r in started} == {r["what"] for r in records} - {"gpu.confirm"}
    assert {rec["who"] for rec in records} == {"api:ci"}
    assert {rec["what"] for rec in records} == {
        "gpu.apply", "gpu.confirm", "gpu.reset", "engine.kill", "engine.restart", "cache.quarantine"
    }
    for rec in records:
        assert rec["why"] == "test" and rec["target"] in VALID.values() and rec["time"] and rec["result"]
        assert tokens["ci"] not in json.dumps(rec)  # the name, never the token
    kill = next(r for r in records if r["what"] == "engine.kill")
    assert kill["evidence"]["engine"]["state"] == "stalled"
    assert kill["evidence"]["provider_result"] == {"killed_pids": [4242]}
    assert ("kill_engine", "vllm-a", "api:ci") in api.host.calls


def test_refused_and_failed_actions_are_audited_too(api, tokens):
    r = HTTP.post(api.base + "/v1/gpus/gpu1/apply", json={"profile": "refused"}, headers=bearer(tokens["alice"]))
    assert r.status_code == 409 and "OD_RANGE" in r.json()["detail"]
    r = HTTP.post(api.base + "/v1/gpus/gpu7/reset", headers=bearer(tokens["alice"]))
    assert r.status_code == 404
    results = [(rec["what"], rec["target"], rec["result"].split(":")[0]) for rec in api.audit if rec["result"] != "started"]
    assert results == [("gpu.apply", "gpu1", "refused"), ("gpu.reset", "gpu7", "refused 404")]


def test_reads_need_a_token_beyond_loopback_unless_open_reads(api, tokens):
    gets = [(m, p) for m, p in routes(api.app, mutating=False) if m == "GET" and p not in OPEN_GETS]
    assert ("GET", "/metrics") in gets
    for policy, need in ((AccessPolicy("127.0.0.1"), False), (AccessPolicy("0.0.0.0"), True),
                         (AccessPolicy("0.0.0.0", open_reads=True), False)):
        api.app.state.policy = policy
        for _, path in gets:
            r = HTTP.get(api.base + fill(path))
            assert (r.status_code == 401) == need, (policy, path, r.status_code)
            r = HTTP.get(api.base + fill(path), headers=bearer(tokens["alice"]))
            assert r.status_code not in (401, 500), (path, r.text)
        assert HTTP.get(api.base + "/healthz").status_code == 200


EVIL = ["..", "%2e%2e", "%2E%2E%2F%2E%2E%2Fetc%2Fpasswd", "%00", "gpu0%00", "..%2f..%2fetc%2fpasswd",
        "%2fetc%2fpasswd", "....%2f%2f", "gpu0%2f..%2fgpu1", ".", "%2e", "~root", "gpu0%0a"]


@pytest.mark.parametrize("evil", EVIL)
def test_path_parameters_never_reach_a_provider_as_paths(api, tokens, evil):
    with_params = [(m, p) for m, p in routes(api.app, True) + routes(api.app, False) if "{" in p and m != "HEAD"]
    for method, path in with_params:
        name = path[path.index("{") + 1 : path.index("}")]
        target = fill(path, **{name: evil})
        status, body = raw(api.port, method, target, bearer(tokens["alice"]), json.dumps(body_for(path)).encode())
        assert status == 404, (method, target, status, body)
    for method, path in [("GET", "/v1/gpus/../../../etc/passwd"), ("POST", "/v1/engines/../../etc/kill")]:
        status, _ = raw(api.port, method, path, bearer(tokens["alice"]))
        assert status == 404
    assert api.host.mutating_calls() == []


def test_unknown_names_are_404_naming_them(api, tokens):
    h = bearer(tokens["alice"])
    cases = [("GET", "/v1/gpus/gpu9", "gpu9"), ("POST", "/v1/gpus/gpu9/apply", "gpu9"),
             ("POST", "/v1/engines/sglang-x/kill", "sglang-x"), ("POST", "/v1/engines/sglang-x/restart", "sglang-x"),
             ("POST", "/v1/caches/triton/quarantine", "triton")]
    for method, path, name in cases:
        r = HTTP.request(method, api.base + path, headers=h, json=body_for(path))
        assert r.status_code == 404 and repr(name) in r.json()["detail"], (path, r.text)
    # a provider's own "unknown" is 404 too
    r = HTTP.post(api.base + "/v1/caches/ghost/quarantine", headers=h)
    assert r.status_code == 404 and "vanished" in r.json()["detail"]
    # a PCI address works as a GPU name
    assert HTTP.get(api.base + "/v1/gpus/0000:03:00.0").json()["name"] == "gpu0"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"profile": 5}, "profile"),
        ({}, "profile"),
        ({"profile": "quiet", "confirm_within": 0}, "confirm_within"),
        ({"profile": "quiet", "confirm_within": "soon"}, "confirm_within"),
        ({"profile": "quiet", "colour": "red"}, "colour"),
        ({"profile": "no-such-profile"}, "profile"),
        ({"profile": "../../etc/passwd"}, "profile"),
        ({"profile": "quiet", "reason": "x" * 600}, "reason"),
    ],
)
def test_bad_apply_body_is_422_naming_the_field(api, tokens, body, field):
    r = HTTP.post(api.base + "/v1/gpus/gpu0/apply", json=body, headers=bearer(tokens["alice"]))
    assert r.status_code == 422, r.text
    assert ["body", field] in [d["loc"] for d in r.json()["detail"]]
    assert api.host.mutating_calls() == []


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"profile"', b"\xff\xfe"])
def test_body_that_is_not_a_json_object_is_422(api, tokens, content):
    r = HTTP.post(api.base + "/v1/engines/vllm-a/kill", content=content, headers=bearer(tokens["alice"]))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"]


def test_oversized_bodies_are_refused_before_parsing(api, tokens):
    limit = api.app.state.max_body_bytes
    big = json.dumps({"profile": "quiet", "reason": "x" * limit}).encode()
    for headers in ({}, bearer(tokens["alice"])):
        status, body = raw(api.port, "POST", "/v1/gpus/gpu0/apply", headers, big)
        assert status == 413 and str(limit) in json.loads(body)["detail"]
    # a declared length over the limit is refused without waiting for the bytes
    c = http.client.HTTPConnection("127.0.0.1", api.port, timeout=5)
    c.putrequest("POST", "/v1/engines/vllm-a/kill")
    c.putheader("Content-Length", str(100 * 1024 * 1024))
    c.endheaders()
    assert c.getresponse().status == 413
    c.close()
    # chunked: counted while it arrives
    def chunks():
        for _ in range(limit // 512 + 2):
            yield b" " * 512
    r = HTTP.post(api.base + "/v1/engines/vllm-a/kill", content=chunks(), headers=bearer(tokens["alice"]))
    assert r.status_code == 413
    # a body at the limit goes through to validation
    ok = json.dumps({"reason": "y" * 100}).encode().ljust(limit)
    r = HTTP.post(api.base + "/v1/engines/vllm-a/kill", content=ok, headers=bearer(tokens["alice"]))
    assert r.status_code == 200, r.text
    assert [c[0] for c in api.host.mutating_calls()] == ["kill_engine"]


def test_missing_provider_is_501_naming_it(tokens, serve, stand_in):
    _, host_hub = stand_in
    hub = host_hub()
    app = build_app(hub, MetricsSink(hub), tokens=TokenStore(tokens), actions=Actions())
    with serve(app) as srv:
        h = bearer(tokens["alice"])
        for method, path, missing in [
            ("POST", "/v1/engines/vllm-a/kill", "kill_engine"),
            ("POST", "/v1/gpus/gpu0/apply", "apply_profile"),
            ("POST", "/v1/gpus/gpu0/reset", "reset_gpu"),
            ("POST", "/v1/caches/c/quarantine", "quarantine_cache"),
            ("GET", "/v1/engines", "engines"),
            ("GET", "/v1/profiles", "profiles"),
            ("GET", "/v1/pcie", "pcie"),
        ]:
            r = HTTP.request(method, srv.base + path, headers=h, json=body_for(path))
            assert r.status_code == 501 and missing in r.json()["detail"], (path, r.text)
        # registering a provider is all the integration there is
        app.state.actions.provide(pcie=lambda: {"gpus": {}})
        assert HTTP.get(srv.base + "/v1/pcie").json() == {"gpus": {}}


def test_read_shapes(api):
    assert [e["name"] for e in HTTP.get(api.base + "/v1/engines").json()] == ["vllm-a", "llama-b"]
    assert [p["name"] for p in HTTP.get(api.base + "/v1/profiles").json()] == ["quiet", "psu-safe", "refused"]
    assert "gpus" in HTTP.get(api.base + "/v1/pcie").json()
    st = HTTP.get(api.base + "/v1/status").json()
    assert st["summary"] == "2/2 GPUs up" and [g["name"] for g in st["gpus"]] == ["gpu0", "gpu1"]
    assert st["pending_confirm"] == {}


def test_events_since(api):
    from gpuguard.state.events import Event

    api.hub.publish(Event("a", "info", "t", "first", time=100.0))
    api.hub.publish(Event("b", "alert", "t", "second", time=200.0))
    assert [e["kind"] for e in HTTP.get(api.base + "/v1/events").json()] == ["a", "b"]
    assert [e["kind"] for e in HTTP.get(api.base + "/v1/events", params={"since": 150}).json()] == ["b"]
    assert [e["kind"] for e in HTTP.get(api.base + "/v1/events", params={"limit": 1}).json()] == ["b"]
    r = HTTP.get(api.base + "/v1/events", params={"since": "yesterday"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "since"]


def test_unconfirmed_apply_is_reverted(api, tokens, wait):
    h = bearer(tokens["alice"])
    r = HTTP.post(api.base + "/v1/gpus/gpu0/apply", json={"profile": "quiet", "confirm_within": 1}, headers=h)
    assert r.status_code == 200, r.text
    pending = r.json()["pending_confirm"]
    assert pending["gpu"] == "gpu0" and pending["who"] == "api:alice"
    assert api.host.state["gpu0"] == {"od": "quiet"}
    # a second apply inside the window: the revert still goes back to before the first
    r = HTTP.post(api.base + "/v1/gpus/gpu0/apply", json={"profile": "psu-safe", "confirm_within": 1}, headers=h)
    assert r.status_code == 200
    assert HTTP.get(api.base + "/v1/status").json()["pending_confirm"]["gpu0"]["profile"] == "psu-safe"
    wait(lambda: any(c[0] == "restore_state" for c in api.host.calls), timeout=5, what="the revert")
    assert ("restore_state", "gpu0", {"od": "stock"}) in api.host.calls
    assert api.host.state["gpu0"] == {"od": "stock"}
    revert = wait(lambda: [r for r in api.audit if r["what"] == "gpu.revert"], what="the revert audit record")
    assert revert[0]["who"] == "api:alice" and "not confirmed within 1 s" in revert[0]["why"] and revert[0]["result"] == "ok"
    assert [e.kind for e in api.hub.events] == ["profile_reverted"]
    assert HTTP.get(api.base + "/v1/status").json()["pending_confirm"] == {}


def test_confirmed_apply_stays(api, tokens):
    h = bearer(tokens["ci"])
    r = HTTP.post(api.base + "/v1/gpus/gpu1/apply", json={"profile": "quiet", "confirm_within": 1}, headers=h)
    revert_at = r.json()["pending_confirm"]["revert_at"]
    r = HTTP.post(api.base + "/v1/gpus/gpu1/confirm", json={"reason": "looks stable"}, headers=h)
    assert r.status_code == 200 and r.json()["result"]["confirmed"]["profile"] == "quiet"
    # nothing may happen at the deadline: wait past it (a wait for an absence, not a sync)
    while time.time() < revert_at + 0.5:
        time.sleep(0.05)
    assert not any(c[0] == "restore_state" for c in api.host.calls)
    assert api.host.state["gpu1"] == {"od": "quiet"}
    r = HTTP.post(api.base + "/v1/gpus/gpu1/confirm", headers=h)
    assert r.status_code == 409 and "no applied profile waiting" in r.json()["detail"]


def test_confirm_window_needs_snapshot_and_restore_providers(tokens, serve, stand_in):
    StandInHost, host_hub = stand_in
    hub, host = host_hub(), StandInHost()
    actions = Actions()
    actions.provide(apply_profile=host.apply_profile)
    with serve(build_app(hub, MetricsSink(hub), tokens=TokenStore(tokens), actions=actions)) as srv:
        r = HTTP.post(srv.base + "/v1/gpus/gpu0/apply", json={"profile": "quiet", "confirm_within": 5},
                       headers=bearer(tokens["alice"]))
        assert r.status_code == 501 and "snapshot_state" in r.json()["detail"]
    assert host.calls == []  # not applied when it could not be reverted


def test_metrics_is_answered_before_routing_with_the_same_rules(api, tokens):
    """/metrics is served ahead of the routers (a scrape is the request that comes all
    day): the same body as the registry renders, HEAD without it, 405 for a POST, the
    read rule beyond loopback, and a failing render a 500 that the next scrape survives."""
    r = HTTP.get(api.base + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"gpuguard_build_info" in r.content and int(r.headers["content-length"]) == len(r.content)
    h = HTTP.head(api.base + "/metrics")
    assert h.status_code == 200 and h.content == b"" and int(h.headers["content-length"]) > 1000
    p = HTTP.post(api.base + "/metrics", headers=bearer(tokens["alice"]))
    assert p.status_code == 405 and set(p.headers["allow"].split(", ")) == {"GET", "HEAD"}

    api.app.state.policy = AccessPolicy("0.0.0.0")
    try:
        r = HTTP.get(api.base + "/metrics")
        assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="gpuguard"'
        assert HTTP.get(api.base + "/metrics", headers=bearer(tokens["ci"])).status_code == 200
    finally:
        api.app.state.policy = AccessPolicy("127.0.0.1")

    metrics = api.app.state.metrics

    class Broken:
        def render(self) -> bytes:
            raise RuntimeError("a bug in a renderer")

    api.app.state.metrics = Broken()
    try:
        r = HTTP.get(api.base + "/metrics")
        assert r.status_code == 500 and "see the daemon's log" in r.json()["detail"]
    finally:
        api.app.state.metrics = metrics
    assert HTTP.get(api.base + "/metrics").status_code == 200


def test_reads_never_build_the_control_app_and_an_action_path_does(api, tokens):
    fresh = build_app(api.hub, MetricsSink(api.hub), tokens=TokenStore({"alice": tokens["alice"]}))
    api.front.app = fresh
    try:
        for path in ("/metrics", "/healthz", "/v1/status", "/v1/gpus", "/v1/gpus/gpu0", "/v1/events", "/nope"):
            HTTP.get(api.base + path)
        assert fresh._control is None
        r = HTTP.get(api.base + "/v1/gpus/gpu0/reset")   # an action path: the control app answers, 405
        assert r.status_code == 405 and fresh._control is not None
    finally:
        api.front.app = api.app
