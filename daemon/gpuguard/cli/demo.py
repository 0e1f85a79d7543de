"""`gpuguard demo`: the daemon on the simulated incident host (INCIDENTS §4) with a
changing load, no root and no GPU needed. Prints the URLs and commands to try; Ctrl-C
stops it cleanly.

`gpuguard demo --write-tree DIR` only writes the simulated host to DIR (a plain tree to
browse and point `--sysfs-root` at) and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from importlib import resources


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the daemon on the simulated incident host", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="incident", help="simulated host (incident, incident-x8, incident-late, ...)")
    p.add_argument("--config", "-c", metavar="FILE", default=None, help="config file (default: the built-in demo config)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 9436, or a free one if taken)")
    p.add_argument("--dir", default=None, help="where to put the simulated tree (default: a temporary folder)")
    p.add_argument("--tree", action="store_true",
                   help="serve the host as a plain directory even where FUSE works (default: FUSE when available — "
                        "exact kernel errno and OD commits — else a plain directory)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--write-tree", metavar="DIR", default=None, help="only write the simulated host to DIR and exit")
    p.add_argument("--no-engine", action="store_true", help="don't start the simulated vLLM engine")
    p.add_argument("--engine-port", type=int, default=None, help="port of the simulated vLLM (default: a free one)")
    p.add_argument("--control", default=None, metavar="SOCKET",
                   help="control socket that `gpuguard sim` drives (default $GPUGUARD_SIM_SOCKET or "
                        "/tmp/gpuguard-sim-<uid>.sock)")
    p.add_argument("--real-kernel", action="store_true",
                   help="read the machine's own /dev/kmsg and udev instead of the simulated kernel log")
    p.set_defaults(func=cmd_demo)


def demo_config_text() -> str:
    return resources.files("gpuguard.sim").joinpath("demo.yaml").read_text()


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class DemoEngine:
    """A simulated vLLM (real HTTP server + EngineCore child process) on the XTX pair,
    under a stand-in for systemd's Restart=always, kept busy with requests. Stall it
    (`curl -X POST URL/sim/stall`) and watch the watchdog alert, kill and see it return.

    The engine runs in sessions of its own (as a unit's cgroup), so neither a terminal's
    Ctrl-C nor the demo's own end reaches it: `stop()` does, and, should the demo end
    without it (killed, or interrupted before it could stop anything), the supervisor
    stops by itself when the demo is gone (`--parent`: the kernel's parent-death signal,
    armed from the main thread, which lives as long as the demo)."""

    def __init__(self, port: int | None = None) -> None:
        import subprocess

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gpuguard.sim.engines", "--kind", "vllm", "--port", str(self.port), "--slots", "8"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuguard.sim.engines_restart", "--restart-sec", "2", "--parent", str(os.getpid()),
             "--", *cmd],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def config(self) -> dict:
        return {
            "name": "vllm-demo", "kind": "vllm", "url": self.url, "gpus": ["xtx-0", "xtx-1"],
            # the engine itself, not the Restart= stand-in whose command line contains it
            "process": {"cmdline": rf"^\S+ -m gpuguard\.sim\.engines --kind vllm --port {self.port}( |$)"},
            "stall_after": 10, "poll_interval": 1, "http_timeout": 1, "grace": 3, "action": "kill",
        }

    def feed(self) -> None:
        """Keep a few requests in flight (called from the simulator's clock thread)."""
        import httpx

        try:
            r = httpx.get(f"{self.url}/metrics", timeout=0.3)
            running = sum(float(l.split()[-1]) for l in r.text.splitlines() if l.startswith("vllm:num_requests_running"))
            if running < 3:
                httpx.post(f"{self.url}/sim/requests", json={"count": 2, "max_tokens": 2000}, timeout=0.3)
        except (httpx.HTTPError, ValueError):
            pass  # starting, restarting or stalled: that is what the demo shows

    def command(self, action: str, step_time: float | None = None) -> dict:
        """stall / unstall / slow / hang / die, through the simulated engine's /sim/ door."""
        import httpx

        if action not in ("stall", "unstall", "slow", "hang", "die"):
            raise ValueError(f"unknown engine action {action!r}; known: stall, unstall, slow, hang, die")
        body = {"step_time": step_time if step_time is not None else 0.5} if action == "slow" else {}
        try:
            r = httpx.post(f"{self.url}/sim/{action}", json=body, timeout=2.0)
        except httpx.HTTPError as e:
            raise RuntimeError(f"engine at {self.url} did not answer ({type(e).__name__}): restarting or hung?") from None
        return {"engine": self.url, "action": action, "status": r.status_code}

    def stop(self) -> None:
        import signal as _signal

        try:
            os.killpg(self.proc.pid, _signal.SIGTERM)
            self.proc.wait(5)
        except (ProcessLookupError, OSError):
            pass
        except Exception:
            os.killpg(self.proc.pid, _signal.SIGKILL)


class DemoLoad:
    """A load pattern a person can watch on a dashboard: the R9700 pair ramps together
    (the INCIDENTS §2 power-trip shape), the XTX pair alternates."""

    def __init__(self, host) -> None:
        self.host = host
        self.t0 = time.monotonic()
        self.pinned: dict[str, float] = {}  # bdf -> level set with `gpuguard sim load`

    def pin(self, bdf: str, level: float | None) -> dict:
        if level is None:
            self.pinned.pop(bdf, None)
        else:
            if not 0.0 <= level <= 1.0:
                raise ValueError(f"load {level} is not between 0 and 1")
            self.pinned[bdf] = level
            self.host.set_load(bdf, level)
        return {"bdf": bdf, "load": level if level is not None else "auto"}

    def __call__(self) -> None:
        t = time.monotonic() - self.t0
        for i, bdf in enumerate(self.host.gpus):
            if bdf in self.pinned:
                continue
            phase = 0.0 if i < 2 else math.pi * (i % 2)
            level = 0.5 + 0.5 * math.sin(2 * math.pi * t / 60.0 + phase)
            self.host.set_load(bdf, round(max(0.0, min(1.0, level)), 3))


def cmd_demo(args: argparse.Namespace) -> int:
    import signal

    from gpuguard.config import ConfigError, load_config, parse_config
    from gpuguard.sim.runner import build_scenario

    # Ctrl-C stops the demo at every moment. Started by `cmd &` from a script it inherits
    # SIGINT ignored, and Python then raises no KeyboardInterrupt: a Ctrl-C while it starts
    # was lost and the demo ran on (the daemon's own handler comes later, the signal long
    # gone). The daemon treats SIGINT as a stop whatever it inherited; so does the demo.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        host = build_scenario(args.scenario)
    except KeyError as e:
        print(f"gpuguard demo: {e.args[0]}", file=sys.stderr)
        return 2

    if args.write_tree:
        from gpuguard.sim.tree import write_tree

        os.makedirs(args.write_tree, exist_ok=True)
        write_tree(host, args.write_tree)
        print(f"simulated host ({args.scenario}) written to {args.write_tree}")
        print(f"  gpuguard status --sysfs-root {args.write_tree}")
        print(f"  gpuguard pcie   --sysfs-root {args.write_tree}")
        return 0

    try:
        config = load_config(args.config) if args.config else parse_config(demo_config_text(), "demo.yaml")
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2

    # Whatever the demo has started is stopped, in reverse order, however the demo ends:
    # Ctrl-C while it starts (many seconds on a loaded machine, before the daemon handles
    # the signal), while it runs, or during the stop itself. The engine's supervisor also
    # stops by itself once the demo process is gone (DemoEngine).
    with contextlib.ExitStack() as started:
        started.callback(print, "gpuguard demo: stopped", flush=True)
        workdir = args.dir or tempfile.mkdtemp(prefix="gpuguard-demo-")
        if args.dir is None:
            started.callback(shutil.rmtree, workdir, ignore_errors=True)
        try:
            return _serve(args, host, config, workdir, started)
        except KeyboardInterrupt:
            return 0  # Ctrl-C before the daemon took over the signal: the same clean stop


def _serve(args: argparse.Namespace, host, config, workdir: str, started: contextlib.ExitStack) -> int:
    """Start the simulated host, its engine and the daemon, each registered on `started`
    (stopped last-first) the moment it runs; return the daemon's exit status."""
    from gpuguard.sim.runner import SimRunner

    root = os.path.join(workdir, "root")
    state = os.path.join(workdir, "state")
    os.makedirs(root, exist_ok=True)
    os.makedirs(state, exist_ok=True)

    load = DemoLoad(host)
    load()
    mounted = False
    if not args.tree:
        try:
            from gpuguard.sim.fuse import fuse_available, mount as fuse_mount
        except ImportError as e:  # mfusepy comes with the [demo] (and [test]) extra, not a plain install
            reason = f"{e.name or 'mfusepy'} is not installed: pip install 'gpuguard[demo]'"
            fuse_mount = None
        except OSError as e:  # mfusepy raises this at import when libfuse is missing
            reason = f"{e} (apt-get install fuse3)"
            fuse_mount = None
        else:
            reason = fuse_available()
        if reason:
            print(f"gpuguard demo: FUSE not available ({reason}); serving a plain tree, without profiles "
                  "(a plain directory has no driver to commit OD writes)", file=sys.stderr)
        else:
            try:
                started.enter_context(fuse_mount(host, root))
                mounted = True
            except (RuntimeError, OSError) as e:
                print(f"gpuguard demo: FUSE mount failed ({e}); serving a plain tree, without profiles", file=sys.stderr)
    if not mounted and any(g.profile for g in config.gpus):
        config = config.model_copy(update={"gpus": [g.model_copy(update={"profile": None}) for g in config.gpus]})
    if not mounted:
        from gpuguard.sim.tree import write_tree

        writer = write_tree(host, root)
        runner = SimRunner(host, interval=0.25, on_step=lambda: (load(), writer.refresh()))
    else:
        runner = SimRunner(host, interval=0.25, on_step=load)

    engine = None
    if not args.no_engine and not config.engines and args.config is None:
        from gpuguard.engines.config import EngineConfig

        engine = DemoEngine(args.engine_port)
        started.callback(engine.stop)
        config = config.model_copy(update={"engines": [EngineConfig.model_validate(engine.config())]})
        feed, step = engine.feed, runner.on_step
        runner.on_step = lambda: (step(), feed())

    # The simulated kernel log reaches the daemon as kernel records through a FIFO standing
    # in for /dev/kmsg (sim/kmsg_pipe.py): kernel-triggered actions work without root, and
    # the machine's real kernel log stays out of the demo.
    if not args.real_kernel and config.kernel.enabled:
        from gpuguard.sim.kmsg_pipe import KmsgPipe

        fifo = os.path.join(state, "kmsg.fifo")
        position = os.path.join(state, "kmsg-position.json")
        if os.path.exists(position):
            os.unlink(position)  # a new simulated boot: its sequence numbers start over
        kpipe = KmsgPipe(host.kernel_log, fifo).start()
        started.callback(kpipe.stop)
        config = config.model_copy(update={"kernel": config.kernel.model_copy(
            update={"kmsg_path": fifo, "udev": False, "state_file": position})})

    from gpuguard.sim.control import ControlServer, default_socket

    control_path = args.control or default_socket()
    demo_info: dict = {}

    from gpuguard.sim.kmsg_pipe import kmsg_op

    kmsg = kmsg_op(host.kernel_log)
    ops = {
        "demo": lambda: demo_info,
        "load": lambda bdf, level=None: load.pin(bdf, level),
        "kmsg": kmsg,
    }
    if engine is not None:
        ops["engine"] = engine.command
    try:
        control = ControlServer(host, control_path, ops).start()
        started.callback(control.stop)
    except OSError as e:
        print(f"gpuguard demo: cannot serve the control socket {control_path}: {e.strerror}; "
              "`gpuguard sim` will not reach this demo (use --control PATH)", file=sys.stderr)
        control = None

    listen = config.listen
    port = args.port if args.port is not None else listen.port
    if args.port is None and not _free(listen.address, port):
        port = 0  # the default port is taken (a real gpuguard?): take any free one
    config = config.model_copy(
        update={
            "sysfs_root": root,
            "state_dir": state,
            "listen": listen.model_copy(update={"port": port}),
            "recorder": config.recorder.model_copy(update={"path": os.path.join(state, "flight.sqlite")}),
        }
    )

    from gpuguard.daemon import Daemon
    from gpuguard.logsetup import setup_logging

    setup_logging(config.logging.level)
    daemon = Daemon(config, config_path=args.config, sysfs_root=root)

    def announce() -> None:
        base = f"http://{config.listen.address}:{daemon.bound_port}"
        demo_info.update({
            "scenario": args.scenario, "api": base, "root": root, "db": config.recorder.path,
            "engine": engine.url if engine else None, "gpus": {name: bdf for bdf, name in daemon.poller.names.items()},
        })
        sim = "gpuguard sim" + (f" --control {control_path}" if args.control else "")
        print(
            "\n".join(
                [
                    "",
                    f"gpuguard demo: simulated host '{args.scenario}' at {root}",
                    f"  page:      {base}/",
                    f"  metrics:   {base}/metrics",
                    f"  status:    {base}/v1/status",
                    f"  events:    {base}/v1/events",
                    # status, engines and events find the daemon through it (cli/_daemon_api.py):
                    # the demo's port is not 9436 when 9436 was busy
                    "  point the commands at it (this shell):",
                    f"    export GPUGUARD_API={base}",
                    "  try:",
                    "    gpuguard status",
                    f"    gpuguard status --sysfs-root {root}",
                    f"    gpuguard pcie --sysfs-root {root}",
                    f"    gpuguard doctor --sysfs-root {root}",
                    "    gpuguard events",
                ]
                + (
                    [
                        "    gpuguard engines",
                        f"    curl -X POST {engine.url}/sim/stall   # a hung request: watch it get killed and come back",
                    ]
                    if engine
                    else []
                )
                + (
                    [
                        f"  drive it ({control_path}):",
                        f"    {sim} engine stall        # then: {sim} engine unstall",
                        f"    {sim} lose xtx-1          # device lost from bus; {sim} return xtx-1",
                        f"    {sim} kmsg 'amdgpu 0000:05:00.0: amdgpu: GPU reset begin!' --gpu r9700-a",
                        f"    gpuguard report --db {config.recorder.path} -o report.html",
                    ]
                    if control is not None
                    else []
                )
                + [
                    "  Ctrl-C stops it.",
                    "",
                ]
            ),
            flush=True,
        )

    daemon.on_serving.append(announce)

    async def main() -> int:
        if args.seconds is not None:
            asyncio.get_running_loop().call_later(args.seconds, daemon.request_stop)
        return await daemon.run()

    runner.start()
    started.callback(runner.stop)
    return asyncio.run(main())
