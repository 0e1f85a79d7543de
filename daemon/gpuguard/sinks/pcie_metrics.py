"""The PCIe families of /metrics (reference/METRICS.md) from the latest `PcieReport`: per hop
its link speed and width (current and maximum) and whether it is an end of a downgraded
link, AER error counts per device, per GPU its bottleneck bandwidth and BAR sizes, per GPU
pair whether each direction can reach the other's VRAM peer-to-peer. A value that is
unknown is left out, never exported as zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpuguard.hw.pcie_model import PcieReport
from gpuguard.state.identity import default_name


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float
    type: str = "gauge"  # gauge | counter


def samples(report: PcieReport, gpu_names: Mapping[str, str] = MappingProxyType({}),
            only: str | None = None, held: frozenset[str] = frozenset()) -> Iterator[Sample]:
    """The PCIe metrics of reference/METRICS.md from one report. `gpu_names[bdf]` is the
    configured name (default: the PCI address, state/identity.default_name). A value that is unknown is left out,
    never exported as zero. `only`: that family's samples alone (the others not built).
    `held`: GPUs whose series are from their last walk before they were lost."""
    every = only is None
    aer_seen: set[str] = set()
    # The GPUs behind each hop, so an AER alert names them; a switch or root
    # port shared by several GPUs names them all, comma-separated, in one series.
    behind: dict[str, list[str]] = {}
    for g in report.gpus:
        for h in g.hops:
            behind.setdefault(h.bdf, []).append(gpu_names.get(g.bdf, default_name(g.bdf)))
    for g in report.gpus:
        gpu = gpu_names.get(g.bdf, default_name(g.bdf))
        for i, h in enumerate(g.hops):
            lab = {"gpu": gpu, "bdf": h.bdf, "hop": str(i), "role": h.role}
            for name, v in (
                ("gpuguard_pcie_link_current_transfers_per_second", h.current_speed_gts),
                ("gpuguard_pcie_link_max_transfers_per_second", h.max_speed_gts),
            ):
                if v is not None and (every or only == name):
                    yield Sample(name, lab, v * 1e9)
            for name, w in (
                ("gpuguard_pcie_link_current_width", h.current_width),
                ("gpuguard_pcie_link_max_width", h.max_width),
            ):
                if w is not None and (every or only == name):
                    yield Sample(name, lab, float(w))
            if every or only == "gpuguard_pcie_link_downgraded":
                yield Sample("gpuguard_pcie_link_downgraded", lab, 1.0 if h.downgraded else 0.0)
            if h.bdf not in aer_seen and (every or only == "gpuguard_pcie_aer_errors_total"):
                aer_seen.add(h.bdf)
                for sev, n in h.aer.items():
                    yield Sample("gpuguard_pcie_aer_errors_total",
                                 {"bdf": h.bdf, "gpu": ",".join(sorted(set(behind[h.bdf]))), "severity": sev},
                                 float(n), "counter")
        bw = g.bottleneck_bytes_per_second
        if bw is not None and (every or only == "gpuguard_gpu_pcie_bottleneck_bytes_per_second"):
            yield Sample("gpuguard_gpu_pcie_bottleneck_bytes_per_second", {"gpu": gpu}, bw)
        if every or only == "gpuguard_gpu_bar_bytes":
            for b in g.bars:
                yield Sample("gpuguard_gpu_bar_bytes", {"gpu": gpu, "bar": str(b.index)}, float(b.size_bytes))
        if every or only == "gpuguard_gpu_pcie_held":
            yield Sample("gpuguard_gpu_pcie_held", {"gpu": gpu}, 1.0 if g.bdf in held else 0.0)
    if not (every or only == "gpuguard_gpu_pair_p2p"):
        return
    for p in report.pairs:
        a, b = gpu_names.get(p.a, default_name(p.a)), gpu_names.get(p.b, default_name(p.b))
        for d in p.directions:
            if d.possible is None:
                continue  # unknown is left out, never a zero
            way = "a_to_b" if d.reader == p.a else "b_to_a"
            yield Sample("gpuguard_gpu_pair_p2p", {"a": a, "b": b, "direction": way}, 1.0 if d.possible else 0.0)


# In the order samples() first yields them on a host that knows every value: /metrics
# lists the families in this order.
METRIC_HELP = {
    "gpuguard_pcie_link_current_transfers_per_second": "Current PCIe link speed per lane of a hop (transfers/s)",
    "gpuguard_pcie_link_max_transfers_per_second": "Maximum PCIe link speed per lane the hop supports (transfers/s)",
    "gpuguard_pcie_link_current_width": "Current PCIe link width of a hop (lanes)",
    "gpuguard_pcie_link_max_width": "Maximum PCIe link width of a hop (lanes)",
    "gpuguard_pcie_link_downgraded": "1 when the hop is an end of a link running below what both ends support",
    "gpuguard_pcie_aer_errors_total": "PCIe AER errors counted by the kernel per device",
    "gpuguard_gpu_pcie_bottleneck_bytes_per_second": "Usable bandwidth of the GPU's narrowest PCIe hop (bytes/s, per direction)",
    "gpuguard_gpu_bar_bytes": "Size of a GPU BAR (bytes)",
    "gpuguard_gpu_pcie_held": "1 when the GPU is lost and its PCIe series and findings are those of its last walk, "
                              "kept until it is back and walked again (a vanished card is not a fixed slot)",
    "gpuguard_gpu_pair_p2p": "1 when GPU a (a_to_b) or b (b_to_a) can access the other's VRAM peer-to-peer by the kernel's rules (large BAR of the accessed card, p2pdma path)",
}


class PcieCollector:
    """A prometheus_client custom collector over the latest report; `collect()` formats
    memory only, it never touches hardware (client_python runs it on the event loop)."""

    def __init__(self, latest: Callable[[], PcieReport | None],
                 gpu_names: Callable[[], Mapping[str, str]] = lambda: {},
                 held: Callable[[], frozenset[str]] = frozenset) -> None:
        self._latest = latest
        self._names = gpu_names  # bdf -> configured name
        self._held = held  # GPUs reported from their last walk (lost)

    def describe(self):
        return []

    def collect(self):
        """One family at a time, each let go before the next is built: at 32 GPUs the
        block is ~3 000 samples (992 of them GPU-pair directions), 1.1 MiB built at once,
        and a scrape's peak stays in the daemon's RSS (issue 15)."""
        report = self._latest()
        if report is None:
            return
        names, held = self._names(), self._held()
        for name in METRIC_HELP:
            fam = None
            for s in samples(report, names, only=name, held=held):
                if fam is None:
                    if s.type == "counter":
                        fam = CounterMetricFamily(name[: -len("_total")], METRIC_HELP[name], labels=list(s.labels))
                    else:
                        fam = GaugeMetricFamily(name, METRIC_HELP[name], labels=list(s.labels))
                fam.add_metric(list(s.labels.values()), s.value)
            if fam is not None:
                yield fam
