"""Hand-written mutants of the safety paths: the careless "safe" changes mutmut's operators
cannot make — a guard deleted, the audit record moved after the action, `os.kill` turned
into a process-group kill, an identity check dropped. Each is applied alone to a scratch
copy of the repository (the daemon and engines the tests start run the mutated copy too,
unlike mutmut, which counts only in-process calls), and its area's tests are run, slow
ones included. A mutant the tests pass is a blind spot: the run says so and exits 1.

    bench/mutation.sh --hand [--only ID]... [--list]      (or python3 bench/hand_mutants.py)

A mutant names its line by the exact text (stripped) and which occurrence: when the code
moves the run stops with "not found" rather than mutate something else. Add a row for each
such change a review or an incident shows could slip through.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str  # under daemon/gpuguard
    line: str  # the line as written, stripped (consecutive lines joined by "\n")
    becomes: tuple[str, ...]  # replacement lines at the same indent; () deletes the line
    tests: tuple[str, ...]  # pytest arguments
    why: str
    nth: int = 1  # which occurrence of `line` in the module


MUTANTS = (
    Mutant("audit-after-action", "control/routes.py", "ctx.before_act()", (), nth=3,
           tests=("tests/service/test_actions_audit_first.py::test_no_action_runs_before_its_audit_record",),
           why="kill/restart/reset/quarantine run without their write-ahead audit record"),
    Mutant("audit-moved-after", "control/routes.py",
           "ctx.before_act()\nreturn await _call(fn, ctx.target, caller.who, blocking=True), None",
           ("result = await _call(fn, ctx.target, caller.who, blocking=True)", "ctx.before_act()", "return result, None"),
           tests=("tests/service/test_actions_audit_first.py::test_no_action_runs_before_its_audit_record",),
           why="the audit record written after the action instead of before"),
    Mutant("kill-process-group", "engines/actions.py", "os.kill(pid, sig)", ("os.killpg(os.getpgid(pid), sig)",),
           tests=("tests/engines/test_kill_safety.py::test_the_kill_never_signals_the_launchers_process_group",),
           why="the engine kill signals its whole process group (the launcher's other jobs)"),
    Mutant("pid-file-trusted", "engines/process.py", "_trusted_pid_file(path, st, uid)", (),
           tests=("tests/engines/test_kill_safety.py",),
           why="a pid file anyone could have written aims the kill"),
    Mutant("identity-unchecked", "engines/process.py",
           "_check_identity(cfg, pid, pids, Path(folder) if folder is not None else None)", (),
           tests=("tests/engines/test_kill_safety.py",),
           why="what resolution found is killed without checking it is the engine (PID 1, its user)"),
    Mutant("kill-unguarded", "engines/actions.py",
           "targets = allowed(await asyncio.to_thread(_members, set(pids), cgroup))",
           ("targets = await asyncio.to_thread(_members, set(pids), cgroup)",),
           tests=("tests/engines/test_kill_safety.py::test_the_kill_never_signals_gpuguards_own_parents",
                  "tests/engines/test_actions_exact.py"),
           why="the kill signals gpuguard's parents or itself when handed their PIDs"),
    Mutant("nvml-index-unchecked", "profiles/nvidia.py", "if at != bdf:", ("if False:",),
           tests=("tests/nvml/test_nvml_profiles.py",),
           why="an NVML index that names another card now is written anyway (the card next door)"),
    Mutant("open-reads-opens-writes", "control/access.py", "def require_token(request: Request) -> Caller:",
           ("def require_token(request: Request) -> Caller:",
            "    if request.app.state.policy.open_reads:",
            "        return Caller('anonymous')"),
           tests=("tests/service/test_api.py",),
           why="api.open_reads lets a mutating route through without a token"),
    Mutant("act-on-unhealthy-ignored", "engines/watchdog.py", 'if v.state == "unhealthy" and not cfg.act_on_unhealthy:',
           ("if False:",),
           tests=("tests/engines/test_kill_on_stall.py::test_unhealthy_sglang_with_act_on_unhealthy_off_is_alerted_not_killed",),
           why="act_on_unhealthy: false ignored: an engine whose health fails is killed anyway"),
    Mutant("cmdline-any-process", "engines/config.py",
           "if self.cmdline and (what := matches_any_process(self.cmdline)):", ("if False:",),
           tests=("tests/engines/test_kill_safety.py",),
           why="config check accepts a cmdline regex that matches any process ('.')"),
)


def apply(tree: Path, m: Mutant) -> None:
    path = tree / "daemon" / "gpuguard" / m.module
    lines = path.read_text().splitlines(keepends=True)
    want = m.line.split("\n")
    hits = [i for i in range(len(lines)) if [x.strip() for x in lines[i:i + len(want)]] == want]
    if len(hits) < m.nth:
        raise SystemExit(f"{m.id}: {m.module} has {len(hits)} place(s) reading {m.line!r}, not an occurrence "
                         f"{m.nth}: the code moved; update the mutant")
    i = hits[m.nth - 1]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i:i + len(want)] = [indent + b + "\n" for b in m.becomes]
    path.write_text("".join(lines))


def run(m: Mutant, timeout: float) -> tuple[str, float, str]:
    """-> (killed | survived | timeout, seconds, the last lines of pytest's output)"""
    with tempfile.TemporaryDirectory(prefix=f"gpuguard-hand-{m.id}-") as tmp:
        tree = Path(tmp) / "repo"
        shutil.copytree(REPO, tree, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "results"))
        apply(tree, m)
        env = dict(os.environ, PYTHONPATH=str(tree / "daemon"))
        if (REPO.parent / "shared" / "reference").is_dir():
            env.setdefault("GPUGUARD_REFERENCE", str(REPO.parent / "shared" / "reference"))
        t0 = time.monotonic()
        # its own session: whatever the mutant makes the tests leave behind is ended with it
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
                             cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
            verdict = "survived" if p.returncode == 0 else "killed"
            if p.returncode in (4, 5):  # usage error, no tests collected: the mutant was never tried
                raise SystemExit(f"{m.id}: pytest exited {p.returncode}:\n{out[-2000:]}")
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            verdict = "timeout"
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return verdict, time.monotonic() - t0, "\n".join(out.strip().splitlines()[-3:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="ID", help="just this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant (default 900)")
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if not a.only or m.id in a.only]
    if a.list or not chosen:
        for m in MUTANTS:
            print(f"{m.id:22} {m.module:20} {m.why}")
        return 0 if a.list else 2
    survived = []
    for m in chosen:
        verdict, secs, tail = run(m, a.timeout)
        print(f"{m.id:22} {verdict:8} {secs:6.1f} s  {m.module}: {m.why}")
        if verdict == "survived":
            survived.append(m.id)
            print("    " + tail.replace("\n", "\n    "))
    print(f"{len(chosen)} hand mutants: {len(chosen) - len(survived)} caught, {len(survived)} survived"
          + (f" ({', '.join(survived)})" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
