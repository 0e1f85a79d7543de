"""Issue 12 item 4: hostile config files get a one-line answer naming the file (and the
line where known), never a traceback — from `config check` and from `run` alike, and
`config check` refuses what `run` refuses (the token file). Plus a seeded fuzz run over
the loader: every input is either a Config or a ConfigError."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from gpuguard.config import Config, ConfigError
from gpuguard.config.loader import MAX_BYTES, parse_config_bytes

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]

NOT_UTF8 = b"poll:\n  interval_seconds: 1\nlogging: {level: \xe9rror}\n"
DEEP_YAML = b"x: " + b"[" * 10000 + b"]" * 10000 + b"\n"
DEEP_BLOCK = "".join(f"{'  ' * i}k{i}:\n" for i in range(300)).encode()
LAUGHS = b"".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9) if p else ', '.join(['lol'] * 9)}]\n".encode()
    for p, c in zip(["", "a", "b", "c", "d", "e", "f", "g"], "abcdefgh")
)


def gpuguard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "daemon")))


@pytest.mark.parametrize("raw, says", [
    (NOT_UTF8, "(line 3): not UTF-8 text: byte 0xe9"),
    (DEEP_YAML, "nested deeper than 32 levels"),
    (DEEP_BLOCK, "nested deeper than 32 levels"),
    (LAUGHS, "expands to more than"),
    (b"a: 1\n" * (MAX_BYTES // 4), "larger than"),
    (b"\x00\x01", "not valid YAML"),
    (b"!!python/object/apply:os.system [true]\n", "not valid YAML"),
], ids=["not-utf8", "deep-flow", "deep-block", "laughs", "huge", "nul", "python-tag"])
def test_config_check_and_run_answer_in_one_line(tmp_path, raw, says):
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(raw)
    for args, rc in ((("config", "check", str(cfg)), 1), (("run", "--config", str(cfg), "--sysfs-root", str(tmp_path)), 2)):
        r = gpuguard(*args)
        assert r.returncode == rc, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "Error:" not in r.stderr.split("\n")[0], r.stderr
        lines = r.stderr.strip().splitlines()
        assert lines[0].startswith(str(cfg)), r.stderr  # names the file
        assert len(lines) == 2 and says in lines[1], r.stderr  # the one problem, on one line


def test_config_check_refuses_a_missing_token_file_like_run_does(tmp_path):
    cfg = tmp_path / "g.yaml"
    missing = tmp_path / "no-such-tokens"
    cfg.write_text(f"state_dir: {tmp_path}/state\napi: {{token_file: {missing}}}\nlisten: {{port: 0}}\n"
                   f"recorder: {{path: {tmp_path}/f.sqlite}}\n")
    check = gpuguard("config", "check", str(cfg))
    assert check.returncode == 1 and f"api.token_file {missing}: cannot open" in check.stderr, check.stderr
    run = gpuguard("run", "--config", str(cfg), "--sysfs-root", str(tmp_path))
    assert run.returncode == 1 and f"api.token_file {missing}: cannot open" in run.stderr, run.stderr
    # and the other token-file checks `run` makes: mode and owner
    missing.write_text("alice: aaaaaaaaaaaaaaaaaaaaaaaa\n")
    os.chmod(missing, 0o644)
    check = gpuguard("config", "check", str(cfg))
    assert check.returncode == 1 and "chmod 600" in check.stderr, check.stderr
    os.chmod(missing, 0o600)
    check = gpuguard("config", "check", str(cfg))
    assert check.returncode == 0 and check.stdout.strip() == f"{cfg}: OK", check.stderr


def test_config_check_warns_about_reads_open_to_the_network(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("listen: {address: 0.0.0.0}\napi: {open_reads: true}\n")
    r = gpuguard("config", "check", str(cfg))
    assert r.returncode == 0
    assert "warning: api: listening on 0.0.0.0 with api.open_reads: true" in r.stderr
    assert "without api.token_file" in r.stderr


# -- fuzz: fixed seed and budget so CI runs the same cases every time ---------------------------
yaml_scalars = st.one_of(st.integers(), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=20))
config_like = st.recursive(
    yaml_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["poll", "interval_seconds", "gpus", "name", "match", "bdf", "pci_id", "api", "token_file",
                         "listen", "address", "port", "profiles", "webhooks", "url", "kernel", "policy", "engines",
                         "recorder", "apply", "logging", "level", "x"]) | st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _yamlish(v) -> bytes:
    import yaml

    try:
        return yaml.safe_dump(v, allow_unicode=True).encode()
    except Exception:  # noqa: BLE001 - not dumpable: let the bytes strategy cover it
        return b""


raw_files = st.one_of(
    st.binary(max_size=300),
    config_like.map(_yamlish),
    st.builds(lambda a, b, c: a + b + c, config_like.map(_yamlish), st.binary(max_size=8), config_like.map(_yamlish)),
    st.text(alphabet=st.sampled_from(list("[]{}:- ,&*!|>'\"\n\t#?ab1")), max_size=200).map(str.encode),
    st.integers(1, 400).map(lambda n: b"a: " + b"[" * n + b"]" * n),
    st.integers(1, 200).map(lambda n: "".join(f"{'  ' * i}k:\n" for i in range(n)).encode()),
)


@seed(20261201)
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(raw_files)
def test_fuzz_the_loader_answers_config_or_config_error(raw):
    try:
        assert isinstance(parse_config_bytes(raw, "fuzz.yaml"), Config)
    except ConfigError as e:
        assert e.problems and e.render().startswith("fuzz.yaml: ")
        for p in e.problems:
            assert "\n" not in str(p)
