#!/usr/bin/env python3
"""Source of grafana/gpuguard-dashboard.json: the gpuguard Grafana dashboard, one row per
concern of DESIGN.md, written against the metric names of reference/METRICS.md.

The JSON is what users import (Dashboards -> Import; it asks for a Prometheus data source,
`${DS_PROMETHEUS}`). Edit this file, not the JSON, then regenerate:

    python3 grafana/make_dashboard.py            # rewrites grafana/gpuguard-dashboard.json
    python3 grafana/make_dashboard.py --check    # exit 1 if the JSON is out of date

tests/grafana/test_dashboard.py fails when the two disagree.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "gpuguard-dashboard.json"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# Selectors every query uses, so the template variables filter everything.
HOST = 'instance=~"$instance"'
GPU = f'{HOST},gpu=~"$gpu"'
# Kernel lines not attributed to a GPU (OOM kill, hung task) carry gpu="host": keep them
# visible under any selection.
GPU_OR_NONE = f'{HOST},gpu=~"$gpu|host"'
ENGINE = f'{HOST},engine=~"$engine"'

DASHED = {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}}


def target(expr: str, legend: str = "", *, instant: bool = False, ref: str = "A") -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref}
    if instant:
        t.update(instant=True, range=False, format="table")
    else:
        t.update(instant=False, range=True)
    return t


def thresholds(*steps: tuple[float | None, str]) -> dict:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def state_mapping(off: str, on: str, off_color: str = "red", on_color: str = "green") -> list[dict]:
    return [
        {
            "type": "value",
            "options": {
                "0": {"text": off, "color": off_color, "index": 0},
                "1": {"text": on, "color": on_color, "index": 1},
            },
        }
    ]


def dashed_when(regex: str) -> dict:
    """Limits (caps, emergency lines, OD maxima) are drawn dashed next to the values."""
    return {"matcher": {"id": "byRegexp", "options": regex}, "properties": [DASHED]}


def panel(kind: str, title: str, targets: list[dict], *, w: int = 12, h: int = 8, unit: str = "short",
          description: str = "", overrides: list | None = None, mappings: list | None = None,
          steps: dict | None = None, options: dict | None = None, custom: dict | None = None,
          transformations: list | None = None, min_: float | None = None, max_: float | None = None) -> dict:
    defaults: dict = {"unit": unit}
    if mappings:
        defaults["mappings"] = mappings
    if steps:
        defaults["thresholds"] = steps
    if custom:
        defaults["custom"] = custom
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    p = {
        "type": kind,
        "title": title,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "gridPos": {"w": w, "h": h},
    }
    if description:
        p["description"] = description
    if options:
        p["options"] = options
    if transformations:
        p["transformations"] = transformations
    return p


def timeseries(title: str, targets: list[dict], **kw) -> dict:
    bars = kw.pop("bars", False)
    custom = {"drawStyle": "bars", "fillOpacity": 80, "stacking": {"mode": "normal"}} if bars else {"fillOpacity": 0}
    opts = {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"}}
    return panel("timeseries", title, targets, custom=custom, options=opts, **kw)


def stat(title: str, targets: list[dict], **kw) -> dict:
    opts = {"colorMode": "background", "graphMode": "none", "textMode": "value_and_name",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return panel("stat", title, targets, options=opts, **kw)


def state_timeline(title: str, targets: list[dict], **kw) -> dict:
    opts = {"showValue": "never", "mergeValues": True, "rowHeight": 0.8, "legend": {"showLegend": False}}
    return panel("state-timeline", title, targets, options=opts, **kw)


def table(title: str, targets: list[dict], **kw) -> dict:
    return panel("table", title, targets, options={"showHeader": True, "cellHeight": "sm"}, **kw)


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


# ------------------------------------------------------------------------------------- rows

def overview() -> list[dict]:
    return [
        row("Overview"),
        stat("GPU up", [target(f"gpuguard_gpu_up{{{GPU}}}", "{{gpu}}")], w=6, h=5,
             mappings=state_mapping("LOST", "up"),
             description="0 = lost or not answering. INCIDENTS §1: kill the engines, then reboot; "
                         "cold power-cycle if the reboot does not come back."),
        stat("Profile verified", [target(f"gpuguard_profile_verified{{{GPU}}}", "{{gpu}} {{profile}}")], w=6, h=5,
             mappings=state_mapping("UNVERIFIED", "verified"),
             description="Read-back equals the profile. INCIDENTS §2: an unlimited card tripped the PSU."),
        stat("Engine stalled", [target(f"gpuguard_engine_stalled{{{ENGINE}}}", "{{engine}}")], w=6, h=5,
             mappings=state_mapping("ok", "STALLED", off_color="green", on_color="red")),
        stat("Since last GPU poll",
             [target(f'time() - gpuguard_last_poll_timestamp_seconds{{{HOST},source="gpu"}}', "{{instance}}")],
             w=6, h=5, unit="s", steps=thresholds((None, "green"), (30, "orange"), (60, "red")),
             description="More than a minute: the poll loop is wedged (alert GpuguardNotPolling)."),
    ]


def power() -> list[dict]:
    return [
        row("Power"),
        timeseries("Power vs cap", [
            target(f"gpuguard_gpu_power_watts{{{GPU}}}", "{{gpu}} power"),
            target(f"gpuguard_gpu_power_cap_watts{{{GPU}}}", "{{gpu}} cap"),
            target(f"gpuguard_gpu_power_peak_watts{{{GPU}}}", "{{gpu}} peak", ref="C"),
        ], unit="watt", overrides=[dashed_when(".* cap$")],
            description="Average package power against the current cap (dashed) and the fast-sampled peak of "
                        "each poll interval. INCIDENTS §2: the cap bounds the long-window average only; "
                        "transients tripped a 1300 W PSU at 263 W."),
        timeseries("Power / cap", [
            target(f"gpuguard_gpu_power_watts{{{GPU}}} / gpuguard_gpu_power_cap_watts{{{GPU}}}", "{{gpu}}"),
        ], unit="percentunit", min_=0, steps=thresholds((None, "green"), (0.97, "red")),
            description="At 97 % for 15 minutes the card is power-limited (alert GpuguardPowerAtCap)."),
    ]


def temperatures() -> list[dict]:
    headroom = (f'gpuguard_gpu_temperature_limit_celsius{{{GPU},level="emergency"}}'
                f" - ignoring(level) gpuguard_gpu_temperature_celsius{{{GPU}}}")
    return [
        row("Temperatures"),
        timeseries("Temperatures and emergency limits", [
            target(f"gpuguard_gpu_temperature_celsius{{{GPU}}}", "{{gpu}} {{sensor}}"),
            target(f'gpuguard_gpu_temperature_limit_celsius{{{GPU},level="emergency"}}', "{{gpu}} {{sensor}} emergency"),
        ], unit="celsius", overrides=[dashed_when(".* emergency$")]),
        panel("bargauge", "Headroom to the emergency limit", [target(headroom, "{{gpu}} {{sensor}}")],
              w=6, unit="celsius", min_=0, steps=thresholds((None, "red"), (5, "orange"), (10, "green")),
              options={"orientation": "horizontal", "displayMode": "basic",
                       "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
              description="INCIDENTS §3: sustained load ran 8 °C under the 95 °C line. Under 5 °C for a "
                          "minute raises GpuguardTemperatureNearEmergency."),
        timeseries("Fan", [target(f"gpuguard_gpu_fan_rpm{{{GPU}}}", "{{gpu}}")], w=6, unit="rotrpm"),
    ]


def clocks() -> list[dict]:
    return [
        row("Clocks and OD settings"),
        timeseries("Clocks vs OD clock limit", [
            target(f"gpuguard_gpu_clock_hertz{{{GPU}}}", "{{gpu}} {{domain}}"),
            target(f'gpuguard_gpu_od_setting{{{GPU},setting="sclk_max_mhz"}} * 1e6', "{{gpu}} OD sclk max"),
        ], unit="hertz", overrides=[dashed_when(".* OD sclk max$")],
            description="INCIDENTS §3: a forgotten 1500 MHz limit held a 7900 XTX at 1233 MHz against a "
                        "2371 MHz boost and halved throughput. A clock flat under the dashed OD limit while "
                        "busy is the profile, not the PCIe switch."),
        table("OD settings read back now", [target(f"gpuguard_gpu_od_setting{{{GPU}}}", instant=True)],
              transformations=[{"id": "groupingToMatrix",
                                "options": {"rowField": "gpu", "columnField": "setting", "valueField": "Value"}}],
              description="Values read back from pp_od_clk_voltage (MHz, mV). Compare cards: two cards of "
                          "one profile should read alike."),
        timeseries("Voltage", [target(f"gpuguard_gpu_voltage_volts{{{GPU}}}", "{{gpu}} {{rail}}")], unit="volt"),
        state_timeline("Runtime suspended", [target(f"gpuguard_gpu_runtime_suspended{{{GPU}}}", "{{gpu}}")],
                       mappings=state_mapping("active", "suspended", off_color="green", on_color="blue"),
                       description="A suspended GPU is not woken to be polled; its values pause."),
    ]


def load_vram() -> list[dict]:
    return [
        row("Load and VRAM"),
        timeseries("Busy", [target(f"gpuguard_gpu_busy_ratio{{{GPU}}}", "{{gpu}}")], w=8, unit="percentunit",
                   min_=0, max_=1),
        timeseries("VRAM used vs total", [
            target(f"gpuguard_gpu_vram_used_bytes{{{GPU}}}", "{{gpu}} used"),
            target(f"gpuguard_gpu_vram_total_bytes{{{GPU}}}", "{{gpu}} total"),
        ], w=8, unit="bytes", overrides=[dashed_when(".* total$")]),
        panel("bargauge", "CPU-visible VRAM / VRAM (large BAR)", [
            target(f"gpuguard_gpu_vram_visible_bytes{{{GPU}}} / gpuguard_gpu_vram_total_bytes{{{GPU}}}", "{{gpu}}"),
        ], w=8, unit="percentunit", min_=0, max_=1, steps=thresholds((None, "orange"), (1, "green")),
            options={"orientation": "horizontal", "displayMode": "basic",
                     "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
            description="Under 100 %: the BAR is not resized, no P2P (INCIDENTS §5)."),
    ]


def pcie() -> list[dict]:
    hop = f"{GPU}"
    renames = {"Value #A": "current GT/s", "Value #B": "max GT/s", "Value #C": "current width",
               "Value #D": "max width", "Value #E": "downgraded"}
    return [
        row("PCIe"),
        table("Links per hop (root port first)", [
            target(f"gpuguard_pcie_link_current_transfers_per_second{{{hop}}} / 1e9", instant=True),
            target(f"gpuguard_pcie_link_max_transfers_per_second{{{hop}}} / 1e9", instant=True),
            target(f"gpuguard_pcie_link_current_width{{{hop}}}", instant=True),
            target(f"gpuguard_pcie_link_max_width{{{hop}}}", instant=True),
            target(f"gpuguard_pcie_link_downgraded{{{hop}}}", instant=True),
        ], w=16, h=10,
            transformations=[
                # __name__ differs per query (and Time per evaluation): drop both so the five
                # answers merge into one row per hop.
                {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True, "job": True}}},
                {"id": "merge", "options": {}},
                {"id": "organize", "options": {
                    "indexByName": {"instance": 0, "gpu": 1, "hop": 2, "role": 3, "bdf": 4},
                    "renameByName": renames}},
                {"id": "sortBy", "options": {"sort": [{"field": "gpu"}, {"field": "hop"}]}},
            ],
            overrides=[{"matcher": {"id": "byName", "options": "downgraded"},
                        "properties": [{"id": "mappings", "value": state_mapping("no", "DOWNGRADED", "transparent", "red")},
                                       {"id": "custom.cellOptions", "value": {"type": "color-background"}}]}],
            description="Every hop from the root port to the GPU, current vs max. INCIDENTS §4: the switch "
                        "slot hop trained at 5 GT/s against 16 GT/s on both ends. A link runs at the lower of "
                        "its two ends; both ends of a downgraded link are flagged."),
        stat("Downgraded hops", [target(f"sum by (gpu) (gpuguard_pcie_link_downgraded{{{GPU}}})", "{{gpu}}")],
             w=8, h=10, steps=thresholds((None, "green"), (1, "red"))),
        timeseries("Bottleneck bandwidth (narrowest hop)",
                   [target(f"gpuguard_gpu_pcie_bottleneck_bytes_per_second{{{GPU}}}", "{{gpu}}")], w=8, unit="Bps",
                   description="Usable bandwidth of the narrowest hop per direction: the real host<->card "
                               "ceiling (INCIDENTS §4: Gen2 x16 = 8 GB/s, measured 6-7 GB/s)."),
        timeseries("AER errors", [target(
            f"sum by (bdf, severity) (increase(gpuguard_pcie_aer_errors_total{{{HOST}}}[$__rate_interval]))",
            "{{bdf}} {{severity}}")], w=8, bars=True),
        table("BAR sizes", [target(f"gpuguard_gpu_bar_bytes{{{GPU}}}", instant=True)], w=8,
              transformations=[{"id": "groupingToMatrix",
                                "options": {"rowField": "gpu", "columnField": "bar", "valueField": "Value"}}],
              unit="bytes"),
    ]


def kernel() -> list[dict]:
    return [
        row("Kernel events"),
        timeseries("Kernel events", [target(
            f"sum by (gpu, kind) (increase(gpuguard_kernel_events_total{{{GPU_OR_NONE}}}[$__rate_interval]))",
            "{{gpu}} {{kind}}")], w=16, bars=True,
            description="Classified kernel lines per GPU (gpu empty: not attributed). INCIDENTS §1: sq_intr, "
                        "then device lost, then eight GPU Recovery Failed."),
        table("Events in the time range", [target(
            f"sum by (gpu, kind) (increase(gpuguard_kernel_events_total{{{GPU_OR_NONE}}}[$__range])) > 0",
            instant=True)], w=8,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True},
                                                            "renameByName": {"Value": "count"}}}]),
    ]


def engines() -> list[dict]:
    return [
        row("Engines"),
        state_timeline("Engine ready", [target(f"gpuguard_engine_up{{{ENGINE}}}", "{{engine}}")], w=12, h=6,
                       mappings=state_mapping("down", "ready"),
                       description="The engine's own health endpoint answers ready (INCIDENTS §8: only the "
                                   "new process's 200 counts)."),
        state_timeline("Engine stalled", [target(f"gpuguard_engine_stalled{{{ENGINE}}}", "{{engine}}")], w=12, h=6,
                       mappings=state_mapping("ok", "STALLED", off_color="green", on_color="red")),
        timeseries("Requests running / waiting", [
            target(f"gpuguard_engine_requests_running{{{ENGINE}}}", "{{engine}} running"),
            target(f"gpuguard_engine_requests_waiting{{{ENGINE}}}", "{{engine}} waiting"),
        ], w=8),
        timeseries("Generated tokens per second", [target(
            f"rate(gpuguard_engine_generated_tokens_total{{{ENGINE}}}[$__rate_interval])", "{{engine}}")], w=8),
        timeseries("No-progress seconds", [target(f"gpuguard_engine_no_progress_seconds{{{ENGINE}}}", "{{engine}}")],
                   w=8, unit="s",
                   description="Time since tokens last advanced while requests were running (INCIDENTS §1, §9)."),
        timeseries("gpuguard actions on engines", [target(
            f"sum by (engine, action, reason) (increase(gpuguard_engine_actions_total{{{ENGINE}}}[$__rate_interval]))",
            "{{engine}} {{action}} ({{reason}})")], w=12, bars=True,
            description="Kills and restarts. Three in 30 minutes raise GpuguardEngineRestartLoop: look at "
                        "the compile caches (INCIDENTS §7)."),
        stat("Zero-byte files in caches", [target(f"gpuguard_cache_zero_byte_files{{{HOST}}}", "{{cache}}")], w=12,
             steps=thresholds((None, "green"), (1, "red")),
             description="INCIDENTS §7: quarantine the cache by renaming it, never delete."),
    ]


def nvidia() -> list[dict]:
    """NVIDIA health read through NVML (issue 18); empty on amdgpu-only hosts."""
    return [
        row("NVIDIA (NVML)"),
        state_timeline("Throttle reasons active", [target(
            f"gpuguard_gpu_throttle{{{GPU}}} == 1", "{{gpu}} {{reason}}")], w=12,
            mappings=state_mapping("no", "active", off_color="green", on_color="orange"),
            description="Clock-event reasons NVML reports now. sw_power_cap under full load is the card at its "
                        "cap (the H200 sat there at 700 W); hw_slowdown, hw_thermal, sw_thermal and power_brake "
                        "are cooling or power trouble (GpuguardGpuThrottledHardware)."),
        timeseries("Throttled time per reason", [target(
            f"rate(gpuguard_gpu_throttle_seconds_total{{{GPU}}}[$__rate_interval])", "{{gpu}} {{reason}}")],
            w=12, unit="percentunit", min_=0,
            description="Share of wall time spent throttled, per reason (NVML's time-in-state counters)."),
        timeseries("Power from the energy counter", [target(
            f"rate(gpuguard_gpu_energy_joules_total{{{GPU}}}[$__rate_interval])", "{{gpu}}")], w=8, unit="watt"),
        timeseries("Energy per generated token (host)", [target(
            f"sum by (instance) (rate(gpuguard_gpu_energy_joules_total{{{GPU}}}[$__rate_interval]))"
            f" / sum by (instance) (rate(gpuguard_engine_generated_tokens_total{{{HOST}}}[$__rate_interval]))",
            "{{instance}}")], w=8, unit="joule",
            description="The selected GPUs' energy over all engines' tokens on the host: shown where both are "
                        "known (select the GPUs the engines use)."),
        timeseries("Memory errors", [
            target(f"gpuguard_gpu_ecc_errors_total{{{GPU}}}", "{{gpu}} ECC {{type}} {{scope}}"),
            target(f"gpuguard_gpu_remapped_rows_total{{{GPU}}}", "{{gpu}} rows remapped {{type}}"),
            target(f"gpuguard_gpu_row_remap_pending{{{GPU}}}", "{{gpu}} remap pending"),
            target(f"gpuguard_gpu_row_remap_failure{{{GPU}}}", "{{gpu}} remap FAILED"),
        ], w=8, description="Uncorrectable ECC and a failed row remap alert (GpuguardGpuEccUncorrectable, "
                            "GpuguardGpuRowRemapFailure)."),
        timeseries("PCIe traffic and replays", [
            target(f"rate(gpuguard_gpu_pcie_tx_bytes_total{{{GPU}}}[$__rate_interval])", "{{gpu}} tx"),
            target(f"rate(gpuguard_gpu_pcie_rx_bytes_total{{{GPU}}}[$__rate_interval])", "{{gpu}} rx"),
            target(f"rate(gpuguard_gpu_pcie_replays_total{{{GPU}}}[$__rate_interval])", "{{gpu}} replays/s"),
        ], w=12, unit="Bps"),
        table("GPU memory per process", [target(f"gpuguard_gpu_process_vram_used_bytes{{{GPU}}}", instant=True)],
              w=12, unit="bytes"),
    ]


def profiles() -> list[dict]:
    return [
        row("Profiles"),
        state_timeline("Profile verified", [target(f"gpuguard_profile_verified{{{GPU}}}", "{{gpu}} {{profile}}")],
                       w=12, h=6, mappings=state_mapping("UNVERIFIED", "verified")),
        timeseries("Profile applies", [target(
            f"sum by (gpu, profile, result) (increase(gpuguard_profile_apply_total{{{GPU}}}[$__rate_interval]))",
            "{{gpu}} {{profile}} {{result}}")], w=12, h=6, bars=True),
    ]


def gpuguard_itself() -> list[dict]:
    return [
        row("gpuguard"),
        timeseries("Poll duration p99", [target(
            "histogram_quantile(0.99, sum by (le, source) "
            f"(rate(gpuguard_poll_duration_seconds_bucket{{{HOST}}}[$__rate_interval])))", "{{source}}")],
            w=8, unit="s"),
        timeseries("Poll errors per second", [target(
            f"sum by (gpu, source) (rate(gpuguard_poll_errors_total{{{GPU}}}[$__rate_interval]))",
            "{{gpu}} {{source}}")], w=8,
            description="Values that could not be read; `gpuguard status --json` names the file and error."),
        timeseries("Webhook failures", [target(
            f"sum by (url) (increase(gpuguard_webhook_failures_total{{{HOST}}}[$__rate_interval]))", "{{url}}")],
            w=8, bars=True),
        table("Build", [target(f"gpuguard_build_info{{{HOST}}}", instant=True)], w=24, h=4,
              transformations=[{"id": "organize",
                                "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}}}]),
    ]


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-query"}, "definition": query,
        "refresh": 2, "sort": 1, "multi": True, "includeAll": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def layout(panels: list[dict]) -> list[dict]:
    """Give each panel its id and a place: left to right, wrapping at 24 columns."""
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        g = p["gridPos"]
        if p["type"] == "row" or x + g["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        g["x"], g["y"] = x, y
        x += g["w"]
        row_h = max(row_h, g["h"])
        if p["type"] == "row":
            x, y, row_h = 0, y + g["h"], 0
    return panels


def dashboard() -> dict:
    panels = layout(overview() + power() + temperatures() + clocks() + load_vram() + pcie() + kernel()
                    + engines() + nvidia() + profiles() + gpuguard_itself())
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "Prometheus that scrapes gpuguard",
                      "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": k, "name": k, "version": ""}
              for k in sorted({p["type"] for p in panels} - {"row"})),
        ],
        "uid": "gpuguard",
        "title": "gpuguard",
        "description": "GPU host telemetry and safety (gpuguard). Alert rules: grafana/alerts.yml.",
        "tags": ["gpuguard", "gpu"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            variable("instance", "Host", "label_values(gpuguard_build_info, instance)"),
            variable("gpu", "GPU", "label_values(gpuguard_gpu_info, gpu)"),
            variable("engine", "Engine", "label_values(gpuguard_engine_up, engine)"),
        ]},
        "panels": panels,
        "links": [],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the JSON file is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python3 {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
