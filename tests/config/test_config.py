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


CROSS = """sysfs_root: /
poll:
  interval_seconds: 1
gpus:
  - {name: r9700-a, match: {bdf: "0000:05:00.0"}}
  - {name: r9700-b, match: {bdf: "0000:08:00.0"}}
  - name: xtx-0
    match: {bdf: "0000:aa:00.0"}
    profile: xtx-200
  - {name: r9700-a, match: {bdf: "0000:b0:00.0"}}
engines:
  - name: vllm-a
    kind: vllm
    url: http://127.0.0.1:8000
    gpus: [xtx-0, xtx-9]
    process: {cmdline: "^vllm serve "}
profiles:
  xtx-2000:
    sclk_max_mhz: 2000
"""


def test_cross_reference_errors_name_the_full_key_path_and_the_line_of_the_value():
    """A profile name typo in gpus[2] was `<top level> (line 1)`: each cross-reference
    problem names the key that holds the wrong value, and that value's line."""
    assert problems(CROSS) == [
        "gpus[2].profile (line 9): profile 'xtx-200' is not defined under profiles (defined: xtx-2000)",
        "gpus[3].name (line 10): GPU name 'r9700-a' is used twice in gpus (first at gpus[0])",
        "engines[0].gpus[1] (line 15): engine vllm-a: 'xtx-9' is not a name in gpus: "
        "(r9700-a, r9700-b, xtx-0)",
    ]


def test_a_range_error_inside_a_profile_names_the_profile():
    """`profiles.power_cap_w (line 4)` left out the profile: its name has a `-`."""
    text = "profiles:\n  r9700-psu-safe:\n    sclk_offset_mhz: -100\n    power_cap_w: 5000\n"
    assert problems(text) == [
        "profiles.r9700-psu-safe.power_cap_w (line 4): Input should be less than or equal to 2000"
    ]


def test_config_check_names_the_key_path_of_a_profile_typo(tmp_path):
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(CROSS)
    r = subprocess.run([sys.executable, "-m", "gpuguard", "config", "check", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert f"  gpus[2].profile (line 9): profile 'xtx-200' is not defined" in r.stderr, r.stderr
    assert "<top level>" not in r.stderr


def test_psu_alert_hysteresis_is_seconds_and_the_older_interval_count_is_read_at_the_poll_interval():
    """power.clear_after_seconds is the hysteresis, whatever the poll; a file written with the
    older clear_after_intervals keeps what it meant at its poll interval."""
    assert parse_config("power: {clear_after_seconds: 5}\n", "t.yaml").power.clear_after_seconds == 5.0
    old = parse_config("poll: {interval_seconds: 0.5}\npower: {clear_after_intervals: 20}\n", "t.yaml")
    assert old.power.clear_after_seconds == 10.0
    assert parse_config("power: {clear_after_intervals: 5}\n", "t.yaml").power.clear_after_seconds == 5.0
    (both,) = problems("power: {clear_after_intervals: 5, clear_after_seconds: 5}\n")
    assert "clear_after_seconds or the older clear_after_intervals, not both" in both
    (bad,) = problems("power: {clear_after_intervals: 0}\n")
    assert "power.clear_after_intervals must be a whole number" in bad
