"""The shipped Grafana dashboard: importable (schema, ${DS_PROMETHEUS} input, variables), laid out
without overlaps, generated from grafana/make_dashboard.py, and every query valid PromQL."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

MAKE = Path(__file__).resolve().parents[2] / "grafana" / "make_dashboard.py"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Values a Grafana server would put in for the variables, so promtool can parse the query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def test_json_is_generated_from_make_dashboard():
    p = subprocess.run([sys.executable, str(MAKE), "--check"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_importable_with_a_prometheus_input(dashboard):
    assert dashboard["schemaVersion"] >= 39
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == DS, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t["datasource"] == DS, p["title"]
    for v in dashboard["templating"]["list"]:
        assert v["datasource"] == DS, v["name"]


def test_gpu_variable_lists_configured_gpu_names(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["gpu"]["query"]["query"] == "label_values(gpuguard_gpu_info, gpu)"
    assert variables["gpu"]["multi"] and variables["gpu"]["includeAll"]


def test_queries_use_only_defined_variables(dashboard, dashboard_exprs):
    defined = {f"${v['name']}" for v in dashboard["templating"]["list"]} | set(GRAFANA_VARIABLES)
    for where, expr in dashboard_exprs:
        used = set(re.findall(r"\$\w+", expr))
        assert used <= defined, f"{where}: undefined {used - defined}"
    # Every GPU-labelled query follows the GPU selection.
    for where, expr in dashboard_exprs:
        if "gpuguard_gpu_" in expr or "gpuguard_pcie_link" in expr:
            assert 'gpu=~"$gpu' in expr, where


def test_panel_ids_unique_and_layout_does_not_overlap(dashboard):
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_rows_cover_each_concern(dashboard):
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Overview", "Power", "Temperatures", "Clocks and OD settings", "Load and VRAM", "PCIe",
                    "Kernel events", "Engines", "NVIDIA (NVML)", "Profiles", "gpuguard"]
    titles = {p["title"]: p for p in dashboard["panels"]}
    # INCIDENTS §3: the clock panel carries the OD clock limit next to the clock.
    clock_exprs = [t["expr"] for t in titles["Clocks vs OD clock limit"]["targets"]]
    assert any("gpuguard_gpu_clock_hertz" in e for e in clock_exprs)
    assert any('setting="sclk_max_mhz"' in e for e in clock_exprs)
    # INCIDENTS §4: the hop table shows current and max side by side, and the downgrade.
    hop_exprs = " ".join(t["expr"] for t in titles["Links per hop (root port first)"]["targets"])
    for name in ("current_transfers", "max_transfers", "current_width", "max_width", "downgraded"):
        assert f"gpuguard_pcie_link_{name}" in hop_exprs


def test_every_query_parses(run_promtool, dashboard_exprs, tmp_path):
    """promtool has no offline `query`; each expr becomes a throwaway recording rule that
    `promtool check rules` parses."""
    rules = []
    for i, (where, expr) in enumerate(dashboard_exprs):
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        expr = re.sub(r"\$\w+", ".*", expr)  # multi-value variables become regex matchers
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    rc, out = run_promtool("check", "rules", str(path))
    assert rc == 0, out
    assert f"SUCCESS: {len(rules)} rules found" in out, out
