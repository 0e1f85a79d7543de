"""The README's five-minute tour, run as written: the command lines are read from the
README's "A five-minute tour" block and run one by one (`gpuguard` as `python -m
gpuguard`, `CMD &` in the background, `kill %1` stops that background job, `export`
sets the variable the demo printed); after each step the test waits for what the
comment promises — by polling, never by sleeping.

The demo runs on a port other than 9436 (the test holds 9436 while it starts, as a
gpuguard already running would) and only GPUGUARD_API points the commands at it. Its
folder is this test's own (the README's /tmp/gpuguard-tour, moved under tmp_path), and
the FUSE mount is unmounted however the test ends: a demo killed after a failure left a
dead mount ("Transport endpoint is not connected") in a shared /tmp path."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


README = Path(__file__).resolve().parents[2] / "README.md"
README_DIR = "/tmp/gpuguard-tour"  # the tour's folder as the README writes it
DEFAULT_PORT = 9436


def tour_lines() -> list[str]:
    text = README.read_text()
    m = re.search(r"### A five-minute tour.*?```sh\n(.*?)```", text, re.S)
    assert m, "README has no '### A five-minute tour' sh block"
    lines = []
    for raw in m.group(1).splitlines():
        cmd = raw.split("  #", 1)[0].strip()  # a comment after two spaces
        if cmd and not cmd.startswith("#"):
            lines.append(cmd)
    return lines


def hold_port(port: int) -> socket.socket | None:
    """Listen on `port` so the demo must take another one; None when it is taken already
    (the demo moves off it all the same)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    s.listen()
    return s


def mounts_below(folder: Path) -> list[str]:
    """Mount points at or below `folder` (from /proc/self/mountinfo, octal escapes undone)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == str(folder) or point.startswith(f"{folder}/"):
                out.append(point)
    return out


def stop_demo(proc: subprocess.Popen | None, folder: Path) -> None:
    """The tour's cleanup, whatever happened: stop the demo (Ctrl-C first: it unmounts
    its own tree), SIGKILL only if it will not stop, then unmount anything still mounted
    below its folder — a killed FUSE server leaves its mount behind, dead."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    for point in reversed(mounts_below(folder)):
        r = subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True, text=True)
        if r.returncode != 0 and os.geteuid() == 0:
            subprocess.run(["umount", "-l", point], capture_output=True)


def recorded_kinds(db: Path) -> set[str]:
    """The kinds of the events committed to a flight recorder file (read-only, as the report reads it)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as c:
            return {k for (k,) in c.execute("SELECT DISTINCT kind FROM events")}
    except sqlite3.Error:
        return set()


def test_readme_tour_works_as_written(tmp_path, wait_for, monkeypatch):
    lines = tour_lines()
    assert lines[0].startswith("gpuguard demo") and lines[0].endswith("&") and lines[-1] == "kill %1"
    assert f"--dir {README_DIR}" in lines[0], lines[0]
    folder = tmp_path / "gpuguard-tour"  # this test's own, not a shared /tmp path
    # only GPUGUARD_API (once the tour exports it) tells the commands where the demo is
    monkeypatch.delenv("GPUGUARD_API", raising=False)
    env = dict(os.environ)
    # the tour's `gpuguard sim` uses the default control socket: point it at this test's own
    env["GPUGUARD_SIM_SOCKET"] = str(tmp_path / "sim.sock")
    background: subprocess.Popen | None = None
    api: str | None = None  # the URL the demo printed
    printed: str | None = None  # its `export GPUGUARD_API=...` line
    outputs: dict[str, str] = {}

    def argv(cmd: str) -> list[str]:
        words = shlex.split(cmd.replace(README_DIR, str(folder)))
        assert words[0] == "gpuguard", cmd
        return [sys.executable, "-m", "gpuguard", *words[1:]]

    def events() -> list[dict]:
        return httpx.get(f"{api}/v1/events", timeout=5).json()

    held = hold_port(DEFAULT_PORT)
    try:
        for cmd in lines:
            if cmd.endswith("&"):
                background = subprocess.Popen(argv(cmd[:-1]), cwd=tmp_path, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True, env=env)
                banner = []
                for line in background.stdout:
                    banner.append(line)
                    if "Ctrl-C stops it" in line:
                        break
                if held is not None:
                    held.close()
                    held = None
                text = "".join(banner)
                page = re.search(r"^  page:      (http://127\.0\.0\.1:(\d+))/$", text, re.M)
                assert page, text
                api = page.group(1)
                assert int(page.group(2)) != DEFAULT_PORT, "the demo should have moved off the busy 9436"
                (printed,) = [l.strip() for l in banner if l.strip().startswith("export GPUGUARD_API=")]
                assert printed == f"export GPUGUARD_API={api}", text
                # "open the page it prints": the page and what it reads answer
                page_doc = httpx.get(f"{api}/", timeout=10)
                assert page_doc.status_code == 200 and "/page/page.js" in page_doc.text
                wait_for(lambda: httpx.get(f"{api}/v1/history?since=0", timeout=5).json()["gpus"], timeout=30,
                         what="recorder history behind the page")
                wait_for(lambda: any(e["kind"] == "engine_ready" for e in events()), timeout=60, what="engine ready")
                continue
            if cmd.startswith("export "):
                # the README shows the line for the default port; a person pastes what the demo printed
                name, _, _ = cmd[len("export "):].partition("=")
                assert name == "GPUGUARD_API" and printed is not None, cmd
                env[name] = printed.partition("=")[2]
                continue
            if cmd == "kill %1":
                assert background is not None
                background.send_signal(signal.SIGTERM)
                out, _ = background.communicate(timeout=60)
                assert background.returncode == 0, out
                assert "Traceback" not in out
                background = None
                continue
            res = subprocess.run(argv(cmd), cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
            assert res.returncode == 0, f"{cmd}: {res.stdout}{res.stderr}"
            outputs[cmd] = res.stdout
            if cmd == "gpuguard status":
                assert res.stdout.splitlines()[0] == f"from the daemon at {api} (from $GPUGUARD_API)", res.stdout
                assert res.stdout.splitlines()[1] == "4/4 GPUs up", res.stdout
            elif cmd == "gpuguard sim scenarios":
                assert "incident-chipset" in res.stdout
            elif cmd == "gpuguard sim engine stall":
                wait_for(lambda: any(e["kind"] == "engine_killed" for e in events()), timeout=90,
                         what="the stalled engine killed", interval=0.5)
            elif cmd == "gpuguard engines":
                assert res.stdout.splitlines()[1].startswith("vllm-demo "), res.stdout  # the demo's engine
            elif cmd.startswith("gpuguard sim lose"):
                wait_for(lambda: {"device_lost", "gpu_lost"} <= {e["kind"] for e in events() if e["gpu"] == "xtx-1"},
                         timeout=60, what="xtx-1 lost", interval=0.5)
                # events reach flight.sqlite with the poll cycle after the API has them: the
                # report below reads the file, so wait for the loss to be committed there
                wait_for(lambda: recorded_kinds(folder / "state" / "flight.sqlite") >= {"device_lost", "gpu_lost"},
                         timeout=30, what="the loss in the flight recorder", interval=0.2)
            elif cmd.startswith("gpuguard events"):
                assert "device_lost" in res.stdout and "xtx-1" in res.stdout
            elif cmd.startswith("gpuguard report"):
                html = (tmp_path / "tour.html").read_text()
                assert "device lost from bus!" in html and "<svg" in html
                assert (tmp_path / "tour.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            elif cmd.startswith("gpuguard record"):
                assert "device_lost" in res.stdout and "engine_killed" in res.stdout
        assert "GPUGUARD_API" in env, "the tour points the commands at the demo"
        assert any(c.startswith("gpuguard report") for c in outputs), "the tour reads a report"
        assert {"gpuguard status", "gpuguard engines"} <= set(outputs) and any(
            c.startswith("gpuguard events") for c in outputs), "every daemon command is in the tour"
    finally:
        if held is not None:
            held.close()
        stop_demo(background, folder)
    assert not mounts_below(folder)


def test_tour_cleanup_after_a_failure_leaves_no_mount(tmp_path):
    """A demo that dies without its own stop (SIGKILL, as after a failed assertion)
    leaves its FUSE mount; the tour's cleanup unmounts it, and the folder can go."""
    from gpuguard.sim.fuse import fuse_available

    reason = fuse_available()
    if reason:
        pytest.skip(f"FUSE not usable here ({reason}); the demo serves a plain tree, nothing to unmount")
    folder = tmp_path / "gpuguard-tour"
    demo = subprocess.Popen([sys.executable, "-m", "gpuguard", "demo", "--dir", str(folder), "--port", "0",
                             "--no-engine", "--control", str(tmp_path / "sim.sock")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in demo.stdout:
            if "Ctrl-C stops it" in line:
                break
        assert mounts_below(folder) == [str(folder / "root")]
        demo.kill()  # no clean stop: the mount stays, its server gone
        demo.communicate(timeout=30)
        with pytest.raises(OSError) as dead:
            os.listdir(folder / "root")
        assert dead.value.errno == errno.ENOTCONN
    finally:
        stop_demo(demo, folder)
    assert not mounts_below(folder)
    os.listdir(folder)  # the folder is readable again: pytest can remove it
