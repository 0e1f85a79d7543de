"""The published JSON Schema of `gpuguard pcie --json` (docs/pcie.schema.json) is the one the
model generates, and real reports — the INCIDENTS §4 host, replayed real hosts, broken trees,
the simulated host — validate against it. GPUGUARD_REGEN=1 rewrites the published file
(review the diff: a change there is a change of the public contract)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuguard.document import document
from gpuguard.hw.pcie import walk
from gpuguard.hw.pcie_model import SCHEMA_VERSION, json_schema
from gpuguard.hw.sysfs import SysfsRoot
from golden import check_golden
from schema_check import errors

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "docs" / "pcie.schema.json"
FIXTURES = REPO / "tests" / "fixtures" / "pcie"
XTX = ("0000:aa:00.0", "0000:b0:00.0")


def published_text() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def test_the_published_schema_is_the_one_the_model_generates():
    text = published_text()
    if os.environ.get("GPUGUARD_REGEN"):
        PUBLISHED.write_text(text, encoding="utf-8")
    assert PUBLISHED.exists(), f"{PUBLISHED} missing: write it with GPUGUARD_REGEN=1"
    assert PUBLISHED.read_text(encoding="utf-8") == text, (
        "docs/pcie.schema.json differs from the model (gpuguard.hw.pcie_model); GPUGUARD_REGEN=1 rewrites it")


def test_the_schema_pins_the_version_every_key_and_no_other():
    s = json_schema()
    assert s["properties"]["schema"] == {"description": s["properties"]["schema"]["description"],
                                         "const": SCHEMA_VERSION}
    objects = [s, *s["$defs"].values()]
    for o in objects:
        assert o["required"] == list(o["properties"]) and o["additionalProperties"] is False
    hop = s["$defs"]["PcieHop"]["properties"]
    assert hop["role"]["enum"] == ["root_port", "switch_upstream", "switch_downstream", "card_upstream",
                                   "card_downstream", "gpu", "endpoint", "bridge", "unknown"]
    assert s["$defs"]["PcieLink"]["properties"]["kind"]["enum"] == ["external", "card_internal", "switch_internal"]


def assert_valid(doc) -> None:
    found = errors(json_schema(), json.loads(json.dumps(doc)))
    assert not found, "\n".join(found[:20])


@pytest.mark.parametrize("busy", [True, False])
def test_the_incident_host_validates(incident, busy):
    lines = ["amdgpu 0000:aa:00.0: amdgpu: Detected VRAM RAM=24560M, BAR=256M",
             "amdgpu 0000:05:00.0: amdgpu: PCIe P2P access from peer device 0000:aa:00.0 is not supported by the chipset"]
    doc = document(walk(SysfsRoot(str(incident.base)), {b: busy for b in XTX}, kernel_lines=lines))
    assert doc["gpus"] and doc["pairs"]
    # the optional parts are there, so their schema is exercised too
    assert any(g["kernel_vram"] for g in doc["gpus"]) and any(g["root_port_atomics"] for g in doc["gpus"])
    hops = [h for g in doc["gpus"] for h in g["hops"]]
    assert any(h["link"] for h in hops) and any(h["aer"] for h in hops) and any(g["bars"] for g in doc["gpus"])
    assert_valid(doc)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.pcie.json")))
def test_reports_of_real_hosts_validate(name):
    assert_valid(json.loads((FIXTURES / name).read_text()))


def test_a_tree_of_garbage_validates(incident):
    for path in incident.base.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.write_bytes(b"\xff\xfe garbage \x80\n")
    doc = document(walk(SysfsRoot(str(incident.base)), select=lambda *_: True))
    assert doc["gpus"] and all(g["errors"] or any(h["errors"] for h in g["hops"]) for g in doc["gpus"])
    assert_valid(doc)


def test_the_simulated_host_validates(tmp_path):
    from gpuguard.sim.runner import build_scenario
    from gpuguard.sim.tree import write_tree

    write_tree(build_scenario("incident"), str(tmp_path))
    doc = document(walk(SysfsRoot(str(tmp_path))))
    assert len(doc["gpus"]) == 4
    assert_valid(doc)


def test_the_checker_catches_what_breaks_the_schema(incident):
    doc = json.loads(json.dumps(document(walk(SysfsRoot(str(incident.base))))))
    schema = json_schema()
    hop = doc["gpus"][0]["hops"][1]
    broken = [
        ("missing key", lambda d: d["gpus"][0].pop("large_bar")),
        ("extra key", lambda d: d["gpus"][0]["hops"][1].update(width_lanes=16)),
        ("wrong type", lambda d: d["gpus"][0]["hops"][1].update(current_width="16")),
        ("not in enum", lambda d: d["gpus"][0]["hops"][1].update(role="switch")),
        ("bool is no integer", lambda d: d["gpus"][0]["bars"][0].update(index=True)),
        ("wrong version", lambda d: d.update(schema=2)),
        ("null link fields", lambda d: d["gpus"][0]["hops"][1]["link"].update(kind=None)),
    ]
    assert hop["link"] is not None
    for what, breaks in broken:
        d = json.loads(json.dumps(doc))
        breaks(d)
        assert errors(schema, d), f"{what} passed the check"


def test_pcie_json_of_the_incident_host_matches_golden(incident):
    """The whole `gpuguard pcie --json` document, key order included, reviewed as a diff."""
    doc = document(walk(SysfsRoot(str(incident.base)), {b: True for b in XTX}))
    check_golden("incident-host.pcie.json", json.dumps(doc, indent=2) + "\n")
