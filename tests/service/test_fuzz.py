"""A hypothesis run over every route of the app (enumerated, methods included) with
hostile path names, query strings, headers and bodies, over real HTTP: no request may
get a 500, and a request without a valid token never reaches a mutating provider."""
from __future__ import annotations

import json
from urllib.parse import quote, unquote

import httpx
from support import api_routes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


HTTP = httpx.Client(timeout=10)

names = st.one_of(
    st.sampled_from(["gpu0", "gpu1", "0000:03:00.0", "vllm-a", "llama-b", "vllm-compile", "ghost", "..", ".", "",
                     "../../etc/passwd", "\x00", "gpu0\x00", "%00", "a" * 65, "ü", "con", "gpu0/../gpu1"]),
    st.text(min_size=0, max_size=40),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.none(),
    st.just(b'{"profile": "quiet", "reason": "fuzz"}'),
    st.fixed_dictionaries(
        {},
        optional={
            "profile": st.one_of(st.sampled_from(["quiet", "psu-safe", "refused", "nope"]), json_values),
            "confirm_within": st.one_of(st.floats(allow_nan=False, allow_infinity=True), st.integers(), json_values),
            "reason": st.one_of(st.text(max_size=600), json_values),
            "extra": json_values,
        },
    ).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
)
queries = st.dictionaries(st.sampled_from(["since", "limit", "x"]),
                          st.one_of(st.text(max_size=12), st.integers().map(str), st.floats().map(str)), max_size=3)


def _routes(app):
    # HEAD is GET without the body (the read routes answer both): fuzzing GET covers it
    return [(m, r.path) for r in api_routes(app) for m in sorted(r.methods) if m != "HEAD"]


def test_no_request_gets_a_500(api, tokens):
    all_routes = _routes(api.app)
    regex = {(m, r.path): r.path_regex for r in api_routes(api.app) for m in r.methods}
    auths = st.sampled_from([None, f"Bearer {tokens['alice']}", "Bearer nope-nope-nope-nope", "Basic x", "Bearer"])

    valid = {"gpu": "gpu0", "engine": "vllm-a", "cache": "vllm-compile"}

    good = f"Bearer {tokens['alice']}"
    well_formed = st.tuples(st.sampled_from(all_routes), st.just(True), names, st.just(""),
                            st.sampled_from([None, b"{}", b'{"profile": "quiet", "reason": "fuzz"}']), queries, st.just(good))
    hostile = st.tuples(st.sampled_from(all_routes), st.booleans(), names, st.sampled_from(["", "/", "%"]), bodies,
                        queries, auths)

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(request=st.one_of(well_formed, hostile))
    def one(request):
        route, good_name, name, safe, body, query, auth = request
        method, path = route
        url = path
        if "{" in path:
            start, end = path.index("{"), path.index("}")
            if good_name:
                name = valid[path[start + 1 : end]]
            url = path[:start] + quote(name, safe=safe) + path[end + 1 :]
        headers = {"Authorization": auth} if auth else {}
        before = len(api.host.mutating_calls())
        try:
            r = HTTP.request(method, api.base + url, params=query, content=body, headers=headers)
        except httpx.InvalidURL:
            return  # the client refused to send it (e.g. a raw '%' sequence); nothing reached the server
        # 501 is the deliberate "no provider registered" answer; anything else 5xx is a bug
        assert r.status_code < 500 or r.status_code == 501, (method, url, query, body, r.status_code, r.text)
        if method == "POST" and auth != f"Bearer {tokens['alice']}":
            assert len(api.host.mutating_calls()) == before
            sent = unquote(r.request.url.raw_path.split(b"?")[0].decode())
            if regex[route].match(sent):
                # it reached the route (the client did not fold a '..' away): auth answers first
                assert r.status_code in (401, 413), (method, url, r.status_code)

    one()
    # Every action route once, well formed, with the token: the providers are reached, not
    # only the error paths (which routes the fuzzer's 400 examples hit depends on the route
    # list, and a whole-suite run once left kill_engine out).
    for method, path in all_routes:
        if method != "POST":
            continue
        url = path
        for param, value in valid.items():
            url = url.replace("{" + param + "}", value)
        body = b'{"profile": "quiet", "reason": "fuzz"}' if path.endswith("/apply") else b'{"reason": "fuzz"}'
        r = HTTP.request(method, api.base + url, content=body, headers={"Authorization": good})
        assert r.status_code < 500 or r.status_code == 501, (method, url, r.status_code, r.text)
        if path.endswith(("/apply", "/kill")):
            assert r.status_code == 200, (method, url, r.status_code, r.text)
    assert {c[0] for c in api.host.mutating_calls()} >= {"kill_engine", "apply_profile"}
