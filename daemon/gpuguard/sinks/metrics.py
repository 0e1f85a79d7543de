"""Prometheus export: one named collector per source (node_exporter's model), each
formatting memory only, so a scrape never touches sysfs (prometheus/client_python runs
collect() on the serving thread/loop).

Each source registers at start with `MetricsSink.add(name, collect)`. A scrape runs every
collector, times it and exports `gpuguard_collector_duration_seconds{collector}` and
`gpuguard_collector_success{collector}`: a collector that raises yields nothing that scrape
(success 0), and every other collector's families are still served with a 200 — one broken
source must not blank the dashboard of a host that is about to trip its PSU. Two collectors
exporting the same family name would give Prometheus a duplicate family and fail the whole
target, so that is refused at registration (naming both), and at scrape for a family that
first appears later.

Names follow reference/METRICS.md: prefix `gpuguard_`, base units, `gpu` = configured
name, `bdf` = PCI address.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuguard import __version__
from gpuguard.sinks.nvml_metrics import nvml_families
from gpuguard.state.hub import Hub

Collect = Callable[[], Iterable["Metric | Keyed"]]
Producer = Collect  # the old name, kept for callers on other branches

log = logging.getLogger("gpuguard.metrics")

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
# the sink's own families: no collector may export them
_SELF = "collectors"
DURATION = "gpuguard_collector_duration_seconds"
SUCCESS = "gpuguard_collector_success"

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class CollectorError(ValueError):
    """A collector that cannot be registered: bad or taken name, a family another exports."""


@dataclass
class _Source:
    name: str
    collect: Collect
    ok: bool = True  # last scrape's result; failures are logged on the change only
    families: set[str] = field(default_factory=set)
    # () -> a key of everything collect() reads; the same key again serves the text
    # rendered last time (a PCIe report changes once a minute, a scrape comes every second)
    inputs: Callable[[], tuple] | None = None
    cached: tuple | None = None  # (key, text)
    keyed: dict[str, tuple] = field(default_factory=dict)  # family -> (Keyed.key, text)


@dataclass(frozen=True)
class Keyed:
    """A family a collector yields by name, with a cheap key of everything in it and how to
    build it: while the key is the one rendered last, a scrape serves that text without
    building or rendering the family. The GPUs' identities, caps and limits change on a
    reset or a profile, not every poll: 60 % of the GPU block's samples (issue 15:
    "pre-rendered families for what did not change")."""
    name: str
    key: tuple
    build: Callable[[], Metric]


class _Families:
    """What generate_latest takes: an object whose collect() yields the families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def same_objects(*objects: object) -> tuple:
    """A cache key that holds `objects` themselves and compares them by identity: an
    immutable snapshot replaced by a new one is a new key (and, held here, its id cannot
    be reused by another object while the key lives)."""
    return tuple((id(o), o) for o in objects)


# Wall time this process started, before it counted anything: the alert rules tell a counter
# of a gpuguard started within their window (all of it new) from one seen again after a
# scrape gap (grafana/alerts.yml).
STARTED = time.time()


def build_families() -> Iterable[Metric]:
    build = _g("gpuguard_build_info", "gpuguard build", ["version"])
    build.add_metric([__version__], 1)
    yield build
    started = _g("gpuguard_start_time_seconds", "Wall time gpuguard started: its counters count from here", [])
    started.add_metric([], STARTED)
    yield started


def poller_families(hub: Hub) -> Iterable[Metric]:
    errors = CounterMetricFamily(
        "gpuguard_poll_errors", "Values that could not be read, per GPU and source", labels=["gpu", "source"]
    )
    for (gpu, source), n in sorted(hub.counters.poll_errors.items()):
        errors.add_metric([gpu, source], n)
    yield errors
    yield from hub.counters.poll_duration.collect()
    last = _g("gpuguard_last_poll_timestamp_seconds", "Wall time of the last finished poll", ["source"])
    for source, t in sorted(hub.last_poll.items()):
        last.add_metric([source], t)
    yield last


def kernel_families(hub: Hub) -> Iterable[Metric]:
    kev = CounterMetricFamily("gpuguard_kernel_events", "Classified kernel log lines", labels=["gpu", "kind"])
    # GPU-less lines (OOM kill, hung task) count under gpu="host" (state/gpus.py)
    for (gpu, kind), n in sorted(hub.gpus.kernel_counts.items()):
        kev.add_metric([gpu, kind], n)
    yield kev


def kernel_log_families(stats: Mapping[str, object]) -> Iterable[Metric]:
    """The kernel log reader's own counts (kernel/kmsg.py `KmsgReader.stats()`): records it
    never read are lines no alert was raised for."""
    for name, key, doc in (
        ("gpuguard_kernel_log_records_lost", "lost_records",
         "Kernel log records gpuguard never read: overwritten in the kernel's ring while it was "
         "paused, stopped or behind a flood (sequence numbers skipped)"),
        ("gpuguard_kernel_log_overruns", "overruns",
         "Reads of /dev/kmsg that found the next records already overwritten (EPIPE)"),
        ("gpuguard_kernel_log_records_malformed", "bad_records",
         "Kernel log records skipped as malformed, or with a sequence number no kernel can have"),
    ):
        fam = CounterMetricFamily(name, doc)
        fam.add_metric([], stats[key])
        yield fam


def gpu_families(hub: Hub) -> Iterable[Metric | Keyed]:
    """The GPU block, one family at a time: each is built, yielded and let go before the
    next (render() renders each as it comes), so a scrape never holds every sample of the
    block at once. At 32 GPUs that was about 2 000 samples with their label dicts, the
    scrape's peak, and the peak stays in the daemon's RSS (issue 15). What changes on a
    reset, a profile or a suspend rather than every poll is Keyed: rendered once."""
    snap = hub.snapshot
    gpus = snap.gpus if snap else ()
    yield Keyed("gpuguard_gpu_info", tuple((g.name, g.bdf, g.vendor, g.device_id, g.model, g.card, g.driver) for g in gpus),
                lambda: _info(gpus))
    states = hub.gpus

    def up(g) -> int:
        # the state owner's word (state/gpus.py): a card the kernel declared lost reads fine
        # until it has answered for poll.lost_after_seconds, and is not up meanwhile
        s = states.get(g.bdf)
        return 1 if (s.up if s is not None else g.up) else 0

    yield _keyed_gpu(gpus, "gpuguard_gpu_up", "1 = GPU answering, 0 = lost or not answering", up)
    yield _keyed_gpu(gpus, "gpuguard_gpu_runtime_suspended", "1 = runtime-suspended (not woken to poll)",
                     lambda g: 1 if g.runtime_status == "suspended" else 0)
    yield _each_gpu(gpus, "gpuguard_gpu_power_watts", "Average package power", attrgetter("power_watts"))
    yield _keyed_gpu(gpus, "gpuguard_gpu_power_cap_watts", "Current power cap", attrgetter("power_cap_watts"))
    yield _keyed_gpu(gpus, "gpuguard_gpu_power_cap_min_watts", "Lowest settable power cap",
                     attrgetter("power_cap_min_watts"))
    yield _keyed_gpu(gpus, "gpuguard_gpu_power_cap_max_watts", "Highest settable power cap",
                     attrgetter("power_cap_max_watts"))
    yield _keyed_gpu(gpus, "gpuguard_gpu_power_cap_default_watts", "Default power cap",
                     attrgetter("power_cap_default_watts"))
    yield _each_key(gpus, "gpuguard_gpu_temperature_celsius", "Temperature per sensor", ["sensor"],
                    attrgetter("temperatures"))
    yield _keyed_key(gpus, "gpuguard_gpu_temperature_limit_celsius", "Temperature limits per sensor",
                     ["sensor", "level"], attrgetter("temperature_limits"))
    yield _each_key(gpus, "gpuguard_gpu_clock_hertz", "Current clock", ["domain"], attrgetter("clocks_hz"))
    yield _each_gpu(gpus, "gpuguard_gpu_fan_rpm", "Fan speed", attrgetter("fan_rpm"))
    yield _each_gpu(gpus, "gpuguard_gpu_busy_ratio", "GPU busy, 0-1", attrgetter("busy_ratio"))
    yield _each_gpu(gpus, "gpuguard_gpu_vram_used_bytes", "VRAM in use", attrgetter("vram_used_bytes"))
    yield _keyed_gpu(gpus, "gpuguard_gpu_vram_total_bytes", "VRAM size", attrgetter("vram_total_bytes"))
    yield _keyed_gpu(gpus, "gpuguard_gpu_vram_visible_bytes", "CPU-visible VRAM (equals total with large BAR)",
                     attrgetter("vram_visible_bytes"))
    yield _keyed_gpu(gpus, "gpuguard_gpu_vram_reserved_bytes", "VRAM the NVIDIA driver reserves (not in used; NVML v2)",
                     attrgetter("vram_reserved_bytes"))
    yield _each_key(gpus, "gpuguard_gpu_voltage_volts", "Voltage per rail", ["rail"], attrgetter("voltages"))
    yield _keyed_key(gpus, "gpuguard_gpu_od_setting", "OD setting read back now", ["setting"],
                     lambda g: g.od.settings if g.od is not None else {})
    missing = _g("gpuguard_gpu_configured_missing", "1 = a configured GPU has no identified present card",
                 ["gpu", "match"])
    for m in hub.gpus.missing():
        missing.add_metric([m.name, m.match], 1)
    yield missing


def _info(gpus: Iterable) -> GaugeMetricFamily:
    info = _g("gpuguard_gpu_info", "GPU identity; card is today's cardN", ["gpu", "bdf", "vendor", "device_id", "model", "card", "driver"])
    for g in gpus:
        info.add_metric([g.name, g.bdf, g.vendor, g.device_id, g.model, g.card or "", g.driver], 1)
    return info


def _keyed_gpu(gpus: Iterable, name: str, doc: str, value: Callable) -> Keyed:
    return Keyed(name, tuple((g.name, value(g)) for g in gpus), lambda: _each_gpu(gpus, name, doc, value))


def _keyed_key(gpus: Iterable, name: str, doc: str, labels: list[str], values: Callable) -> Keyed:
    return Keyed(name, tuple((g.name, tuple(values(g).items())) for g in gpus),
                 lambda: _each_key(gpus, name, doc, labels, values))


def _each_gpu(gpus: Iterable, name: str, doc: str, value: Callable) -> GaugeMetricFamily:
    """One sample per GPU; unknown is absent, never a zero."""
    fam = _g(name, doc, ["gpu"])
    for g in gpus:
        v = value(g)
        if v is not None:
            fam.add_metric([g.name], v)
    return fam


def _each_key(gpus: Iterable, name: str, doc: str, labels: list[str], values: Callable) -> GaugeMetricFamily:
    """One sample per GPU and key of its mapping (sensor, rail, domain; a tuple key fills
    several labels), keys in sorted order."""
    fam = _g(name, doc, ["gpu", *labels])
    for g in gpus:
        for k, v in sorted(values(g).items()):
            fam.add_metric([g.name, *k] if isinstance(k, tuple) else [g.name, k], v)
    return fam



class _Exposition:
    """The one object in the prometheus registry; it runs the named collectors."""

    def __init__(self, sink: "MetricsSink") -> None:
        self._sink = sink

    def describe(self) -> list:
        # Returning nothing keeps registration from calling collect() early.
        return []

    def collect(self) -> Iterable[Metric]:
        return self._sink._scrape()


class MetricsSink:
    """Owns the registry and the named collectors; `render()` returns the exposition text."""

    def __init__(self, hub: Hub, producers: Iterable[Producer] = ()) -> None:
        self.hub = hub
        self._sources: dict[str, _Source] = {}
        self._owner: dict[str, str] = {DURATION: _SELF, SUCCESS: _SELF}  # family -> collector
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Exposition(self))
        # inputs: the same key serves the text rendered before (a scrape between two polls,
        # and these blocks between any two changes, cost a lookup, not a render)
        self.add("build", build_families, inputs=lambda: ("build",))
        # gpu_up is the state owner's word, which a kernel line changes between two polls
        self.add("gpu", lambda: gpu_families(hub),
                 inputs=lambda: same_objects(hub.snapshot) + tuple((m.name, m.match) for m in hub.gpus.missing())
                 + tuple(s.up for s in hub.gpus.all()))
        # NVIDIA health through NVML; keyed on what it reads, not the snapshot: on a host
        # without NVIDIA cards every poll is a new snapshot and the same empty block
        self.add("nvml", lambda: nvml_families(hub.snapshot),
                 inputs=lambda: tuple((g.name, g.extra.get("nvml"), g.extra.get("nvml_unsupported"))
                                      for g in (hub.snapshot.gpus if hub.snapshot else ())))
        self.add("poller", lambda: poller_families(hub))
        self.add("kernel", lambda: kernel_families(hub), inputs=lambda: tuple(sorted(hub.gpus.kernel_counts.items())))
        for produce in producers:
            self.add_producer(produce)

    @property
    def collectors(self) -> list[str]:
        return list(self._sources)

    def add(self, name: str, collect: Collect, inputs: Callable[[], tuple] | None = None) -> None:
        """Register source `name`. Its collect() is run once now: the families it yields are
        its own, and one another collector already yields is a CollectorError naming both.
        `inputs()`, where given, returns a key of everything collect() reads (see
        `same_objects`): while it is unchanged, a scrape serves the text rendered before."""
        if not _NAME.match(name):
            raise CollectorError(f"metrics collector name {name!r}: use lowercase letters, digits and _")
        if name in self._sources or name == _SELF:
            raise CollectorError(f"metrics collector {name!r} registered twice")
        try:
            families = [f.name for f in collect()]
        except Exception as e:  # noqa: BLE001 - a start-up bug, reported with the collector's name
            raise CollectorError(f"metrics collector {name!r} failed at registration: {e!r}") from e
        src = _Source(name, collect, inputs=inputs)
        for fam in families:
            self._claim(src, fam)
        self._sources[name] = src

    def add_producer(self, produce: Producer) -> str:
        """Deprecated: use add(name, collect). Registers `produce` under a name derived
        from its module (`gpuguard.policy.power_watch` -> "power_watch") and returns it."""
        owner = getattr(produce, "__self__", None)
        module = getattr(owner if owner is not None else produce, "__module__", None) or "producer"
        base = re.sub(r"[^a-z0-9_]", "_", module.rsplit(".", 1)[-1].lower()).lstrip("_0123456789") or "producer"
        name, n = base, 2
        while name in self._sources:
            name, n = f"{base}_{n}", n + 1
        self.add(name, produce)
        return name

    def _claim(self, src: _Source, family: str) -> None:
        owner = self._owner.setdefault(family, src.name)
        if owner != src.name:
            raise CollectorError(f"metric family {family} is exported by both collector {owner!r} "
                                 f"and collector {src.name!r}")
        src.families.add(family)

    def _collect(self, src: _Source) -> list[Metric] | None:
        """The collector's families, None if it raised (logged on the change)."""
        families: list[Metric] = []
        ok = self._each_family(src, lambda fam: families.append(fam.build() if isinstance(fam, Keyed) else fam))
        return families if ok else None

    def _rendered(self, src: _Source) -> bytes | None:
        """The collector's block, each family rendered as it is yielded and let go (see
        gpu_families: the scrape's peak stays in the RSS), a Keyed one whose key did not
        change served as rendered before; None if it raised."""
        texts: list[bytes] = []

        def render(fam: Metric | Keyed) -> None:
            if isinstance(fam, Keyed):
                kept = src.keyed.get(fam.name)
                if kept is not None and kept[0] == fam.key:
                    texts.append(kept[1])
                    return
                text = generate_latest(_Families([fam.build()]))
                src.keyed[fam.name] = (fam.key, text)
                texts.append(text)
            else:
                texts.append(generate_latest(_Families([fam])))

        ok = self._each_family(src, render)
        return b"".join(texts) if ok else None

    def _each_family(self, src: _Source, take: Callable[[Metric | Keyed], object]) -> bool:
        """take(family) for each family src yields; False if it raised (logged on the
        change: one source's bug must not fail the scrape)."""
        try:
            for fam in src.collect():
                if fam.name not in src.families:
                    self._claim(src, fam.name)
                take(fam)
            ok = True
        except Exception as e:  # noqa: BLE001 - one source's bug must not fail the scrape
            ok = False
            if src.ok:
                log.error("metrics collector %s failed, its families are left out: %r", src.name, e,
                          exc_info=not isinstance(e, CollectorError))
        if ok and not src.ok:
            log.info("metrics collector %s answers again", src.name)
        src.ok = ok
        return ok

    def _self_families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (_g(DURATION, "Wall time of this scrape's collect, per collector", ["collector"]),
                _g(SUCCESS, "1 = the collector answered this scrape, 0 = it raised (its families are absent)",
                   ["collector"]))

    def _scrape(self) -> Iterable[Metric]:
        """Every family, uncached (the registry's view: get_sample_value in tests)."""
        with self._lock:
            out: list[Metric] = []
            duration, success = self._self_families()
            for src in self._sources.values():
                t0 = time.perf_counter()
                families = self._collect(src)
                duration.add_metric([src.name], time.perf_counter() - t0)
                success.add_metric([src.name], 0 if families is None else 1)
                out.extend(families or ())
            out += [duration, success]
            return out

    def render(self) -> bytes:
        """The exposition text: each collector's block rendered by client_python's
        generate_latest, a block whose inputs did not change served as rendered before.
        The same bytes as generate_latest over every family at once (a block per family)."""
        with self._lock:
            parts: list[bytes] = []
            duration, success = self._self_families()
            for src in self._sources.values():
                t0 = time.perf_counter()
                try:
                    key = src.inputs() if src.inputs is not None else None
                except Exception:  # noqa: BLE001 - then no cache: collect() reports its own errors
                    key = None
                if key is not None and src.cached is not None and src.cached[0] == key:
                    text, ok = src.cached[1], True
                else:
                    rendered = self._rendered(src)
                    ok = rendered is not None
                    text = rendered if rendered is not None else b""
                    src.cached = (key, text) if key is not None and ok else None
                duration.add_metric([src.name], time.perf_counter() - t0)
                success.add_metric([src.name], 1 if ok else 0)
                parts.append(text)
            parts.append(generate_latest(_Families([duration, success])))
            return b"".join(parts)
