"""Issue 12 item 4, the running side: deeply nested JSON bodies on every action route
(valid token) answer 422 and never reach a provider (they gave 500); a seeded fuzz run of
nested bodies over every action route; a SIGHUP with a non-UTF-8 or 10,000-deep config
is rejected in one line naming the file, the daemon keeps its config and keeps serving
(the log showed only `Exception in callback Daemon.reload()`)."""
from __future__ import annotations

import json
import signal

import httpx
from support import api_routes
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from service.failsafe_harness import GuardProcess, config_text, sim_root
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


HTTP = httpx.Client(timeout=10)
VALID = {"gpu": "gpu0", "engine": "vllm-a", "cache": "vllm-compile"}


def _action_routes(app) -> list[str]:
    out = []
    for r in api_routes(app):
        if "POST" in r.methods:
            out.append(r.path.format(**{k: VALID[k] for k in VALID if "{" + k + "}" in r.path}))
    return out


def test_deep_json_bodies_answer_422_on_every_action_route(api, tokens):
    auth = {"Authorization": f"Bearer {tokens['alice']}"}
    paths = _action_routes(api.app)
    assert len(paths) >= 6
    bodies = [
        b'{"reason": ' + b"[" * 1500 + b"]" * 1500 + b"}",  # past json's recursion limit: was a 500
        b"[" * 2000,  # not even closed
        b'{"reason": "x", "profile": ' + b'{"a":' * 600 + b"1" + b"}" * 600 + b"}",
    ]
    for path in paths:
        for body in bodies:
            r = HTTP.post(api.base + path, content=body, headers={**auth, "Content-Type": "application/json"})
            assert r.status_code == 422, (path, r.status_code, r.text[:300])
            assert r.json()["detail"][0]["type"] == "json_too_deep"
    assert api.host.mutating_calls() == []
    # a body over the size limit is 413 before anything is parsed
    r = HTTP.post(api.base + paths[0], content=b"[" * 5000, headers=auth)
    assert r.status_code == 413


nested = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["reason", "profile", "confirm_within", "x"]), inner, max_size=3),
    max_leaves=40,
)
deep = st.integers(1, 1800).flatmap(lambda n: st.sampled_from([
    b"[" * n + b"]" * n, b'{"reason":' * n + b"1" + b"}" * n, b"[" * n, b'{"reason": "' + b"[" * n + b'"}',
    b'{"profile": "quiet", "reason": ' + b"[" * n + b"]" * n + b"}",
]))


@seed(12)
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_nested_bodies_over_every_action_route(api, tokens, data):
    path = data.draw(st.sampled_from(_action_routes(api.app)))
    body = data.draw(st.one_of(nested.map(lambda v: json.dumps(v).encode()), deep))
    r = HTTP.post(api.base + path, content=body,
                  headers={"Authorization": f"Bearer {tokens['alice']}", "Content-Type": "application/json"})
    assert r.status_code < 500 or r.status_code == 501, (path, body[:80], r.status_code, r.text[:300])


def test_sighup_with_hostile_config_keeps_running_and_names_the_file(tmp_path, wait):
    root = sim_root(tmp_path)
    cfg = tmp_path / "gpuguard.yaml"
    good = config_text(tmp_path / "state", tmp_path, None)
    cfg.write_text(good)
    d = GuardProcess(cfg, root)
    try:
        base = d.find_base(wait)
        for raw, says in ((b"poll: {interval_seconds: 1}\n\xff\xfe\n", "(line 2): not UTF-8 text"),
                          (b"x: " + b"[" * 10000 + b"]" * 10000, "nested deeper than 32 levels")):
            cfg.write_bytes(raw)
            n = len(d.log_has("reload rejected"))
            d.proc.send_signal(signal.SIGHUP)
            hit = wait(lambda: d.log_has("reload rejected")[n:], timeout=30, what="the rejected reload")
            assert f"file={cfg}" in hit[0] and says in hit[0], hit
            assert httpx.get(base + "/healthz", timeout=5).json()["ok"] is True
        assert not d.log_has("Traceback|Exception in callback")
        cfg.write_text(good.replace("interval_seconds: 0.3", "interval_seconds: 0.5"))
        d.proc.send_signal(signal.SIGHUP)
        wait(lambda: d.log_has("poll_interval=0.5s"), timeout=30, what="the good reload")
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.output()
