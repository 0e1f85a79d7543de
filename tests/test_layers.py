"""The import rule: the folders of daemon/gpuguard show the data flow (README "How it is
built") and no module imports against it. Every module is parsed with `ast` (imports
inside functions and under TYPE_CHECKING count: a lazy import is still a dependency),
mapped to a layer, and each import of another gpuguard module is checked against what its
layer may import. A failure names the importing module, the line and the imported module.

    base      the package itself (`__version__`), logging setup
    state     what the daemon knows: snapshots, events, the hub, GPU states, conditions,
              the state folder and the audit log — written by sources, read by everyone
    hw        the door to the hardware (sysfs, amdgpu, NVML, PCIe)
    source    what reads the host into state: kernel/, engines/, profiles/, the GPU
              poller and the PCIe walker; they never import one another
    config    the config file's schema, put together from the sources' own sections
    report    a flight recording read back and drawn
    control   commands coming in: auth, action providers, the confirm window, POST routes
    policy    what the daemon decides from what it sees (doctor, conditions, PSU budget)
    sink      where state goes out: metrics, the read API, recorder, notifier, systemd
    sim       test equipment that behaves like the host; it imports what it fakes, never
              a sink, control or policy
    entry     cli/, the daemon's wiring (daemon.py), `install-service`: may import
              anything, and nothing but an entry imports them
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DAEMON = REPO / "daemon"

# module (or package) -> layer; the longest matching prefix wins ("gpuguard" itself only
# names the package's __init__: a new top-level module needs its own entry)
LAYERS = {
    "gpuguard": "base",
    "gpuguard.logsetup": "base",
    "gpuguard.heap": "base",  # the process's malloc setting (cli/run), stdlib only
    "gpuguard.document": "base",  # one serialiser of frozen values, stdlib only
    "gpuguard.state": "state",
    "gpuguard.hw": "hw",
    "gpuguard.kernel": "source",
    "gpuguard.engines": "source",
    "gpuguard.profiles": "source",
    "gpuguard.poller": "source",
    "gpuguard.pcie_walker": "source",
    "gpuguard.config": "config",
    "gpuguard.report": "report",
    "gpuguard.control": "control",
    "gpuguard.policy": "policy",
    "gpuguard.sinks": "sink",
    "gpuguard.sim": "sim",
    # its main() is `python -m gpuguard.sim.nvml_host`: the real daemon (cli/run's options,
    # Daemon, load_config) run on the replayed NVML, an entry point like `gpuguard run`
    "gpuguard.sim.nvml_host": "entry",
    "gpuguard.__main__": "entry",
    "gpuguard.cli": "entry",
    "gpuguard.daemon": "entry",
    "gpuguard.install": "entry",
}

_BELOW_SOURCES = {"base", "state", "hw"}
MAY_IMPORT = {
    "base": {"base"},
    "state": {"base", "state"},
    "hw": {"base", "state", "hw"},
    "source": _BELOW_SOURCES | {"source"},
    "config": _BELOW_SOURCES | {"source", "config"},
    "report": {"base", "state", "report"},
    "control": _BELOW_SOURCES | {"source", "config", "control"},
    "policy": _BELOW_SOURCES | {"source", "config", "control", "policy"},
    # the read API asks control who may read (tokens, the read policy) and serves the
    # providers' views; metrics render policy's verdicts (PSU budget, findings)
    "sink": _BELOW_SOURCES | {"source", "config", "report", "control", "policy", "sink"},
    "sim": _BELOW_SOURCES | {"source", "sim"},
    "entry": set(LAYERS.values()),
}
# layers whose members stay independent of one another: a source feeds state, not
# another source (the top-level package or module is the member)
INDEPENDENT = {"source"}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return LAYERS["gpuguard"] if module == "gpuguard" else None


def member_of(module: str) -> str:
    """gpuguard.kernel.rules -> gpuguard.kernel; gpuguard.poller -> gpuguard.poller."""
    return ".".join(module.split(".")[:2])


def imported_modules(module: str, source: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, gpuguard module) for every import in `source`, relative ones resolved; for
    `from X import name` the module is X.name when that is a module, else X."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "gpuguard"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "gpuguard":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in known else target))
    return sorted(set(out))


def violations(module: str, source: str, path: str, is_package: bool = False,
               known: set[str] | frozenset = frozenset()) -> list[str]:
    layer = layer_of(module)
    if layer is None:
        return [f"{path}: {module} has no layer: add it to LAYERS in tests/test_layers.py"]
    found = []
    for line, target in imported_modules(module, source, is_package, set(known)):
        to = layer_of(target)
        if to is None:
            found.append(f"{path}:{line}: {module} imports {target}, which has no layer")
        elif to not in MAY_IMPORT[layer]:
            found.append(f"{path}:{line}: {module} ({layer}) imports {target} ({to}); "
                         f"{layer} may import only {', '.join(sorted(MAY_IMPORT[layer]))}")
        elif to == layer and layer in INDEPENDENT and member_of(target) != member_of(module):
            found.append(f"{path}:{line}: {module} ({layer}) imports {target}, another {layer}; "
                         f"each {layer} stands on its own (share through state/)")
    return found


def daemon_modules() -> list[tuple[str, Path, bool]]:
    out = []
    for path in sorted((DAEMON / "gpuguard").rglob("*.py")):
        parts = path.relative_to(DAEMON).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        out.append((".".join(parts[:-1] if is_package else parts), path, is_package))
    return out


def test_every_module_is_checked_and_every_edge_goes_with_the_flow():
    modules = daemon_modules()
    assert len(modules) > 100, f"found only {len(modules)} modules under {DAEMON}"
    known = {m for m, _, _ in modules}
    found = []
    for module, path, is_package in modules:
        found += violations(module, path.read_text(encoding="utf-8"), str(path.relative_to(DAEMON.parent)),
                            is_package, known)
    assert not found, "imports against the data flow:\n" + "\n".join(found)


KNOWN = {"gpuguard.poller", "gpuguard.sinks.metrics", "gpuguard.profiles.nvidia", "gpuguard.sim.control"}


@pytest.mark.parametrize("module, source, expected", [
    # a sink imported by a source, at the top of the file
    ("gpuguard.engines.fake", "import os\nfrom gpuguard.sinks.metrics import MetricsSink\n",
     "gpuguard/engines/fake.py:2: gpuguard.engines.fake (source) imports gpuguard.sinks.metrics (sink)"),
    # hw importing a layer above it, lazily inside a function
    ("gpuguard.hw.fake", "def f():\n    from gpuguard.profiles import nvidia\n",
     "gpuguard/hw/fake.py:2: gpuguard.hw.fake (hw) imports gpuguard.profiles.nvidia (source)"),
    # policy importing a sink
    ("gpuguard.policy.fake", "import gpuguard.sinks.metrics\n",
     "gpuguard/policy/fake.py:1: gpuguard.policy.fake (policy) imports gpuguard.sinks.metrics (sink)"),
    # a source importing control
    ("gpuguard.profiles.fake", "from gpuguard.control.actions import ActionRefused\n",
     "gpuguard/profiles/fake.py:1: gpuguard.profiles.fake (source) imports gpuguard.control.actions (control)"),
    # control importing a sink
    ("gpuguard.control.fake", "\n\nfrom gpuguard.sinks.status import summary_line\n",
     "gpuguard/control/fake.py:3: gpuguard.control.fake (control) imports gpuguard.sinks.status (sink)"),
    # one source importing another
    ("gpuguard.kernel.fake", "from gpuguard import poller\n",
     "gpuguard/kernel/fake.py:1: gpuguard.kernel.fake (source) imports gpuguard.poller, another source"),
    # test equipment reaching the daemon's wiring, by a relative import
    ("gpuguard.sim.fake", "from ..daemon import Daemon\n",
     "gpuguard/sim/fake.py:1: gpuguard.sim.fake (sim) imports gpuguard.daemon (entry)"),
    # state importing anything above it
    ("gpuguard.state.fake", "from gpuguard.hw.sysfs import SysfsRoot\n",
     "gpuguard/state/fake.py:1: gpuguard.state.fake (state) imports gpuguard.hw.sysfs (hw)"),
])
def test_a_back_edge_fails_naming_module_line_and_import(module, source, expected):
    path = module.replace(".", "/") + ".py"
    found = violations(module, source, path, known=KNOWN)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.parametrize("module, source", [
    ("gpuguard.sinks.fake", "from gpuguard.control.access import read_access\nfrom gpuguard.hw.pcie import walk\n"),
    ("gpuguard.sim.fake", "from .control import ControlServer\nfrom gpuguard.engines.snapshot import EngineSnapshot\n"),
    ("gpuguard.profiles.fake", "from gpuguard.profiles.apply import Applier\nfrom gpuguard.state.audit import AuditLog\n"),
    ("gpuguard.cli.fake", "from gpuguard.daemon import Daemon\nfrom gpuguard.sinks.api import build_app\n"),
    ("gpuguard.hw.fake", "from gpuguard import __version__\nfrom gpuguard.state.snapshot import GpuSnapshot\n"),
])
def test_edges_with_the_flow_pass(module, source):
    assert violations(module, source, module.replace(".", "/") + ".py", known=KNOWN) == []


def test_a_module_without_a_layer_is_named():
    found = violations("gpuguard.newthing", "", "gpuguard/newthing.py")
    assert found == ["gpuguard/newthing.py: gpuguard.newthing has no layer: add it to LAYERS in tests/test_layers.py"]


def test_the_readme_drawing_names_folders_and_modules_that_exist():
    """README "How it is built": every `folder/` and `folder/module` the drawing names is in
    daemon/gpuguard, and so are the loops it names (poller, pcie_walker); every package
    folder of daemon/gpuguard is in the drawing."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## How it is built"):]
    drawing = section[section.index("```") + 3:]
    drawing = drawing[:drawing.index("```")]
    pkg = DAEMON / "gpuguard"
    names = re.findall(r"(?<![/\w.])([a-z_]+)/([a-z_]*)", drawing)
    assert len(names) > 10, names
    missing = [f"{d}/{m}" for d, m in names
               if not (pkg / d).is_dir() or (m and not ((pkg / d / f"{m}.py").is_file() or (pkg / d / m).is_dir()))]
    missing += [m for m in ("poller", "pcie_walker") if m not in drawing or not (pkg / f"{m}.py").is_file()]
    assert not missing, f"the README drawing names what is not in daemon/gpuguard: {missing}"
    drawn = {d for d, _ in names}
    packages = {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    assert packages - drawn == set(), f"folders of daemon/gpuguard the README drawing leaves out: {packages - drawn}"
