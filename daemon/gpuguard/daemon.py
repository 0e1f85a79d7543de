"""The daemon: wires sources → hub → sinks in one asyncio loop (DESIGN.md data flow).

`Daemon.run()` discovers GPUs, serves `/metrics` and the API on the configured address,
polls until SIGTERM/SIGINT, re-reads the config on SIGHUP (an invalid file is logged with
key and line and the running config kept), and speaks sd_notify when started by systemd.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sqlite3
import stat
import time
from typing import TYPE_CHECKING, Any, Callable

import uvicorn

from gpuguard.config import Config, ConfigError, load_config
from gpuguard.config.reload import LIVE_SECTIONS, ReloadPlan, plan_reload
from gpuguard.control.actions import Actions
from gpuguard.control.auth import AccessPolicy, TokenFileError, TokenStore, exposure_warnings
from gpuguard.document import document
from gpuguard.hw.pcie_expect import ExpectedLink
from gpuguard.hw.power_sampler import on_grid
from gpuguard.hw.sources import default_sources
from gpuguard.hw.sysfs import SysfsRoot
from gpuguard.kernel.kmsg import KmsgError, KmsgReader
from gpuguard.kernel.router import KernelEventRouter
from gpuguard.kernel.rules import Rules, RulesError
from gpuguard.kernel.udev import UdevError, UdevMonitor
from gpuguard.pcie_walker import PcieWalker
from gpuguard.policy.gpu_conditions import GpuConditions
from gpuguard.policy.gpu_lifecycle import GpuLifecycle
from gpuguard.policy.kernel_actions import KernelActions
from gpuguard.policy.link_history import FILE as PCIE_HISTORY_FILE, KERNEL_FILE as PCIE_KERNEL_FILE
from gpuguard.policy.pcie_findings import PcieFindings
from gpuguard.poller import GpuPoller
from gpuguard.sinks.api import build_app
from gpuguard.sinks.metrics import MetricsSink, kernel_log_families, same_objects
from gpuguard.sinks.notifier import WebhookNotifier, redact_url
from gpuguard.sinks.page import mount_page
from gpuguard.sinks.pcie_metrics import PcieCollector
from gpuguard.sinks.recorder import FlightRecorder
from gpuguard.sinks.reload_marker import ReloadMarker
from gpuguard.sinks.status import summary_line
from gpuguard.sinks.systemd import SystemdNotify
from gpuguard.state.audit import AuditLog
from gpuguard.state.events import Event
from gpuguard.state.hub import Hub
from gpuguard.state.state_dir import StateDir, StateDirLocked, report_to

if TYPE_CHECKING:
    from gpuguard.engines.watchdog import EngineWatchdog

log = logging.getLogger("gpuguard")


# No websockets (uvicorn would import a websocket library if one is installed) and a
# plain ASGI 3 app (no detection by inspecting it).
SERVER_OPTIONS: dict[str, Any] = dict(log_level="warning", lifespan="off", access_log=False, ws="none",
                                      interface="asgi3")


class _Server(uvicorn.Server):
    # The daemon owns the process's signals (SIGHUP reload, SIGTERM stop).
    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def stop(self) -> None:
        self.should_exit = True
        exit_now = getattr(self, "_exit_now", None)
        if exit_now is not None:
            exit_now.set()

    async def main_loop(self) -> None:
        # uvicorn's own loop wakes ten times a second to look at should_exit; two servers
        # made that a fifth of an idle daemon's wakeups. Here: the Date header once a
        # second (what on_tick does at every tenth tick), and stop() wakes it at once.
        # The second falls on the poll's and the power sampler's grid, so this wakeup is one
        # the host pays for anyway (hw/power_sampler.on_grid).
        self._exit_now = asyncio.Event()
        loop = asyncio.get_running_loop()
        while not self.should_exit:
            if await self.on_tick(0):
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._exit_now.wait(), on_grid(loop.time(), 1.0) - loop.time())


def freeze_start_up_objects() -> int:
    """Move everything alive after start-up (modules, pydantic and FastAPI's models, the
    config, ~75 000 objects) out of the collector's sight; returns how many. Each full
    collection walked them all, 25-35 ms with the GIL held, about every half minute at
    32 GPUs: the slowest scrapes. They live as long as the process anyway."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


Notifier = SystemdNotify  # the older name of sinks/systemd.SystemdNotify, kept for callers


class Daemon:
    def __init__(
        self,
        config: Config,
        config_path: str | None = None,
        sysfs_root: str | None = None,
        sources: list[Any] | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.root = SysfsRoot(sysfs_root or config.sysfs_root)
        self.hub = Hub()
        # state/gpus.py: the one owner of every GPU's identity and lifecycle
        self.gpus = self.hub.gpus
        self.gpus.lost_after_seconds = config.poll.lost_after_seconds
        self.gpus.configure(config.gpus, {e.name: tuple(e.gpus) for e in config.engines})
        self.hub.poll_budget_seconds = config.poll.interval_seconds + config.poll.timeout_seconds + 1.0
        self.metrics = MetricsSink(self.hub)
        self.sources = sources if sources is not None else default_sources(self.root)
        self.poller = GpuPoller(
            self.hub,
            self.sources,
            config.gpus,
            interval=config.poll.interval_seconds,
            timeout=config.poll.timeout_seconds,
            discover_every=config.poll.discover_seconds,
        )
        # the walk is a source; what it finds is policy's, handed in (policy/pcie_findings.py)
        self.pcie_findings = PcieFindings(self.hub, self.root, self.expected_links,
                                          history_path=os.path.join(config.state_dir, PCIE_HISTORY_FILE),
                                          gpu_names=self.gpus.names,
                                          kernel_path=os.path.join(config.state_dir, PCIE_KERNEL_FILE))
        self.pcie = PcieWalker(self.hub, self.root, interval=config.poll.pcie_interval_seconds,
                               kernel_lines=self.pcie_findings.kernel_lines,
                               assess=self.pcie_findings.assess, publish=self.pcie_findings.publish)
        # the walk plus the last walk of each lost GPU (policy/pcie_findings.py): a vanished
        # card's series stay, marked, until it is back and walked again
        self.metrics.add("pcie", PcieCollector(latest=lambda: self.pcie_findings.reported, gpu_names=self.gpus.names,
                                               held=lambda: self.pcie_findings.held).collect,
                         inputs=lambda: same_objects(self.pcie_findings.reported) + tuple(sorted(self.pcie_findings.held))
                         + tuple(sorted(self.gpus.names().items())))
        self.kernel_actions = KernelActions(self.gpus, self.poller.request_discovery)
        # a GPU lost by any route kills its engines; back, they are restarted (policy/gpu_lifecycle.py)
        self.lifecycle = GpuLifecycle(
            self.gpus,
            kill=lambda gpu, reason, evidence: self.engines.kill_engines_on_gpu(gpu, reason, evidence) if self.engines else None,
            restart=lambda gpu, reason: self.engines.restart_engines_on_gpu(gpu, reason) if self.engines else None,
            debounce_s=config.kernel.action_debounce_seconds,
        )
        self.kernel_router: KernelEventRouter | None = None
        self.kmsg_reader: KmsgReader | None = None
        # -- control: tokens are loaded in run(): a bad token file must end the start
        # with a one-line error, not a traceback from the constructor.
        self.audit = AuditLog.in_state_dir(config.state_dir)
        # one daemon per state folder; an unusable one refuses applies, never crashes
        self.state_dir = StateDir(config.state_dir)
        self.audit.health = self.state_dir
        self.actions = Actions()  # other parts register providers here (control/actions.py)
        self.actions.provide(pcie=self.pcie_document)
        self.webhooks = WebhookNotifier(self.hub, config.webhooks)
        self.metrics.add("webhooks", self.webhooks.collect)
        self.app = build_app(
            self.hub,
            self.metrics,
            policy=AccessPolicy(config.listen.address, config.api.open_reads),
            audit=self.audit,
            actions=self.actions,
            max_body_bytes=config.api.max_body_bytes,
            config_view=self.config_view,
        )
        # the web page, its history and on-demand incident reports (same port and rules)
        mount_page(self.app, lambda: self.recorder)
        self.app.state.state_health = lambda: self.state_dir.health
        self.unix_server: _Server | None = None
        self.notify = SystemdNotify()
        self.reload_marker = ReloadMarker()
        self.stop_event = asyncio.Event()
        self.server: _Server | None = None
        self.tasks: list[asyncio.Task] = []
        self.on_ready: list[Callable[[], Any]] = []  # before READY=1 (profiles: apply + verify)
        self.on_serving: list[Callable[[], Any]] = []  # after READY=1 (the demo's banner)
        # WATCHDOG=1 only from a finished poll cycle (sinks/systemd.py says why)
        self.poller.on_cycle.append(lambda snap: self.notify.watchdog(summary_line(self.hub)))
        # Thermal emergency / power at cap as events too, not only Prometheus alerts.
        conditions = GpuConditions(self.hub.publish)
        self.poller.on_cycle.append(conditions.observe)
        self.metrics.add("gpu_conditions", conditions.collect)
        self.recorder: FlightRecorder | None = None
        if config.recorder.enabled:
            try:
                # a deleted or replaced file is reopened and said as an event (sinks/recorder.py)
                self.recorder = FlightRecorder(config.recorder.path, config.recorder.keep_seconds,
                                               config.recorder.max_bytes, publish=self.hub.publish)
            except (OSError, sqlite3.Error) as e:
                log.error("flight recorder disabled: cannot open path=%s error=%s", config.recorder.path, e)
        if self.recorder is not None:
            self.hub.on_event(self.recorder.add_event)  # written with the cycle's samples
            self.hub.on_revise(self.recorder.revise_event)
            self.metrics.add("recorder", self.recorder.collect)
        self.hub.on_event(self._log_event)
        self.engines: EngineWatchdog | None = None
        if config.engines:  # the watchdog and its libraries only where engines are configured
            from gpuguard.control.engine_actions import EngineActions
            from gpuguard.engines.attribution import GpuAttribution
            from gpuguard.engines.metrics import engine_metrics
            from gpuguard.engines.watchdog import EngineWatchdog

            # which processes hold which GPU (fdinfo under the host's /proc, NVML)
            nvml = next((s for s in self.sources if getattr(s, "name", "") == "nvml"), None)
            attribution = GpuAttribution(self.root.path("/proc"), nvml, gpu_names=lambda: dict(self.poller.names))
            from gpuguard.engines import host_context
            from gpuguard.engines.incidents import IncidentStore

            # incident bundles under state_dir/incidents, pause statistics
            incidents = IncidentStore(os.path.join(config.state_dir, "incidents"),
                                      context=host_context.window(self.hub, self.recorder))
            self.engines = EngineWatchdog(config.engines, audit=self.audit.engine_action, publish=self.hub.publish,
                                          attribution=attribution, incidents=incidents,
                                          gpu_telemetry=host_context.gpu_now(self.hub))
            self.metrics.add("engines", lambda: engine_metrics(self.engines))
            self.actions.provide_from(EngineActions(self.engines))
            # INCIDENTS §1: a hang on a GPU kills its engines at once; after a reset every
            # context on it is dead, so its engines are restarted (policy/gpu_lifecycle.py).
            self.kernel_actions.on_fatal.append(self._kill_engines_for_kernel)
            self.poller.on_cycle.insert(0, lambda snap: self._engine_notes())
        # Profiles: applied and verified before READY, re-applied on drift and late cards.
        # Each component gets the narrow things it uses (DESIGN.md "One owner"), not the daemon.
        from gpuguard.control.profile_actions import ProfileActions
        from gpuguard.profiles.lifecycle import ProfileRuntime
        from gpuguard.profiles.schema import ProfilesConfig

        # NVIDIA cards are applied through NVML when the host has an NVML source
        self.profiles = ProfileRuntime(ProfilesConfig.from_root(config), self.gpus, self.hub, self.root,
                                       discover=self.poller.discover,
                                       nvml=next((s for s in self.sources if getattr(s, "name", "") == "nvml"), None),
                                       audit=self.audit)
        self.on_ready.append(self.profiles.on_ready)
        self.poller.on_cycle.append(self.profiles.on_cycle)
        self.metrics.add("profiles", self.profiles.ledger.metrics)
        self.actions.provide_from(ProfileActions(self.profiles))  # apply/reset/confirm-window routes
        # fast power sampling and the PSU budget (INCIDENTS §2)
        from gpuguard.policy.power_watch import PowerWatch, poller_channels

        self.power = PowerWatch(self.hub, config.power, poller_channels(self.poller, self.hub), recorder=self.recorder,
                                recorder_cycle=True)
        self.poller.on_cycle.append(self.power.on_cycle)
        self.metrics.add("power", self.power.metrics)
        self.actions.provide(power=self.power.document)
        if self.recorder is not None:
            # after every other listener of the cycle: its samples, the power rows and the
            # events the cycle raised go to disk in one transaction, one fsync a second
            rec = self.recorder
            self.poller.on_cycle.append(lambda snap: rec.record(snap, engines=self.hub.view("engines")))

    def _kernel_event(self, e) -> None:
        self.hub.publish(e)  # counted by the GPU state owner (router → hub.gpus.kernel_event)

    def start_kernel_sources(self) -> None:
        """/dev/kmsg and udev. Either may be unavailable (no CAP_SYSLOG, a container
        without netlink): that is logged and the rest of the daemon runs on."""
        kc = self.config.kernel
        if not kc.enabled:
            return
        try:
            rules = Rules.load(builtin=kc.builtin_rules, extra_file=kc.rules_file)
        except RulesError as e:
            log.error("kernel rules not loaded, kernel log not watched: %s", e)
            return
        self.kernel_router = KernelEventRouter(
            rules,
            gpu_name_for_bdf=self.gpus.name,
            hooks=self.kernel_actions,
            policy=kc.policy,
            max_events=kc.event_buffer,
            debounce_s=kc.action_debounce_seconds,
            recover_settle_s=kc.recover_settle_seconds,
            on_event=self._kernel_event,
            on_revise=self.hub.revise,  # a repeated line counted into its event
            states=self.gpus,
        )
        state_file = kc.state_file or os.path.join(self.config.state_dir, "kmsg-position.json")
        try:
            reader = KmsgReader(kc.kmsg_path, state_file, kc.allow_userspace, batch=kc.batch)
            reader.open()
            self.kmsg_reader = reader
            # records never read are counted where an alert rule can see them
            self.metrics.add("kernel_log", lambda: kernel_log_families(reader.stats()))
            # the position is on disk before an alert about a line leaves
            self.webhooks.before_send.append(
                lambda e: reader.commit(e.fields["seq"]) if e.source == "kernel" and "seq" in e.fields else None
            )
            self.tasks.append(asyncio.create_task(self.kernel_router.run_kmsg(reader), name="kmsg"))
        except (OSError, KmsgError) as e:
            log.error("kernel log not watched: cannot read %s: %s (needs root or CAP_SYSLOG)", kc.kmsg_path, e)
        if kc.udev:
            try:
                monitor = UdevMonitor(source=kc.udev_source)
                monitor.start()
                self.tasks.append(asyncio.create_task(self.kernel_router.run_udev(monitor), name="udev"))
            except (UdevError, OSError) as e:
                log.error("udev not watched: %s; late and vanished GPUs are still found by polling", e)
        from gpuguard.hw import nvml_events

        # NVML's Xid events into the same router
        task = nvml_events.start(self.sources, self.kernel_router.handle_external,
                                 lambda bdf: self.poller.names.get(bdf), self.stop_event)
        if task is not None:
            self.tasks.append(task)

    async def _kill_engines_for_kernel(self, gpu: str | None, bdf: str | None, kind: str) -> None:
        if self.engines is None:
            return
        if gpu is None:
            # `amdgpu: sq_intr:` names no device: which engine's GPU is unknown. The
            # device_lost / reset lines that follow do name it and kill then.
            log.warning("kernel %s without a GPU address: no engine killed on it alone", kind)
            return
        # shared with the lost-GPU policy: one kill per GPU within the debounce window
        await self.lifecycle.kill_engines(gpu, kind, {"kernel_event": kind, "bdf": bdf})

    def _engine_notes(self) -> None:
        if self.engines is None:
            return
        bad = [f"{n} {s.state}" for n, s in sorted(self.engines.snapshots().items()) if s.state in ("stalled", "unhealthy", "down")]
        self.hub.notes["engines"] = ("engines: " + ", ".join(bad)) if bad else ""
        self.hub.set_view("engines", self.engines.snapshots())
        # which processes hold each GPU, for `status` (plain values: sinks read them)
        self.hub.set_view("gpu_processes", {
            "scanned_at": self.engines.gpu_processes_at,
            "processes": sorted(({"gpu": gpu, "bdf": g.bdf, "pid": g.pid, "comm": g.comm, "engine": engine or None,
                                  "vram_bytes": g.vram_bytes, "source": g.source}
                                 for g, gpu, engine in self.engines.gpu_processes()),
                                key=lambda p: (p["gpu"], p["pid"])),
        })

    def expected_links(self) -> dict[str, ExpectedLink]:
        """bdf -> expected slot link, from `gpus[].expect_link` and today's GPU names."""
        by_name = {g.name: g.expect_link for g in self.config.gpus if g.expect_link is not None}
        return {bdf: by_name[name] for bdf, name in self.gpus.names().items() if name in by_name}

    @staticmethod
    def _log_event(e) -> None:
        level = logging.WARNING if e.severity in ("alert", "critical") else logging.INFO
        where = " ".join(f"{k}={v}" for k, v in (("gpu", e.gpu), ("bdf", e.bdf), ("engine", e.engine)) if v)
        log.log(level, "event kind=%s severity=%s source=%s %s msg=%r", e.kind, e.severity, e.source, where, e.message)

    # -- lifecycle ----------------------------------------------------------------------
    def request_stop(self) -> None:
        self.stop_event.set()

    def pcie_document(self) -> dict[str, Any] | None:
        """GET /v1/pcie: the last walk (`gpuguard pcie --json` schema) plus its doctor
        findings; None (503) until the first walk finished."""
        report = self.hub.view("pcie")
        if report is None:
            return None
        return {**document(report), "findings": [f.to_dict() for f in self.hub.view("pcie_findings", ())]}

    def config_view(self) -> dict[str, Any]:
        """The effective config for GET /v1/config (webhook URLs redacted: they carry secrets)."""
        doc = self.config.model_dump(mode="json")
        for w in doc.get("webhooks", []):
            w["url"] = redact_url(w["url"])
        return doc

    def reload(self) -> bool:
        """Re-read the config file (and the API token file) on SIGHUP. Every changed key is
        either applied now or named as needing a restart and kept as it was
        (config/reload.py). Returns True when the new config took effect; an invalid config
        or token file keeps everything running as is."""
        self.notify.reloading()
        try:
            if self.config_path is None:
                log.warning("reload: no config file was given; nothing to re-read")
                return False
            try:
                new = load_config(self.config_path)
            except ConfigError as e:
                for p in e.problems:
                    log.error("reload rejected, keeping the running config: file=%s %s", e.source, p)
                return False
            try:
                tokens = TokenStore.load(new.api.token_file)
            except TokenFileError as e:
                log.error("reload rejected, keeping the running config and tokens: %s", e)
                return False
            live = set(LIVE_SECTIONS)
            if self.engines is not None and hasattr(self.engines, "reconfigure"):
                live.add("engines")
            if self.kernel_router is None:
                live.discard("kernel")  # not running: starting it is a restart
            plan = plan_reload(self.config, new, live)
            self.config = cfg = plan.effective
            self.app.state.tokens = tokens
            # the policy follows the address actually bound, not the one in the new file
            self.app.state.policy = AccessPolicy(self.app.state.policy.listen_address, cfg.api.open_reads)
            self.app.state.max_body_bytes = cfg.api.max_body_bytes
            self.webhooks.configure(cfg.webhooks)
            logging.getLogger().setLevel(cfg.logging.level.upper())
            self.poller.interval = cfg.poll.interval_seconds
            self.poller.timeout = cfg.poll.timeout_seconds
            self.poller.discover_every = cfg.poll.discover_seconds
            self.pcie.interval = cfg.poll.pcie_interval_seconds
            self.gpus.lost_after_seconds = cfg.poll.lost_after_seconds
            self.power.configure(cfg.power)
            self.hub.poll_budget_seconds = cfg.poll.interval_seconds + cfg.poll.timeout_seconds + 1.0
            self.notify.check_interval(cfg.poll.interval_seconds + cfg.poll.timeout_seconds)
            if self.recorder is not None:
                self.recorder.keep_seconds = cfg.recorder.keep_seconds
                self.recorder.max_bytes = cfg.recorder.max_bytes  # pruned to it at the next prune
            if "engines" in live and any(k.startswith("engines") for k in plan.live):
                log.info("reload: engines %s", self.engines.reconfigure(cfg.engines))  # type: ignore[union-attr]
            self.gpus.configure(cfg.gpus, {e.name: tuple(e.gpus) for e in cfg.engines})
            if any(k.startswith("kernel") for k in plan.live):
                self._reload_kernel(cfg, plan)
            self.lifecycle.debounce_s = cfg.kernel.action_debounce_seconds
            from gpuguard.profiles.schema import ProfilesConfig

            self.profiles.configure(ProfilesConfig.from_root(cfg))
            log.info(
                "reload: config %s applied poll_interval=%gs tokens=%d webhooks=%d; changed: %s; live: %s; "
                "needs restart (kept as running): %s",
                self.config_path,
                cfg.poll.interval_seconds,
                len(tokens),
                len(cfg.webhooks),
                ", ".join(plan.changed) or "nothing",
                ", ".join(plan.live) or "nothing",
                ", ".join(plan.restart) or "nothing",
            )
            self.hub.publish(Event(
                "config_reloaded", "warning" if plan.restart else "info", "daemon",
                f"config {self.config_path} reloaded: applied {', '.join(plan.live) or 'nothing'}"
                + (f"; needs restart (kept as running): {', '.join(plan.restart)}" if plan.restart else ""),
                fields={"changed": plan.changed, "applied": plan.live, "needs_restart": plan.restart},
            ))
            return True
        finally:
            self.notify.ready(summary_line(self.hub))

    def _on_sighup(self) -> None:
        # `gpuguard reload` (ExecReload=) waits for this record (sinks/reload_marker.py)
        result = self.reload()
        self.reload_marker.record(bool(getattr(result, "ok", result)))

    def _reload_kernel(self, cfg: Config, plan: ReloadPlan) -> None:
        """kernel.rules_file/builtin_rules/policy/allow_userspace/batch/debounce/settle, in place."""
        kc, router = cfg.kernel, self.kernel_router
        assert router is not None
        if any(k in plan.live for k in ("kernel.rules_file", "kernel.builtin_rules")):
            try:
                router.rules = Rules.load(builtin=kc.builtin_rules, extra_file=kc.rules_file)
            except RulesError as e:
                log.error("reload: kernel rules not reloaded, the running rules stay: %s", e)
                plan.live = [k for k in plan.live if k not in ("kernel.rules_file", "kernel.builtin_rules")]
                plan.restart += ["kernel.rules_file (invalid)"]
        router.policy = {k: tuple(v) for k, v in kc.policy.items()}
        router.debounce_s = kc.action_debounce_seconds
        router.recover_settle_s = kc.recover_settle_seconds
        if self.kmsg_reader is not None:
            self.kmsg_reader.allow_userspace = kc.allow_userspace
            self.kmsg_reader.batch = kc.batch

    async def start_server(self) -> None:
        cfg = uvicorn.Config(
            self.app,
            host=self.config.listen.address,
            port=self.config.listen.port,
            **SERVER_OPTIONS,
        )
        self.server = _Server(cfg)
        self.tasks.append(asyncio.create_task(self.server.serve(), name="http"))
        while not self.server.started:
            if self.tasks[-1].done():
                exc = self.tasks[-1].exception()
                raise RuntimeError(
                    f"cannot listen on {self.config.listen.address}:{self.config.listen.port}: {exc or 'server exited'}"
                )
            await asyncio.sleep(0.01)

    async def start_unix_server(self, path: str) -> None:
        """The API on a UNIX socket, mode 0600 from the moment it exists (umask at bind;
        uvicorn's own uds= would chmod it 0666)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # a stale socket from a killed run; never unlink anything else
        os.makedirs(os.path.dirname(path) or ".", mode=0o750, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        except OSError as e:
            sock.close()
            raise RuntimeError(f"cannot listen on api.unix_socket {path}: {e.strerror}") from None
        finally:
            os.umask(old)
        self.unix_server = _Server(uvicorn.Config(self.app, **SERVER_OPTIONS))
        self.tasks.append(asyncio.create_task(self.unix_server.serve(sockets=[sock]), name="http-unix"))
        while not self.unix_server.started:
            if self.tasks[-1].done():
                raise RuntimeError(f"cannot serve api.unix_socket {path}: {self.tasks[-1].exception() or 'server exited'}")
            await asyncio.sleep(0.01)

    @property
    def bound_port(self) -> int | None:
        if self.server and self.server.servers:
            for s in self.server.servers:
                for sock in s.sockets:
                    return sock.getsockname()[1]
        return None

    async def _start(self) -> None:
        """Everything before READY=1. Runs as a task that SIGTERM abandons (the
        daemon went on waiting for GPUs and writing profiles 30 s after SIGTERM)."""
        try:
            self.state_dir.acquire()  # one daemon per state folder
        except StateDirLocked as e:
            raise RuntimeError(str(e)) from None
        self.poller.on_cycle.append(lambda snap: None if self.state_dir.health.usable else self.state_dir.probe())
        for warning in exposure_warnings(self.config.listen.address, self.config.api.open_reads,
                                         self.config.api.token_file):
            log.warning("%s", warning)
        try:
            self.app.state.tokens = TokenStore.load(self.config.api.token_file)
        except TokenFileError as e:
            raise RuntimeError(str(e)) from None
        if self.config.api.token_file is None:
            log.warning("api: no api.token_file configured; every mutating API call will be refused")
        await self.webhooks.start()
        report_to(self.state_dir, self.hub)  # after the notifier started: the alert must go out
        self.notify.check_interval(self.config.poll.interval_seconds + self.config.poll.timeout_seconds)
        await self.poller.poll_once()  # discovery + a first snapshot before READY
        self.start_kernel_sources()
        await self.start_server()
        if self.config.api.unix_socket:
            await self.start_unix_server(self.config.api.unix_socket)
        # the poll loop runs while the start hooks wait for GPUs and apply profiles: a card
        # that stops answering meanwhile is seen, and /healthz stays truthful
        self.tasks.append(asyncio.create_task(self.poller.run(self.stop_event), name="poller"))
        for fn in self.on_ready:
            r = fn()
            if asyncio.iscoroutine(r):
                await r
        if self.on_ready:
            # the hooks may have written the cards (profiles): what is served at READY
            # must be what the cards read now, not what they read before the apply
            cycles = self.poller.cycles
            while self.poller.cycles < cycles + 2 and not self.stop_event.is_set():
                await asyncio.sleep(0.02)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        try:
            start = asyncio.create_task(self._start(), name="start")
            stop = asyncio.create_task(self.stop_event.wait(), name="stop-wait")
            await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                log.warning("stop requested while starting: start abandoned (no profile written after the signal)")
                self.gpus.begin_stop()
                self.profiles.begin_stop()
                start.cancel()
                await asyncio.wait({start}, timeout=1.0)
                return 0
            stop.cancel()
            start.result()  # a start failure (cannot listen, bad token file) ends the run here
            log.info(
                "ready: %s; metrics at http://%s:%s/metrics",
                summary_line(self.hub),
                self.config.listen.address,
                self.bound_port,
            )
            self.notify.ready(summary_line(self.hub))
            freeze_start_up_objects()
            for fn in self.on_serving:
                fn()
            self.tasks.append(asyncio.create_task(self.pcie.run(self.stop_event), name="pcie"))
            if self.engines is not None:
                self.tasks.append(asyncio.create_task(self.engines.run(), name="engines"))
            await self.stop_event.wait()
            return 0
        finally:
            await self._shutdown(loop)

    async def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bounded: every step gets part of STOP_BUDGET_S; what does not finish in time is
        abandoned with its name logged (a read stuck in a wedged card is a daemon thread)."""
        t0 = time.monotonic()
        self.gpus.begin_stop()  # no write from here on, whatever is still running
        self.profiles.begin_stop()
        self.notify.stopping()
        self.app.state.confirm.close()
        for srv in (self.server, self.unix_server):
            if srv is not None:
                srv.stop()
        for t in self.tasks:
            if not t.get_name().startswith("http"):
                t.cancel()

        async def bounded(what: str, aw: Any, budget: float) -> None:
            try:
                await asyncio.wait_for(aw, budget)
            except asyncio.TimeoutError:
                log.warning("stop: %s did not finish within %.1f s; abandoned", what, budget)
            except Exception as e:  # a failing close must not keep the process up
                log.warning("stop: %s failed: %s: %s", what, type(e).__name__, e)

        if self.tasks:
            done, pending = await asyncio.wait(self.tasks, timeout=3.0)
            if pending:
                log.warning("stop: tasks %s did not end within 3 s; abandoned", ", ".join(sorted(t.get_name() for t in pending)))
        await bounded("webhooks", self.webhooks.close(), 2.0)
        if self.unix_server is not None and self.config.api.unix_socket:
            with contextlib.suppress(OSError):
                os.unlink(self.config.api.unix_socket)
        self.poller.close()
        self.power.close()
        if self.engines is not None:
            await bounded("engine watchdog", self.engines.aclose(), 2.0)
        await bounded("gpu lifecycle", self.lifecycle.aclose(), 1.0)
        if self.recorder is not None:
            self.recorder.mark_stopped()  # a recording that ends without it was cut short
            self.recorder.close()
        self.profiles.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        self.state_dir.release()
        log.info("stopped: in %.1f s", time.monotonic() - t0)
        for pool in (self.profiles.calls, self.poller.calls):
            for waiting in pool.in_kernel():
                log.warning("stop: a device call is still inside the driver (%s); the process stays in /proc until "
                            "the driver returns: no signal, SIGKILL included, ends a thread waiting on the kernel", waiting)
