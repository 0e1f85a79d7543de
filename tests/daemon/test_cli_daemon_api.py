"""Every command that talks to the daemon finds it the same way (`--api`, else
$GPUGUARD_API, else the config's listen:, else 127.0.0.1:9436), and a daemon the user
named that does not answer is an error naming its URL — never a silent read of this host."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from support import poll_until

from gpuguard.sim.runner import build_scenario
from gpuguard.sim.tree import write_tree

pytestmark = pytest.mark.slow  # spawns the daemon and the CLI

NAMES = """gpus:
  - {name: xtx-0, match: {bdf: "0000:aa:00.0"}}
  - {name: xtx-1, match: {bdf: "0000:b0:00.0"}}
  - {name: r9700-a, match: {bdf: "0000:05:00.0"}}
  - {name: r9700-b, match: {bdf: "0000:08:00.0"}}
"""


def dead_url() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def cli(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "GPUGUARD_API"}
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})}, cwd=cwd)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "host"
    write_tree(build_scenario("incident"), str(root))
    return root


def test_every_daemon_command_answers_from_the_daemon_gpuguard_api_names(tmp_path, tree, start_daemon):
    # an engine nothing serves: the daemon lists it (its state is the daemon's answer)
    d = start_daemon(tree, NAMES + f"""engines:
  - {{name: vllm-x, kind: vllm, url: "{dead_url()}", gpus: [xtx-0], process: {{cmdline: "^no-such-engine "}}}}
""")
    env = {"GPUGUARD_API": d.base}
    # status: this host has no GPU, the daemon's simulated host has four named ones
    st = cli("status", env=env, cwd=tmp_path)
    assert st.returncode == 0, st.stdout + st.stderr
    assert st.stdout.splitlines()[0] == f"from the daemon at {d.base} (from $GPUGUARD_API)"
    assert "4/4 GPUs up" in st.stdout and "r9700-b" in st.stdout
    # the engine's kind shows once the watchdog has looked at it (before: "?")
    en = poll_until(lambda: (r := cli("engines", env=env, cwd=tmp_path)).returncode == 0
                    and r.stdout.splitlines()[1].split()[:2] == ["vllm-x", "vllm"] and r,
                    60, "the daemon's engines with the engine's kind", interval=0.5)
    assert en.stdout.splitlines()[1].split()[:2] == ["vllm-x", "vllm"], en.stdout
    ev = cli("events", "--json", env=env, cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    # --api beats the variable, for every command
    wrong = {"GPUGUARD_API": dead_url()}
    for args in (("status",), ("engines",), ("events",)):
        r = cli(*args, "--api", d.base, env=wrong, cwd=tmp_path)
        assert r.returncode == 0, (args, r.stderr)


@pytest.mark.parametrize("how", ["--api", "env"])
@pytest.mark.parametrize("command", ["status", "engines", "events"])
def test_a_named_daemon_that_does_not_answer_is_an_error_naming_its_url(command, how, tmp_path, tree):
    url = dead_url()
    args, env = ((command, "--api", url), None) if how == "--api" else ((command,), {"GPUGUARD_API": url})
    # a config whose sysfs_root has GPUs: `status` must not quietly read them instead
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"sysfs_root: {tree}\n")
    if command == "status":
        args = (*args, "--config", str(cfg))
    r = cli(*args, env=env, cwd=tmp_path)
    assert r.returncode != 0, r.stdout
    assert url in r.stderr and ("--api" if how == "--api" else "$GPUGUARD_API") in r.stderr, r.stderr
    assert "GPUs up" not in r.stdout and "Traceback" not in r.stderr


def test_status_without_a_daemon_says_it_read_this_host(tmp_path, tree):
    url = dead_url()
    port = url.rsplit(":", 1)[1]
    cfg = tmp_path / "gpuguard.yaml"
    cfg.write_text(f"sysfs_root: {tree}\nlisten: {{address: 127.0.0.1, port: {port}}}\n{NAMES}")
    r = cli("status", "--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first == f"no daemon at {url} (from the config's listen:); this host read directly below {tree}"
    assert second == "4/4 GPUs up"
