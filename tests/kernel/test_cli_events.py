"""`gpuguard events` as a user runs it: a real process, real files, stdin, a real HTTP
server standing in for the daemon's API."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "daemon")}


def gpuguard(*args: str, stdin: bytes | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuguard", *args], input=stdin, capture_output=True,
                          env=ENV, timeout=timeout)


@pytest.fixture
def dmesg_file(tmp_path, labelled) -> tuple[Path, list[dict]]:
    """The labelled sample as `dmesg` prints it, one stamp per line."""
    items = [i for i in labelled if "\n" not in i["text"]]
    lines = [f"[{100 + n:>5}.{n:06d}] {i['text']}" for n, i in enumerate(items)]
    path = tmp_path / "dmesg.txt"
    path.write_text("\n".join(lines) + "\n")
    return path, items


def _expected_kinds(items: list[dict]) -> dict[int, set[str]]:
    out = {}
    for n, i in enumerate(items, 1):
        allowed = {i["label"], *(i.get("alt_labels") or [])}
        if i.get("role") == "context":
            allowed.add("none")
        out[n] = allowed
    return out


def test_classify_a_dmesg_file_json(dmesg_file):
    path, items = dmesg_file
    res = gpuguard("events", "classify", str(path), "--json", "--all")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["messages"] == len(items)
    expected = _expected_kinds(items)
    for entry in data["entries"]:
        assert (entry["kind"] or "none") in expected[entry["line"]], entry
        assert entry["format"] == "dmesg" and entry["stamp"].startswith("[")
    classified = [e for e in data["entries"] if e["kind"]]
    assert data["classified"] == len(classified) == sum(data["by_kind"].values())
    xids = {e["xid"] for e in classified if e["kind"] == "nvidia_xid"}
    assert {13, 31, 43, 79} <= xids


def test_classify_from_stdin_human_output(dmesg_file):
    path, items = dmesg_file
    res = gpuguard("events", "classify", "-", stdin=path.read_bytes())
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    summary = out.strip().splitlines()[-1]
    assert summary.startswith(f"<stdin>: {len(items)} messages, ")
    assert "gpu_hang" in out and "nvidia_xid" in out and "xid=79" in out
    # Benign lines are not listed without --all.
    assert "uses VM inv eng" not in out
    # --json before the subcommand works too.
    res2 = gpuguard("events", "--json", "classify", "-", stdin=path.read_bytes())
    assert json.loads(res2.stdout)["file"] == "<stdin>"


def test_classify_raw_kmsg_and_journal_text(tmp_path, reference):
    res = gpuguard("events", "classify", str(reference / "kmsg" / "raw_records.txt"), "--json")
    data = json.loads(res.stdout)
    assert data["messages"] == data["classified"] == 12
    by_seq = {e["seq"]: e for e in data["entries"]}
    assert by_seq[41207]["bdf"] == "0000:db:00.0" and by_seq[41207]["kind"] == "gpu_hang"
    assert by_seq[41270]["kind"] == "device_lost" and by_seq[41270]["bdf"] == "0000:a5:00.0"
    journal = tmp_path / "journal.txt"
    journal.write_text(
        "Nov 29 02:57:59 gpuhost systemd[1]: Started sglang.service: ring gfx timeout, signaled seq=1\n"
        "Nov 29 02:58:01 gpuhost kernel: amdgpu: sq_intr: error, detail 0x00000000, type 1, sh 0, priv 1, wave_id 0, simd_id 0, wgp_id 0\n"
        "Nov 29 02:58:40 gpuhost kernel: amdgpu 0000:aa:00.0: amdgpu: device lost from bus!\n"
        "Nov 29 02:58:41 gpuhost kernel: NVRM: The NVIDIA GPU 0000:17:00.0\n"
        "                                NVRM: (PCI ID: 10de:2330) installed in this system has\n"
        "                                NVRM: fallen off the bus and is not responding to commands.\n"
        "2026-11-29T02:58:42+0000 gpuhost kernel: amdgpu 0000:aa:00.0: amdgpu: GPU Recovery Failed: -19\n"
    )
    data = json.loads(gpuguard("events", "classify", str(journal), "--json").stdout)
    kinds = [(e["line"], e["kind"], e["bdf"]) for e in data["entries"]]
    assert kinds == [(2, "sq_interrupt", None), (3, "device_lost", "0000:aa:00.0"),
                     (4, "device_lost", "0000:17:00.0"), (7, "gpu_reset_failed", "0000:aa:00.0")]
    assert data["messages"] == 4  # the systemd line is not a kernel message


def test_classify_errors_are_clear(tmp_path):
    res = gpuguard("events", "classify", str(tmp_path / "missing.log"))
    assert res.returncode == 2
    assert b"missing.log: no such file" in res.stderr and b"Traceback" not in res.stderr
    bad = tmp_path / "rules.yaml"
    bad.write_text("rules:\n  - kind: x\n    pattern: '(('\n")
    res = gpuguard("events", "classify", "-", "--rules", str(bad), stdin=b"")
    assert res.returncode == 2 and b"rules.yaml:2: rule 0" in res.stderr
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    res = gpuguard("events", "classify", str(empty))
    assert res.returncode == 0 and b"no kernel messages found" in res.stdout
    garbage = tmp_path / "garbage.log"
    garbage.write_bytes(bytes(range(256)) * 4)
    res = gpuguard("events", "classify", str(garbage), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["classified"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_events_without_a_daemon_says_so():
    port = _free_port()
    res = gpuguard("events", "--api", f"http://127.0.0.1:{port}", timeout=20)
    assert res.returncode == 1
    err = res.stderr.decode()
    assert f"no gpuguard daemon API reachable at http://127.0.0.1:{port}" in err
    assert "gpuguard events classify FILE" in err and "Traceback" not in err


def test_events_lists_the_daemon_api_answer(tmp_path):
    now = time.time()
    events = [
        {"kind": "gpu_hang", "severity": "alert", "source": "kernel", "message": "ring gfx_0.0.0 timeout",
         "gpu": "gpu0", "bdf": "0000:aa:00.0", "engine": None, "time": now - 30, "fields": {}},
        {"kind": "oom_kill", "severity": "alert", "source": "kernel", "message": "Out of memory: Killed process 1",
         "gpu": None, "bdf": None, "engine": None, "time": now - 7200, "fields": {}},
    ]
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "events").write_text(json.dumps({"events": events}))
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.02)
        api = f"http://127.0.0.1:{port}"
        res = gpuguard("events", "--api", api)
        assert res.returncode == 0, res.stderr
        out = res.stdout.decode()
        assert "gpu_hang" in out and "gpu0" in out and "oom_kill" in out
        res = gpuguard("events", "--api", api, "--since", "1h", "--json")
        listed = json.loads(res.stdout)["events"]
        assert [e["kind"] for e in listed] == ["gpu_hang"]
        res = gpuguard("events", "--api", api, "--since", "soon")
        assert res.returncode == 2 and b"not a duration" in res.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)
