"""Finding exactly the engine's processes — the kill's targets — from a /proc tree the test
writes, from processes the test starts, and from cgroup folders: /proc/PID/stat fields,
pid files (fresh, stale, garbage), command-line matches (the root of the matching tree,
never a launching shell, never gpuguard itself), cgroup members, the GPU-owning child, the
prompt batch from the command line. bench/mutation.sh found these answers unobserved."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from gpuguard.engines.config import EngineConfig
from gpuguard.engines.process import (
    CLK_TCK,
    ProcessLookupFailed,
    ProcStat,
    _by_cmdline,
    _cgroup_main,
    _is_shell_script,
    _pid_file,
    batch_tokens,
    cgroup_procs,
    find_main_pid,
    read_proc_stat,
    resolve,
)
from support import poll_until


def cfg(kind: str = "vllm", **process) -> EngineConfig:
    return EngineConfig.model_validate({"name": "e", "kind": kind, "url": "http://127.0.0.1:1", "process": process})


def fake_proc(tmp_path: Path, pid: int, stat: str, btime: str = "btime 1700000000\n") -> Path:
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / "stat").write_text(f"cpu  1 2 3\n{btime}processes 5\n")
    (proc / str(pid) / "stat").write_text(stat)
    return proc


# 52 fields after the comm; the ones read: state, pgid (3rd), utime/stime (12th, 13th), starttime (20th)
def stat_line(pid: int, comm: str, state="S", pgid=4321, utime=250, stime=150, start=12345) -> str:
    rest = [state, "1", str(pgid), "4321", "0", "-1", "4194304", "0", "0", "0", "0", str(utime), str(stime),
            "0", "0", "20", "0", "1", "0", str(start)] + ["0"] * 32
    return f"{pid} ({comm}) " + " ".join(rest) + "\n"


# ------------------------------------------------------------------ /proc/PID/stat


def test_stat_fields_after_a_comm_with_spaces_and_parentheses(tmp_path):
    proc = fake_proc(tmp_path, 77, stat_line(77, "python3 (x) y", state="R"))
    assert read_proc_stat(77, proc) == ProcStat(77, "R", 400 / CLK_TCK, 1700000000 + 12345 / CLK_TCK, 4321)


def test_stat_of_a_process_gone_is_none(tmp_path):
    proc = fake_proc(tmp_path, 77, stat_line(77, "x"))
    assert read_proc_stat(78, proc) is None


def test_stat_that_does_not_parse_names_the_file(tmp_path):
    proc = fake_proc(tmp_path, 77, "77 (x) S 1 notanumber\n")
    with pytest.raises(ProcessLookupFailed) as e:
        read_proc_stat(77, proc)
    assert str(e.value) == (f"{proc}/77/stat: unexpected content (invalid literal for int() with base 10: "
                            "'notanumber'): '77 (x) S 1 notanumber\\n'")
    proc2 = fake_proc(tmp_path / "b", 77, "77 (x) S 1 2\n")
    with pytest.raises(ProcessLookupFailed) as e:
        read_proc_stat(77, proc2)
    assert str(e.value) == f"{proc2}/77/stat: unexpected content (list index out of range): '77 (x) S 1 2\\n'"


def test_stat_without_the_boot_time(tmp_path):
    proc = fake_proc(tmp_path, 77, stat_line(77, "x"), btime="")
    with pytest.raises(ProcessLookupFailed) as e:
        read_proc_stat(77, proc)
    assert str(e.value) == f"{proc}/stat has no btime line"


def test_the_real_proc_of_this_process():
    st = read_proc_stat(os.getpid())
    assert (st.pid, st.pgid) == (os.getpid(), os.getpgid(0))
    assert abs(st.start_time - psutil.Process().create_time()) < 1.0


# ------------------------------------------------------------------ processes the test starts


@pytest.fixture
def spawn():
    procs = []

    def start(argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        procs.append(p)
        # Popen returns once the exec has begun (its pipe closes on exec), but the new
        # program's arguments appear in /proc/<pid>/cmdline a little later: beside a CPU
        # hog a test read an empty command line there. Wait until they are visible.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if psutil.Process(p.pid).cmdline():
                    break
            except psutil.Error:
                break  # gone already: the test sees that itself
            time.sleep(0.005)
        return p

    yield start
    for p in procs:
        try:
            for c in psutil.Process(p.pid).children(recursive=True):
                c.kill()
        except psutil.Error:
            pass
        if p.poll() is None:
            p.kill()
        p.wait(5)


def sleeper(tag: str) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(60)", tag]


def wait_children(pid: int, n: int) -> list[psutil.Process]:
    """`n` children of `pid` that have exec'd their own program. A child is listed from
    its fork on, and until its exec it still shows the parent's command line: a loaded
    machine (soak beside a CPU hog) caught one there and the GPU child was not matched."""
    parent = psutil.Process(pid)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            kids = [k for k in parent.children(recursive=True) if k.cmdline() != k.parent().cmdline()]
        except (psutil.NoSuchProcess, AttributeError):  # gone, or its parent gone (None)
            kids = []
        if len(kids) >= n:
            return kids
        time.sleep(0.02)
    raise AssertionError(f"{pid} did not start {n} children")


def test_pid_file_fresh_stale_missing_and_garbage(tmp_path, spawn):
    p = spawn(sleeper("pidfile"))
    f = tmp_path / "e.pid"
    f.write_text(f"{p.pid}\n")
    assert _pid_file(f) == p.pid
    start = psutil.Process(p.pid).create_time()
    os.utime(f, (start - 1.9, start - 1.9))  # written just before the process started: within the slack
    assert _pid_file(f) == p.pid
    os.utime(f, (start - 2.5, start - 2.5))  # written before this process existed: someone else's PID
    assert _pid_file(f) is None
    assert _pid_file(tmp_path / "none.pid") is None
    f.write_text("4194304999\n")  # no such process
    assert _pid_file(f) is None
    f.write_text("12ab\n")
    with pytest.raises(ProcessLookupFailed) as e:
        _pid_file(f)
    assert str(e.value) == f"pid file {f}: '12ab' is not a PID; fix or remove it"
    d = tmp_path / "dir.pid"
    d.mkdir()
    with pytest.raises(ProcessLookupFailed) as e:
        _pid_file(d)
    assert str(e.value) == f"pid file {d}: Is a directory"


def test_by_cmdline_the_root_of_the_matching_tree(spawn):
    tag = f"engine-{uuid.uuid4().hex[:8]}"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{tag}']); time.sleep(60)"
    parent = spawn([sys.executable, "-c", code, tag])
    (child,) = wait_children(parent.pid, 1)
    assert _by_cmdline(rf"{tag}$") == parent.pid
    assert _by_cmdline(r"no-such-engine-" + uuid.uuid4().hex) is None


def test_by_cmdline_the_oldest_of_unrelated_matches(spawn):
    tag = f"engine-{uuid.uuid4().hex[:8]}"
    first = spawn(sleeper(tag))
    time.sleep(0.05)
    spawn(sleeper(tag))
    assert _by_cmdline(rf"{tag}$") == first.pid


def test_by_cmdline_never_a_launching_shell_nor_ourselves(spawn):
    """The last check holds however pytest was started: a parent whose command line ends
    with pytest's own (`timeout 2400 python -m pytest …`) is gpuguard's parent, never
    matched (test_kill_safety.py runs it under such a parent)."""
    tag = f"engine-{uuid.uuid4().hex[:8]}"
    shell = spawn(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)' {tag}; true"])
    (engine,) = wait_children(shell.pid, 1)
    assert _by_cmdline(rf"-c import time; time.sleep\(60\) {tag}$") == engine.pid
    assert _by_cmdline(tag) == engine.pid  # the shell's own command line names the tag too
    me = " ".join(psutil.Process().cmdline())
    assert _by_cmdline(__import__("re").escape(me) + "$") is None


@pytest.mark.parametrize("argv,shell", [
    (["sh", "-c", "x"], True), (["/bin/bash", "-c", "x"], True), (["bash", "-x", "-c", "x"], True),
    (["busybox", "-c", "x"], True), (["bash", "script.sh"], False), (["python3", "-c", "x"], False),
    (["bash", "-e", "-x", "-c", "x"], False), ([], False),
])
def test_is_shell_script(argv, shell):
    assert _is_shell_script(argv) is shell


def test_cgroup_members_and_its_root(tmp_path, spawn):
    folder = tmp_path / "engine.scope"
    folder.mkdir()
    assert cgroup_procs(folder) is None
    (folder / "cgroup.procs").write_text("")
    assert cgroup_procs(folder) == [] and _cgroup_main(folder) is None
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    parent = spawn([sys.executable, "-c", code])
    (child,) = wait_children(parent.pid, 1)
    (folder / "cgroup.procs").write_text(f"{child.pid}\n{parent.pid}\nnot-a-pid\n4194304999\n")
    assert cgroup_procs(folder) == [child.pid, parent.pid, 4194304999]
    assert _cgroup_main(folder) == parent.pid  # its parent is outside the cgroup
    (folder / "cgroup.procs").write_text(f"{child.pid}\n")
    assert _cgroup_main(folder) == child.pid
    (folder / "cgroup.procs").write_text("4194304999\n")
    assert _cgroup_main(folder) is None


def test_a_cgroup_that_cannot_be_read(tmp_path):
    folder = tmp_path / "x.scope"
    (folder / "cgroup.procs").mkdir(parents=True)
    with pytest.raises(ProcessLookupFailed) as e:
        cgroup_procs(folder)
    assert str(e.value) == f"cgroup {folder}: cannot read cgroup.procs: Is a directory"


def test_find_main_pid_by_each_way(tmp_path, spawn):
    p = spawn(sleeper(f"find-{uuid.uuid4().hex[:8]}"))
    f = tmp_path / "e.pid"
    f.write_text(str(p.pid))
    assert find_main_pid(cfg(pid_file=str(f))) == p.pid
    folder = tmp_path / "e.scope"
    folder.mkdir()
    (folder / "cgroup.procs").write_text(str(p.pid))
    assert find_main_pid(cfg(cgroup=str(folder))) == p.pid
    assert find_main_pid(cfg(cmdline=psutil.Process(p.pid).cmdline()[-1] + "$")) == p.pid


# ------------------------------------------------------------------ resolve


def test_resolve_finds_the_gpu_child_the_tree_and_the_batch(tmp_path, spawn):
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
            "'EngineCore_0']); time.sleep(60)")
    parent = spawn([sys.executable, "-c", code, "--max-num-batched-tokens", "4096"], start_new_session=True)
    (core,) = wait_children(parent.pid, 1)
    f = tmp_path / "v.pid"
    f.write_text(str(parent.pid))
    procs = resolve(cfg("vllm", pid_file=str(f)))
    assert (procs.main_pid, procs.gpu_pid, procs.pids, procs.pgid, procs.note, procs.cgroup, procs.batch_tokens) == (
        parent.pid, core.pid, (parent.pid, core.pid), parent.pid, "", None, 4096)
    assert (procs.gpu_stat.pid, procs.gpu_stat.start_time) == (core.pid, read_proc_stat(core.pid).start_time)
    assert procs.main_start == read_proc_stat(parent.pid).start_time


def test_resolve_without_a_matching_child_says_so(tmp_path, spawn):
    p = spawn(sleeper("lonely"))
    f = tmp_path / "v.pid"
    f.write_text(str(p.pid))
    procs = resolve(cfg("vllm", pid_file=str(f)))
    assert (procs.gpu_pid, procs.note, procs.batch_tokens) == (p.pid, "", 8192)  # no children: nothing to match
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    parent = spawn([sys.executable, "-c", code])
    wait_children(parent.pid, 1)
    f.write_text(str(parent.pid))
    procs = resolve(cfg("vllm", pid_file=str(f), gpu_process="EngineCore"))
    assert (procs.gpu_pid, procs.note) == (parent.pid, "no child matches gpu_process 'EngineCore'; using the main process")


def test_resolve_adds_the_cgroups_members_and_names_the_folder(tmp_path, spawn):
    main = spawn(sleeper("main"))
    time.sleep(0.02)
    other = spawn(sleeper("member"))
    folder = tmp_path / "e.scope"
    folder.mkdir()
    (folder / "cgroup.procs").write_text(f"{main.pid}\n{other.pid}\n")
    procs = resolve(cfg("sglang", cgroup=str(folder)))
    # the older one is the root (both parents are outside the cgroup); the other is a member
    assert (procs.main_pid, procs.pids, procs.cgroup, procs.batch_tokens) == (
        main.pid, (main.pid, other.pid), folder, 8192)


def test_resolve_of_a_zombie_or_nothing_is_none(tmp_path, spawn):
    p = spawn(["true"])
    deadline = time.monotonic() + 5
    while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    f = tmp_path / "z.pid"
    f.write_text(str(p.pid))
    assert resolve(cfg(pid_file=str(f))) is None
    assert resolve(cfg(pid_file=str(tmp_path / "none.pid"))) is None


@pytest.mark.parametrize("kind,argv,configured,want", [
    ("llamacpp", ["llama-server", "-b", "512"], None, 512),
    ("llamacpp", ["llama-server", "--batch-size=1024"], None, 1024),
    ("llamacpp", ["llama-server", "--batch-size", "0"], None, 2048),  # not a size: the default
    ("llamacpp", ["llama-server", "-b"], None, 2048),  # flag without a value
    ("llamacpp", ["llama-server", "-b", "x12"], None, 2048),
    ("llamacpp", ["llama-server"], None, 2048),
    ("vllm", ["vllm", "serve", "--max-num-batched-tokens", "16384"], None, 16384),
    ("vllm", ["vllm", "serve"], None, 8192),
    ("sglang", ["python", "-m", "sglang", "--chunked-prefill-size=4096"], None, 4096),
    ("sglang", ["python", "-m", "sglang", "-b", "4096"], None, 8192),  # another engine's flag
    ("generic", ["engine", "-b", "4096"], None, None),
    ("unknown", ["engine"], None, None),
    ("vllm", ["vllm", "--max-num-batched-tokens", "16384"], 1000, 1000),  # the config wins
])
def test_batch_tokens(kind, argv, configured, want):
    assert batch_tokens(kind, argv, configured) == want


# ------------------------------------------------------------------ systemd units
# systemd is not PID 1 on a test machine: `systemctl` is a stand-in on PATH that logs its
# arguments and answers `show -p MainPID|ControlGroup --value UNIT` as the test says.

SYSTEMCTL = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
[ -n "$STUB_SLEEP" ] && sleep "$STUB_SLEEP"
[ "$3" = ControlGroup ] && [ -n "$STUB_CGROUP_SLEEP" ] && sleep "$STUB_CGROUP_SLEEP"
case "$3" in
  MainPID) printf '%s\\n' "$STUB_MAINPID" ;;
  ControlGroup) printf '%s\\n' "$STUB_CGROUP" ;;
esac
[ -n "$STUB_ERR" ] && echo "$STUB_ERR" >&2
[ "$3" = ControlGroup ] && exit "${STUB_CGROUP_RC:-0}"
exit "${STUB_RC:-0}"
"""


@pytest.fixture
def systemctl(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    log = tmp_path / "systemctl.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("STUB_LOG", str(log))

    def calls() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    def answer(**env: str) -> None:
        for k, v in env.items():
            monkeypatch.setenv(f"STUB_{k.upper()}", v)
    answer.calls = calls
    return answer


def test_a_units_main_pid_is_asked_of_systemd(systemctl):
    systemctl(mainpid="4242")
    assert find_main_pid(cfg(systemd_unit="vllm.service")) == 4242
    assert systemctl.calls() == ["show -p MainPID --value vllm.service"]


def test_a_unit_that_is_not_running_has_no_main_pid(systemctl):
    systemctl(mainpid="0")
    assert find_main_pid(cfg(systemd_unit="vllm.service")) is None


@pytest.mark.parametrize("answer,message", [
    (dict(mainpid="[not set]"), "unit vllm.service: MainPID '[not set]' is not a number"),
    (dict(mainpid="", rc="1", err="Failed to connect to bus: No such file or directory"),
     "unit vllm.service: systemctl show failed: Failed to connect to bus: No such file or directory"),
    (dict(mainpid="", rc="1"), "unit vllm.service: systemctl show failed: 1"),
    (dict(mainpid="", rc="4", err=""), "unit vllm.service: systemctl show failed: 4"),
])
def test_what_systemd_cannot_answer_is_said_with_the_unit(systemctl, answer, message):
    systemctl(**answer)
    with pytest.raises(ProcessLookupFailed) as ei:
        find_main_pid(cfg(systemd_unit="vllm.service"))
    assert str(ei.value) == message


def test_no_systemctl_on_the_host_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ProcessLookupFailed) as ei:
        find_main_pid(cfg(systemd_unit="vllm.service"))
    assert str(ei.value) == "unit vllm.service: systemctl not found; use process.pid_file or cmdline"


def test_a_systemctl_that_hangs_is_given_up_after_two_seconds(systemctl):
    systemctl(mainpid="4242", sleep="10")
    t0 = time.monotonic()
    with pytest.raises(ProcessLookupFailed) as ei:
        find_main_pid(cfg(systemd_unit="vllm.service"))
    assert str(ei.value) == "unit vllm.service: systemctl show timed out after 2 s"
    assert time.monotonic() - t0 < 9


def _cgroup_base() -> Path | None:
    """A cgroup hierarchy at one of the places gpuguard looks where this test may make one."""
    for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd")):
        if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
            return base
    return None


@pytest.fixture
def unit_cgroup():
    """A real cgroup (a `.scope` folder under the host's hierarchy) holding a main process
    and a helper that is no child of it: (folder, its ControlGroup value, main, helper)."""
    base = _cgroup_base()
    if base is None:
        pytest.skip("needs root and a writable cgroup hierarchy under /sys/fs/cgroup")
    name = f"gpuguard-test-{uuid.uuid4().hex[:8]}.scope"
    folder = base / name
    folder.mkdir()
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    helper = subprocess.Popen(["sleep", "60"])
    try:
        for p in (main, helper):
            (folder / "cgroup.procs").write_text(f"{p.pid}\n")
        yield folder, f"/{name}", main, helper
    finally:
        for p in (main, helper):
            p.kill()
            p.wait(5)
        poll_until(lambda: not (folder / "cgroup.procs").read_text().split(), 10, "the test cgroup empty")
        folder.rmdir()


@pytest.mark.root
def test_a_units_processes_include_its_cgroup_found_through_systemd(systemctl, unit_cgroup):
    """`systemd_unit`: the main PID and the unit's cgroup (ControlGroup, under the unified,
    v2 or name=systemd tree): a helper in the cgroup that is no child of the engine is one
    of the engine's processes."""
    folder, control_group, main, helper = unit_cgroup
    systemctl(mainpid=str(main.pid), cgroup=control_group)
    procs = resolve(cfg(systemd_unit="gpuguard-test.service"))
    assert (procs.main_pid, procs.cgroup) == (main.pid, folder)
    assert procs.pids == (main.pid, helper.pid)
    assert systemctl.calls() == ["show -p MainPID --value gpuguard-test.service",
                                 "show -p ControlGroup --value gpuguard-test.service"]


@pytest.mark.root
def test_a_units_cgroup_that_systemd_names_later_than_two_seconds_is_not_waited_for(systemctl, unit_cgroup):
    """The unit's cgroup exists, but systemctl takes 2.4 s to name it: past its 2 s the
    lookup gives up, and the engine's processes are its tree alone."""
    folder, control_group, main, helper = unit_cgroup
    systemctl(mainpid=str(main.pid), cgroup=control_group, cgroup_sleep="2.4")
    procs = resolve(cfg(systemd_unit="gpuguard-test.service"))
    assert (procs.main_pid, procs.pids, procs.cgroup) == (main.pid, (main.pid,), None)


@pytest.mark.parametrize("answer", [dict(cgroup=""), dict(cgroup="/no-such.scope"), dict(cgroup="/x.scope", cgroup_rc="1")])
def test_a_unit_without_a_cgroup_systemd_can_show_is_its_process_tree(systemctl, answer):
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        systemctl(mainpid=str(main.pid), **answer)
        procs = resolve(cfg(systemd_unit="gpuguard-test.service"))
        assert (procs.main_pid, procs.pids, procs.cgroup) == (main.pid, (main.pid,), None)
    finally:
        main.kill()
        main.wait(5)


# ------------------------------------------------------------------ exact edges

def test_garbage_in_a_stat_file_is_quoted_up_to_120_characters(tmp_path):
    raw = "77 (x) " + "y" * 200 + "\n"
    proc = fake_proc(tmp_path, 77, raw)
    with pytest.raises(ProcessLookupFailed) as e:
        read_proc_stat(77, proc)
    assert str(e.value) == f"{proc}/77/stat: unexpected content (list index out of range): {raw[:120]!r}"


def test_a_long_garbage_pid_file_is_quoted_up_to_40_characters(tmp_path):
    f = tmp_path / "v.pid"
    f.write_text("x" * 60)
    with pytest.raises(ProcessLookupFailed) as e:
        _pid_file(f)
    assert str(e.value) == f"pid file {f}: {'x' * 40!r} is not a PID; fix or remove it"


def test_a_cgroup_member_already_gone_is_passed_over(tmp_path, spawn):
    gone = spawn(["true"])
    gone.wait(5)
    live = spawn(sleeper("live"))
    folder = tmp_path / "e.scope"
    folder.mkdir()
    (folder / "cgroup.procs").write_text(f"{gone.pid}\n{live.pid}\n")
    assert _cgroup_main(folder) == live.pid


def test_a_batch_of_one_token_is_a_size():
    assert batch_tokens("vllm", ["vllm", "serve", "--max-num-batched-tokens", "1"]) == 1


def test_resolve_reads_the_given_proc_tree(tmp_path, spawn):
    """The /proc it is given, not the machine's: the main process a zombie there is no engine;
    the GPU process's figures come from there too."""
    p = spawn(sleeper("main"))
    f = tmp_path / "v.pid"
    f.write_text(str(p.pid))
    zombie = fake_proc(tmp_path / "z", p.pid, stat_line(p.pid, "python3", state="Z"))
    assert resolve(cfg(pid_file=str(f)), zombie) is None
    fake = fake_proc(tmp_path / "s", p.pid, stat_line(p.pid, "python3", state="S", utime=700, stime=300))
    procs = resolve(cfg(pid_file=str(f)), fake)
    assert (procs.main_pid, procs.gpu_stat.state, procs.gpu_stat.cpu_seconds) == (p.pid, "S", 1000 / CLK_TCK)


def test_resolve_takes_every_descendant_and_the_configured_batch(tmp_path, spawn):
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import subprocess, sys, time; subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"]); "
            "time.sleep(60)']); time.sleep(60)")
    parent = spawn([sys.executable, "-c", code, "--max-num-batched-tokens", "4096"], start_new_session=True)
    kids = wait_children(parent.pid, 2)
    f = tmp_path / "v.pid"
    f.write_text(str(parent.pid))
    procs = resolve(EngineConfig.model_validate({"name": "e", "kind": "vllm", "url": "http://127.0.0.1:1",
                                                 "prefill_batch_tokens": 1000, "process": {"pid_file": str(f)}}))
    assert procs.pids == (parent.pid, *(k.pid for k in kids)) and len(procs.pids) == 3
    assert procs.batch_tokens == 1000   # the config wins over the command line's 4096


def test_a_systemctl_that_hangs_on_the_cgroup_leaves_the_process_tree_after_two_seconds(systemctl):
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        systemctl(mainpid=str(main.pid), cgroup="/system.slice/x.service", cgroup_sleep="10")
        t0 = time.monotonic()
        procs = resolve(cfg(systemd_unit="x.service"))
        took = time.monotonic() - t0
        assert (procs.main_pid, procs.pids, procs.cgroup) == (main.pid, (main.pid,), None)
        assert 1.9 < took < 9, took   # systemctl's 2 s, not its 10 s
    finally:
        main.kill()
        main.wait(5)


def test_the_gpu_process_pattern_sees_the_arguments_joined_by_spaces(tmp_path, spawn):
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
            "'EngineCore_0', '--rank', '0']); time.sleep(60)")
    parent = spawn([sys.executable, "-c", code])
    (core,) = wait_children(parent.pid, 1)
    f = tmp_path / "v.pid"
    f.write_text(str(parent.pid))
    procs = resolve(cfg("vllm", pid_file=str(f), gpu_process=r"EngineCore_0 --rank 0$"))
    assert (procs.gpu_pid, procs.note) == (core.pid, "")
