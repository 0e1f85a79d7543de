"""Config validation: errors name the key path and the line; an invalid file is never
half-used; unquoted PCI addresses stay strings."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(text, "t.yaml")
    return [str(p) for p in e.value.problems]


def test_defaults_without_a_file():
    c = load_config(None)
    assert c.listen.address == "127.0.0.1"  # loopback unless the user opens it
    assert c.poll.interval_seconds == 1.0


def test_out_of_range_value_names_key_and_line():
    assert problems("poll:\n  interval_seconds: 30\n") == [
        "poll.interval_seconds (line 2): Input should be less than or equal to 15"
    ]


def test_unknown_key_is_an_error_with_its_line():
    (p,) = problems("poll:\n  interval_seconds: 1\n  intervall: 2\n")
    assert p.startswith("poll.intervall (line 3): unknown key")


def test_errors_inside_lists_name_the_index():
    text = "gpus:\n  - name: a\n    match: {bdf: 0000:05:00.0}\n  - name: b\n    match:\n      pci_id: zz\n"
    (p,) = problems(text)
    assert p.startswith("gpus[1].match.pci_id (line 6):")
    assert "1002:744c" in p  # says what a valid value looks like


def test_unquoted_pci_address_stays_a_string():
    c = parse_config("gpus:\n  - name: a\n    match: {bdf: 0000:05:00.0}\n  - name: b\n    match: {bdf: 0a:00.0}\n")
    assert [g.match.bdf for g in c.gpus] == ["0000:05:00.0", "0000:0a:00.0"]


def test_match_needs_exactly_one_way():
    (p,) = problems("gpus:\n  - name: a\n    match: {bdf: 0000:05:00.0, pci_id: 1002:744c}\n")
    assert "gpus[0].match (line 3)" in p and "exactly one" in p


def test_duplicate_gpu_names_are_refused():
    text = "gpus:\n  - {name: a, match: {bdf: 05:00.0}}\n  - {name: a, match: {bdf: 08:00.0}}\n"
    (p,) = problems(text)
    assert "used twice" in p


def test_broken_yaml_gives_the_line():
    (p,) = problems("poll:\n  interval_seconds: [1\n")
    assert "line" in p and "not valid YAML" in p


def test_shipped_configs_are_valid():
    for name in ("gpuguard.yaml", "demo.yaml"):
        load_config(REPO / "config" / name)


def test_config_check_cli_exit_status(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen:\n  port: 99999\n")
    r = subprocess.run([sys.executable, "-m", "gpuguard", "config", "check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "listen.port (line 2)" in r.stderr
    good = tmp_path / "good.yaml"
    good.write_text("listen:\n  port: 9500\n")
    r = subprocess.run([sys.executable, "-m", "gpuguard", "config", "check", str(good)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_commented_examples_in_the_annotated_config_are_valid():
    """Every `#  ` example block in config/gpuguard.yaml, uncommented, is a valid config:
    a user who copies one gets no surprise."""
    import re

    text = (REPO / "config" / "gpuguard.yaml").read_text()
    lines = [m.group(1) if (m := re.match(r"^#(  .*)$", line)) else line for line in text.splitlines()]
    t = "\n".join(lines)
    for section in ("gpus", "profiles", "engines", "webhooks"):
        t = re.sub(rf"^{section}: (\[\]|\{{\}})$", f"{section}:", t, flags=re.M)
    c = parse_config(t, "uncommented")
    assert [g.name for g in c.gpus] == ["r9700-a", "xtx-0"]
    assert c.gpus[1].expect_link.gen == 4
    assert set(c.profiles) == {"psu-safe", "xtx-2000"}
    assert [e.name for e in c.engines] == ["qwen", "gemma", "custom"]
    qwen = c.engines[0]  # the graded response, as the comments explain it
    assert (qwen.stall_after, qwen.effective_dump_after, qwen.effective_kill_after) == (60, 90, 180)
    assert [str(p) for p in qwen.caches[0].related] == ["/var/cache/sglang/triton"] and qwen.act_on_unhealthy
    assert c.webhooks and c.webhooks[0].retries == 3


def test_the_flight_recorder_lives_in_state_dir_unless_its_path_is_given():
    """Two daemons with their own state folders wrote into one /var/lib/gpuguard/flight.sqlite
    (every benchmark and test daemon did): an unset recorder.path follows state_dir."""
    from gpuguard.config import Config, parse_config

    assert Config().recorder.path == "/var/lib/gpuguard/flight.sqlite"
    assert parse_config("state_dir: /srv/gg\n").recorder.path == "/srv/gg/flight.sqlite"
    assert parse_config("state_dir: /srv/gg\nrecorder: {keep_seconds: 600}\n").recorder.path == "/srv/gg/flight.sqlite"
    assert parse_config("state_dir: /srv/gg\nrecorder: {path: /data/f.sqlite}\n").recorder.path == "/data/f.sqlite"
