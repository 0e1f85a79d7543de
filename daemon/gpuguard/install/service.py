"""What `gpuguard install-service` and `uninstall-service` do, as a plan of steps that
can be printed (--dry-run) or carried out, below any root directory (a temporary root in
tests, a container image, "/" on a host).

Install writes:
  /etc/systemd/system/gpuguard.service  0644  the shipped unit, ExecStart=/ExecReload=
                                              pointing at the gpuguard being run
  /etc/gpuguard/                        0755
  /etc/gpuguard/gpuguard.yaml           0600  the annotated example, api.token_file set
                                              (0600: webhook URLs carry secrets)
  /etc/gpuguard/api-tokens              0600  `admin: <64 hex>` (control/auth.py refuses a
                                              token file others can read)
  /usr/local/bin/gpuguard               link  to the venv's script, when nothing is there
then `systemctl daemon-reload` and `systemctl enable [--now] gpuguard.service`
(`systemctl --root=DIR enable` below another root: links only, nothing started).

Idempotent: an existing config or token file is never replaced (an operator's edits and
tokens survive a re-install); the unit is rewritten only when its text differs. An
existing token file that others can read gets mode 0600, said in the output (the daemon
refuses to start with it otherwise). Folders it creates are 0755 whatever the umask.
Refused, with the reason: a gpuguard under /tmp or /var/tmp (the unit's PrivateTmp=
hides it from the service) and `--now` below another root (nothing is started there).
Uninstall disables and stops the service and removes the unit only if install-service
wrote it; the config, the tokens, /var/lib/gpuguard and the command link are kept.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

UNIT_NAME = "gpuguard.service"
UNIT_DIR = "etc/systemd/system"
CONFIG_DIR = "etc/gpuguard"
CONFIG_NAME = "gpuguard.yaml"
TOKENS_NAME = "api-tokens"
LINK = "usr/local/bin/gpuguard"
# The first line of a unit we wrote: uninstall removes only such a file.
MARK = "# Written by `gpuguard install-service`; re-run it to update, `gpuguard uninstall-service` removes it."


class InstallError(Exception):
    """A step that cannot be carried out; the message names the file and what to do."""


@dataclass(frozen=True)
class Step:
    """One thing to do. `path` is relative to the root; `content`/`mode` for files."""
    action: str  # write | mkdir | chmod | link | remove | run | keep
    path: str = ""
    mode: int | None = None
    content: str | None = None
    target: str | None = None  # link target
    argv: tuple[str, ...] = ()
    why: str = ""

    def describe(self, root: Path) -> str:
        where = str(root / self.path) if self.path else ""
        mode = f" (mode {self.mode:04o})" if self.mode is not None else ""
        if self.action == "write":
            return f"write {where}{mode}: {self.why}"
        if self.action == "mkdir":
            return f"create directory {where}{mode}"
        if self.action == "chmod":
            return f"fix mode of {where}: {self.why}"
        if self.action == "link":
            return f"link {where} -> {self.target}"
        if self.action == "remove":
            return f"remove {where}: {self.why}"
        if self.action == "run":
            return "run: " + " ".join(self.argv)
        return f"keep {where}: {self.why}"


@dataclass(frozen=True)
class Plan:
    root: Path
    steps: tuple[Step, ...] = field(default_factory=tuple)

    def describe(self) -> list[str]:
        return [s.describe(self.root) for s in self.steps]


def packaged(name: str) -> str:
    return (resources.files("gpuguard.install") / name).read_text()


def default_executable() -> Path:
    """The gpuguard console script of the installation being run: the venv's (pipx or
    /opt/gpuguard) bin/gpuguard, else the one on PATH."""
    candidate = Path(sys.prefix) / "bin" / "gpuguard"
    if candidate.is_file():
        return candidate
    found = shutil.which("gpuguard")
    if found:
        return Path(found)
    raise InstallError(
        f"cannot find the gpuguard command (not at {candidate}, not on PATH); "
        "pass --exec /path/to/bin/gpuguard"
    )


def unit_text(executable: Path) -> str:
    text = packaged(UNIT_NAME)
    exe = str(executable)
    if any(c.isspace() for c in exe):
        raise InstallError(f"the gpuguard path {exe!r} contains white space; install it in a path without")
    if re.search(r"^PrivateTmp=(yes|true|on|1)\s*$", text, re.M):
        for tmp in ("/tmp", "/var/tmp"):
            if any(p == Path(tmp) or Path(tmp) in p.parents for p in (Path(exe), Path(os.path.realpath(exe)))):
                raise InstallError(
                    f"ExecStart={exe} lies under {tmp}, and the unit runs with PrivateTmp=yes (its own empty "
                    f"{tmp}): the service could never start. Install gpuguard outside /tmp and /var/tmp "
                    "(e.g. python3 -m venv /opt/gpuguard, or pipx) and run install-service from there, or pass --exec")
    text, n_start = re.subn(r"^ExecStart=\S+ run ", f"ExecStart={exe} run ", text, count=1, flags=re.M)
    text, n_reload = re.subn(r"^ExecReload=\S+ reload ", f"ExecReload={exe} reload ", text, count=1, flags=re.M)
    if n_start != 1 or n_reload != 1:
        raise InstallError("the packaged gpuguard.service has no ExecStart=/ExecReload= line to point at gpuguard")
    return MARK + "\n" + text


def config_text(token_file: str) -> str:
    text = packaged(CONFIG_NAME)
    text, n = re.subn(r"^(  token_file:) null\b[^\n]*", rf"\1 {token_file}", text, count=1, flags=re.M)
    if n != 1:
        raise InstallError("the packaged example config has no `  token_file: null` line under api:")
    return text


def token_text() -> str:
    return (
        "# gpuguard API tokens, `name: token` (written by gpuguard install-service).\n"
        "# Use: curl -H \"Authorization: Bearer <token>\" ...; add one per person or tool.\n"
        f"admin: {secrets.token_hex(32)}\n"
    )


def plan_install(root: Path, executable: Path, start: bool = False) -> Plan:
    root = Path(root)
    if start and root.resolve() != Path("/"):
        raise InstallError(f"--now starts the service on this host, but --root {root} installs into another tree, "
                           "where nothing is started (only its [Install] links are made): drop --now, and start it "
                           "where that tree runs")
    steps: list[Step] = []
    unit = f"{UNIT_DIR}/{UNIT_NAME}"
    text = unit_text(executable)
    if _read(root / unit) == text:
        steps.append(Step("keep", unit, why="unchanged"))
    else:
        steps.append(Step("write", unit, 0o644, text, why=f"the unit, ExecStart={executable} run --config /{CONFIG_DIR}/{CONFIG_NAME}"))
    if not (root / CONFIG_DIR).is_dir():
        steps.append(Step("mkdir", CONFIG_DIR, 0o755))
    tokens = f"{CONFIG_DIR}/{TOKENS_NAME}"
    config = f"{CONFIG_DIR}/{CONFIG_NAME}"
    if (root / config).exists():
        steps.append(Step("keep", config, why="exists (never overwritten; `gpuguard config check` it)"))
    else:
        steps.append(Step("write", config, 0o600, config_text(f"/{tokens}"),
                          why=f"the annotated example, api.token_file: /{tokens}"))
    if os.path.lexists(root / tokens):
        st = os.lstat(root / tokens)
        if not stat.S_ISREG(st.st_mode):  # never chmod through a link: it may point anywhere
            raise InstallError(f"{root / tokens} exists but is not a regular file (a link or a folder); the daemon "
                               "refuses it as api.token_file: move it away and re-run install-service")
        steps.append(Step("keep", tokens, why="exists (never overwritten)"))
        held = stat.S_IMODE(st.st_mode)
        if held & 0o077:  # control/auth.py refuses it: the service would not start
            steps.append(Step("chmod", tokens, 0o600, why=f"{held:04o} -> 0600 (others could read the tokens, and "
                                                          "the daemon refuses such a file; consider new tokens)"))
    else:
        steps.append(Step("write", tokens, 0o600, token_text(), why="one new random token named admin"))
    if str(executable) != f"/{LINK}" and not os.path.lexists(root / LINK):
        steps.append(Step("link", LINK, target=str(executable)))
    enable = ("systemctl", "enable", "--now", UNIT_NAME) if start else ("systemctl", "enable", UNIT_NAME)
    if root.resolve() == Path("/"):
        steps.append(Step("run", argv=("systemctl", "daemon-reload")))
        steps.append(Step("run", argv=enable))
    else:
        # offline below another root: the [Install] links only, nothing is started
        steps.append(Step("run", argv=("systemctl", f"--root={root}", "enable", UNIT_NAME)))
    return Plan(root, tuple(steps))


def plan_uninstall(root: Path) -> Plan:
    root = Path(root)
    steps: list[Step] = []
    unit = f"{UNIT_DIR}/{UNIT_NAME}"
    ours = (_read(root / unit) or "").startswith(MARK)
    live = root.resolve() == Path("/")
    if (root / unit).exists():
        if live:
            steps.append(Step("run", argv=("systemctl", "disable", "--now", UNIT_NAME)))
        else:
            steps.append(Step("run", argv=("systemctl", f"--root={root}", "disable", UNIT_NAME)))
        if ours:
            steps.append(Step("remove", unit, why="written by install-service"))
        else:
            steps.append(Step("keep", unit, why="not written by install-service (no marker line): remove it yourself"))
        if live:
            steps.append(Step("run", argv=("systemctl", "daemon-reload")))
    # the command link stays: it may be pipx's, and it goes with the venv it points into
    if os.path.lexists(root / LINK):
        steps.append(Step("keep", LINK, why="the gpuguard command; remove it together with its venv"))
    for kept in (f"{CONFIG_DIR}/{CONFIG_NAME}", f"{CONFIG_DIR}/{TOKENS_NAME}", "var/lib/gpuguard"):
        if (root / kept).exists():
            steps.append(Step("keep", kept, why="config, tokens and state are kept; remove them yourself if wanted"))
    return Plan(root, tuple(steps))


def carry_out(plan: Plan, out=sys.stdout) -> None:
    for step in plan.steps:
        print(step.describe(plan.root), file=out)
        target = plan.root / step.path
        try:
            if step.action == "write":
                _make_parents(target)
                tmp = target.with_name(f".{target.name}.new")
                # created with its final mode: a token file is never readable by others, not even briefly
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, step.mode)
                with os.fdopen(fd, "w") as f:
                    f.write(step.content)
                os.chmod(tmp, step.mode)
                os.replace(tmp, target)
            elif step.action == "mkdir":
                _make_parents(target)
                target.mkdir(exist_ok=True)
                os.chmod(target, step.mode)
            elif step.action == "chmod":
                os.chmod(target, step.mode)
            elif step.action == "link":
                _make_parents(target)
                os.symlink(step.target, target)
            elif step.action == "remove":
                target.unlink()
            elif step.action == "run":
                if shutil.which(step.argv[0]) is None:
                    raise InstallError(f"{step.argv[0]} not found: is this a systemd host? The files are written; "
                                       f"run `{' '.join(step.argv)}` where systemd runs")
                r = subprocess.run(step.argv, capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    raise InstallError(f"`{' '.join(step.argv)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}")
        except OSError as e:
            raise InstallError(f"cannot {step.action} {target}: {e.strerror}") from None


def _make_parents(target: Path) -> None:
    """The missing folders above `target`, each 0755: under umask 000 mkdir -p made
    etc/ and etc/systemd/system world-writable (anyone could replace the unit)."""
    missing = []
    for parent in target.parents:
        if parent.exists():
            break
        missing.append(parent)
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o755)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
