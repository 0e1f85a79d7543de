"""Issue 11 on the FUSE-mounted simulated incident host (real errno, real processes): a
GPU's lifecycle has one owner. Identity fails closed with a card missing (`apply` names
it and exits 1; nothing is planned onto the wrong card); a GPU that leaves the bus and
comes back (same address, or absent at boot and appearing) goes DOWN and UP again with
its profile re-applied; a GPU lost through the poller kills the engine on it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engines.engines_harness import SimEngine, alive
from gpuguard.state.audit import profile_records

pytestmark = [pytest.mark.slow, pytest.mark.fuse, pytest.mark.network]  # registered in pyproject.toml


R9700 = ("0000:05:00.0", "0000:08:00.0")
XTX = ("0000:aa:00.0", "0000:b0:00.0")
BY_INDEX = """
poll: {interval_seconds: 0.2, discover_seconds: 0.5}
kernel: {enabled: false}
profiles:
  psu-safe: {power_cap_w: 210, sclk_offset_mhz: -500, vddgfx_offset_mv: -100}
  xtx-1500: {sclk_max_mhz: 1500}
  xtx-2000: {sclk_max_mhz: 2000}
apply: {backoff_seconds: 0.05}
gpus:
  - {name: r9700-a, match: {bdf: "0000:05:00.0"}, profile: psu-safe}
  - {name: r9700-b, match: {bdf: "0000:08:00.0"}, profile: psu-safe}
  - {name: xtx-0, match: {pci_id: "1002:744c", index: 0}, profile: xtx-1500}
  - {name: xtx-1, match: {pci_id: "1002:744c", index: 1}, profile: xtx-2000}
"""


def apply_cli(tmp_path, mount, *args):
    cfg = tmp_path / "apply.yaml"
    cfg.write_text(BY_INDEX + f"state_dir: {tmp_path / 'state'}\n")
    return subprocess.run([sys.executable, "-m", "gpuguard", "apply", "--config", str(cfg), "--sysfs-root", str(mount),
                           *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("gone", XTX)
def test_apply_with_either_xtx_missing_plans_nothing_for_the_other_names_both_and_exits_1(sim, tmp_path, gone):
    sim.ctl("add_late_gpu", bdf=gone)  # not enumerated (yet)
    other = next(b for b in XTX if b != gone)
    r = apply_cli(tmp_path, sim.mount, "--dry-run")
    assert r.returncode == 1, r.stdout + r.stderr
    # the bug: `xtx-0 (0000:b0:00.0) profile xtx-1500` — xtx-0's profile on the second card
    assert other not in r.stdout, r.stdout
    assert "xtx-1500" not in r.stdout and "xtx-2000" not in r.stdout
    for m in ("xtx-0 (1002:744c #0)", "xtx-1 (1002:744c #1)"):
        assert f"configured GPU {m} is missing" in r.stderr
        assert f"{m}: MISSING" in r.stdout
    assert "1 of 2 cards with id 1002:744c present" in r.stderr
    # the cards matched by address are still planned
    assert "r9700-a (0000:05:00.0) profile psu-safe: dry run" in r.stdout
    js = json.loads(apply_cli(tmp_path, sim.mount, "--dry-run", "--json").stdout)
    assert {m["gpu"] for m in js["missing"]} == {"xtx-0", "xtx-1"}
    # `status` shows configured vs present too, and exits 1
    st = subprocess.run([sys.executable, "-m", "gpuguard", "status", "--config", str(tmp_path / "apply.yaml"),
                         "--sysfs-root", str(sim.mount)], capture_output=True, text=True, timeout=120)
    assert st.returncode == 1
    assert st.stdout.splitlines()[0] == "3/4 GPUs up; missing xtx-0 (1002:744c #0), xtx-1 (1002:744c #1)"
    assert any(ln.split()[:2] == [other, other] for ln in st.stdout.splitlines()), st.stdout  # name, address
    assert "MISSING xtx-0 (1002:744c #0)" in st.stdout


def test_apply_with_an_address_matched_card_missing_exits_1_naming_it(sim, tmp_path):
    sim.ctl("add_late_gpu", bdf=R9700[1])
    r = apply_cli(tmp_path, sim.mount)
    assert r.returncode == 1
    assert "configured GPU r9700-b (0000:08:00.0) is missing" in r.stderr
    assert "r9700-a (0000:05:00.0) profile psu-safe: VERIFIED" in r.stdout  # the others are applied
    assert "xtx-0 (0000:aa:00.0) profile xtx-1500: VERIFIED" in r.stdout
    sim.ctl("appear", bdf=R9700[1])
    assert apply_cli(tmp_path, sim.mount).returncode == 0


def verified(tmp_path, gpu):
    return [r for r in profile_records(tmp_path / "state" / "audit.jsonl") if r["action"] == "verified" and r["gpu"] == gpu]


def status(d) -> dict:
    import httpx

    return httpx.get(f"{d.base}/v1/status", timeout=2).json()


@pytest.mark.parametrize("how", ["lost_and_returned", "removed_and_appeared"])
def test_a_gpu_that_leaves_the_bus_and_comes_back_goes_down_then_up_with_its_profile(sim, start_daemon, wait_for, tmp_path, how):
    d = start_daemon(sim.mount, BY_INDEX)
    wait_for(lambda: verified(tmp_path, "xtx-0"), timeout=30, what="xtx-0 verified at start")
    if how == "lost_and_returned":
        sim.ctl("lose_gpu", bdf=XTX[0])  # EIO first, then the board leaves the bus
        sim.ctl("step", dt=0.5)
    else:
        sim.ctl("add_late_gpu", bdf=XTX[0])  # the device folder vanishes
    wait_for(lambda: d.value("gpuguard_gpu_up", gpu="xtx-0") == 0.0, timeout=20, what="xtx-0 down")
    st = wait_for(lambda: (s := status(d)) and "missing xtx-0" in s["summary"] and s, timeout=20, what="missing in summary")
    assert st["summary"].startswith("3/4 GPUs up"), st["summary"]
    # the other XTX keeps its name: it was identified while both were present
    assert d.value("gpuguard_gpu_up", gpu="xtx-1") == 1.0
    n = len(verified(tmp_path, "xtx-0"))
    if how == "lost_and_returned":
        sim.ctl("return_gpu", bdf=XTX[0])
    else:
        sim.ctl("appear", bdf=XTX[0])
    # the bug: "gone from the PCI bus" for ever, while the card read fine
    wait_for(lambda: d.value("gpuguard_gpu_up", gpu="xtx-0") == 1.0, timeout=20, what="xtx-0 up again")
    again = wait_for(lambda: verified(tmp_path, "xtx-0")[n:], timeout=30, what="xtx-0 re-applied and verified")
    assert "back" in again[0]["why"] or "appeared" in again[0]["why"]
    assert wait_for(lambda: status(d)["summary"] == "4/4 GPUs up", timeout=10, what="4/4 in the summary")
    od = sim.ctl("read", path=f"/sys/bus/pci/devices/{XTX[0]}/pp_od_clk_voltage")
    assert "1500Mhz" in od.split("OD_SCLK:")[1].split("OD_MCLK")[0], od
    kinds = [e["kind"] for e in __import__("httpx").get(f"{d.base}/v1/events").json()]
    assert kinds.count("gpu_lost") == 1 and "gpu_back" in kinds
    assert "Traceback" not in d.log.read_text()


SPARE_SLOT, MOVED = "0000:00:03.2", "0000:42:00.0"  # scenario incident-spare-slot


def engine_restarted_into(marker) -> str:
    """`restart_command` that leaves a marker file: the restart ran, as a real process."""
    code = f"open({str(marker)!r}, 'w').write('ok')"
    return "restart_command: " + json.dumps([sys.executable, "-c", code])


def test_a_card_matched_by_id_and_index_back_at_another_address_is_the_same_card_again(
        sim_spare_slot, start_daemon, wait_for, tmp_path):
    sim = sim_spare_slot
    e = SimEngine("vllm")
    marker = tmp_path / "restarted"
    try:
        engine = engine_yaml("on-xtx0", e, "xtx-0").replace("action: kill}", engine_restarted_into(marker) + "}")
        d = start_daemon(sim.mount, BY_INDEX + engine)
        wait_for(lambda: verified(tmp_path, "xtx-0"), timeout=30, what="xtx-0 verified at start")
        tree = e.tree()
        sim.ctl("lose_gpu", bdf=XTX[0])
        sim.ctl("step", dt=0.5)  # the board leaves the bus
        wait_for(lambda: d.value("gpuguard_gpu_up", gpu="xtx-0") == 0.0, timeout=20, what="xtx-0 down")
        wait_for(lambda: not any(alive(p) for p in tree), timeout=20, what="the engine on xtx-0 killed")
        n = len(verified(tmp_path, "xtx-0"))
        # moved to the empty slot: new bridges, a new GPU address, the card's own identity
        assert sim.ctl("return_gpu", bdf=XTX[0], slot=SPARE_SLOT) == MOVED
        wait_for(lambda: d.value("gpuguard_gpu_up", gpu="xtx-0") == 1.0, timeout=20, what="xtx-0 up at its new address")
        again = wait_for(lambda: verified(tmp_path, "xtx-0")[n:], timeout=30, what="xtx-0 re-applied and verified")
        assert "back" in again[0]["why"], again[0]
        # read back from the card at its new address: xtx-0's own profile, not xtx-1's
        od = sim.ctl("read", path=f"/sys/bus/pci/devices/{MOVED}/pp_od_clk_voltage")
        assert "1500Mhz" in od.split("OD_SCLK:")[1].split("OD_MCLK")[0], od
        # the engine stays down (its restart command only leaves the marker): named beside 4/4
        assert wait_for(lambda: status(d)["summary"].startswith("4/4 GPUs up; engines: on-xtx0"), timeout=10,
                        what="4/4 in the summary")
        states = {g["name"]: g for g in status(d)["gpu_states"]}
        assert (states["xtx-0"]["bdf"], states["xtx-0"]["profile_state"]) == (MOVED, "verified"), states["xtx-0"]
        assert XTX[0] not in {g["bdf"] for g in states.values()}  # the old address is history
        events = __import__("httpx").get(f"{d.base}/v1/events").json()
        back = [x for x in events if x["kind"] == "gpu_back"]
        assert len(back) == 1 and back[0]["gpu"] == "xtx-0" and back[0]["bdf"] == MOVED, back
        assert XTX[0] in back[0]["message"] and MOVED in back[0]["message"], back[0]["message"]
        assert not [x for x in events if x["kind"] == "gpu_appeared"]  # it is the same card, back
        wait_for(marker.exists, timeout=20, what="the engine on xtx-0 restarted after it came back")
        assert d.value("gpuguard_gpu_up", gpu="xtx-1") == 1.0
        assert "Traceback" not in d.log.read_text()
    finally:
        e.stop()


def test_a_card_matched_by_address_does_not_follow_it_to_another_address(sim_spare_slot, start_daemon, wait_for, tmp_path):
    """A PCI address is the user's word for "this slot": a card found elsewhere is another
    card as far as the config knows; it is unnamed and never written, the slot's name stays
    missing."""
    sim = sim_spare_slot
    d = start_daemon(sim.mount, BY_INDEX)
    wait_for(lambda: verified(tmp_path, "r9700-a"), timeout=30, what="r9700-a verified at start")
    sim.ctl("lose_gpu", bdf=R9700[0])
    sim.ctl("step", dt=0.5)
    wait_for(lambda: d.value("gpuguard_gpu_up", gpu="r9700-a") == 0.0, timeout=20, what="r9700-a down")
    assert sim.ctl("return_gpu", bdf=R9700[0], slot=SPARE_SLOT) == MOVED
    stranger = MOVED
    wait_for(lambda: d.value("gpuguard_gpu_up", gpu=stranger) == 1.0, timeout=20, what="the moved card seen, unnamed")
    st = wait_for(lambda: (s := status(d)) and "missing r9700-a" in s["summary"] and s, timeout=20, what="missing")
    # four cards on the bus (the stranger among them), the configured one gone
    assert st["summary"] == "4/5 GPUs up; missing r9700-a (0000:05:00.0)", st["summary"]
    g = next(g for g in st["gpu_states"] if g["bdf"] == MOVED)
    assert (g["name"], g["named"], g["profile"]) == (stranger, False, None), g
    # polls later nothing was written to it: the stock power cap (psu-safe is 210 W), no audit record
    polled = d.value("gpuguard_last_poll_timestamp_seconds", source="gpu")
    wait_for(lambda: d.value("gpuguard_last_poll_timestamp_seconds", source="gpu") > polled + 1.0, timeout=20,
             what="polls for a second more")
    assert sim.hwmon(MOVED, "power1_cap") == sim.hwmon(MOVED, "power1_cap_default") != "210000000\n"
    assert not [r for r in profile_records(tmp_path / "state" / "audit.jsonl") if stranger in json.dumps(r) or MOVED in json.dumps(r)]
    kinds = [x["kind"] for x in __import__("httpx").get(f"{d.base}/v1/events").json()]
    assert "gpu_back" not in kinds and "gpu_appeared" in kinds
    assert "Traceback" not in d.log.read_text()


def engine_yaml(name: str, e: SimEngine, gpu: str) -> str:
    return (f"engines:\n  - {{name: {name}, kind: {e.kind}, url: \"{e.url}\", process: {{pid_file: null, cmdline: "
            f"'gpuguard.sim.engines --kind {e.kind} --port {e.port}'}}, gpus: [{gpu}], stall_after: 30, "
            "poll_interval: 0.25, http_timeout: 0.5, grace: 1, action: kill}\n")


@pytest.mark.parametrize("route", ["bus", "not_answering"])
def test_a_gpu_lost_through_the_poller_kills_the_engine_on_it(sim, start_daemon, wait_for, route):
    e = SimEngine("vllm")
    other = SimEngine("llamacpp")
    try:
        cfg = BY_INDEX + engine_yaml("on-xtx0", e, "xtx-0") + engine_yaml("on-r9700", other, "r9700-a")[len("engines:\n"):]
        if route == "not_answering":
            cfg = cfg.replace("discover_seconds: 0.5}", "discover_seconds: 0.5, lost_after_seconds: 1.5}")
        d = start_daemon(sim.mount, cfg)
        tree, spared = e.tree(), other.tree()
        wait_for(lambda: d.value("gpuguard_gpu_up", gpu="xtx-0") == 1.0, what="xtx-0 up")
        if route == "bus":
            sim.ctl("lose_gpu", bdf=XTX[0])
            sim.ctl("step", dt=0.5)  # the board leaves the bus
        else:
            # reads fail with EIO and the card stays on the bus: lost after lost_after_seconds
            sim.ctl("lose_gpu", bdf=XTX[0], steps_before_removal=10**6)
        # the bug: the event said "recovery is kill the engines", the engine kept its PID
        wait_for(lambda: not any(alive(p) for p in tree), timeout=20, what="the engine on xtx-0 killed")
        assert all(alive(p) for p in spared)  # the engine on another GPU is left alone
        events = __import__("httpx").get(f"{d.base}/v1/events").json()
        lost = [x for x in events if x["kind"] == "gpu_lost"]
        assert len(lost) == 1 and lost[0]["fields"]["route"] == route and lost[0]["gpu"] == "xtx-0"
    finally:
        e.stop()
        other.stop()


def kernel_lost_config(sim) -> str:
    """BY_INDEX with the simulated kernel log as the daemon's kernel log: `lose_gpu` reaches
    it as `device lost from bus!`, the route a real card takes."""
    return (BY_INDEX.replace("kernel: {enabled: false}\n", f"kernel: {{kmsg_path: {sim.kmsg}, udev: false}}\n")
            .replace("discover_seconds: 0.5}", "discover_seconds: 0.5, lost_after_seconds: 2}"))


def xtx1_seen(d) -> tuple[float | None, str, str]:
    """(gpu_up, presence, profile_state) of xtx-1, the metric read first: once the state
    owner says present it stays so here, so gpu_up 1 with a presence read after it that is
    not present means the two disagreed."""
    up = d.value("gpuguard_gpu_up", gpu="xtx-1")
    g = next(g for g in status(d)["gpu_states"] if g["name"] == "xtx-1")
    return up, g["presence"], g["profile_state"]


def lose_by_kernel_and_return(sim, d, tmp_path, wait_for) -> list[tuple]:
    n = len(verified(tmp_path, "xtx-1"))
    lost = len([e for e in __import__("httpx").get(f"{d.base}/v1/events").json() if e["kind"] == "gpu_lost"])
    # on the bus throughout: the reads fail with EIO, the kernel says `device lost from bus!`
    sim.ctl("lose_gpu", bdf=XTX[1], err="EIO", steps_before_removal=60)
    wait_for(lambda: len([e for e in __import__("httpx").get(f"{d.base}/v1/events").json()
                          if e["kind"] == "gpu_lost" and e["gpu"] == "xtx-1"]) > lost, timeout=30, what="xtx-1 lost")
    sim.ctl("return_gpu", bdf=XTX[1])  # power-cycled back at stock settings, never off the bus
    seen: list[tuple] = []

    def back_and_verified() -> bool:
        seen.append(xtx1_seen(d))
        return seen[-1] == (1.0, "present", "verified") and len(verified(tmp_path, "xtx-1")) > n

    # the bug: "2/4 GPUs up; down: xtx-1", profile "lost", for ever
    wait_for(back_and_verified, timeout=60, interval=0.1, what="xtx-1 back with its profile verified")
    return seen


def test_a_gpu_lost_by_a_kernel_line_comes_back_when_it_answers_with_its_profile(sim_kmsg, start_daemon, wait_for,
                                                                                 tmp_path):
    sim = sim_kmsg
    d = start_daemon(sim.mount, kernel_lost_config(sim))
    wait_for(lambda: verified(tmp_path, "xtx-1"), timeout=60, what="xtx-1 verified at start")
    seen = lose_by_kernel_and_return(sim, d, tmp_path, wait_for)
    # gpu_up said 1 while the state owner said lost: 1 only while up
    assert not [s for s in seen if s[0] == 1.0 and s[1] != "present"], seen
    assert any(s[1] == "lost" and s[0] == 0.0 for s in seen), seen  # answering, not yet for lost_after_seconds
    assert status(d)["summary"] == "4/4 GPUs up"
    # re-applied and read back from the card: xtx-2000, not the stock clock
    od = sim.ctl("read", path=f"/sys/bus/pci/devices/{XTX[1]}/pp_od_clk_voltage")
    assert "2000Mhz" in od.split("OD_SCLK:")[1].split("OD_MCLK")[0], od
    events = __import__("httpx").get(f"{d.base}/v1/events").json()
    lost = [e for e in events if e["kind"] == "gpu_lost"]
    back = [e for e in events if e["kind"] == "gpu_back"]
    assert [(e["gpu"], e["fields"]["route"]) for e in lost] == [("xtx-1", "kernel:device_lost")], lost
    assert len(back) == 1 and "answering again" in back[0]["message"], back
    assert "Traceback" not in d.log.read_text()


def test_six_quick_kernel_losses_and_returns_each_end_up(sim_kmsg, start_daemon, wait_for, tmp_path):
    """1 of 6 quick cycles stayed lost: the kernel's line was read after the card already
    answered again, and only a failed read followed by a good one brought a card back."""
    sim = sim_kmsg
    d = start_daemon(sim.mount, kernel_lost_config(sim))
    wait_for(lambda: verified(tmp_path, "xtx-1"), timeout=60, what="xtx-1 verified at start")
    for cycle in range(6):
        n = len(verified(tmp_path, "xtx-1"))
        sim.ctl("lose_gpu", bdf=XTX[1], err="EIO", steps_before_removal=60)
        sim.ctl("return_gpu", bdf=XTX[1])  # at once: the daemon may see the loss only in the kernel log
        wait_for(lambda: xtx1_seen(d) == (1.0, "present", "verified") and len(verified(tmp_path, "xtx-1")) > n,
                 timeout=60, what=f"xtx-1 back and verified after quick cycle {cycle + 1}")
    assert status(d)["summary"] == "4/4 GPUs up"
    assert "Traceback" not in d.log.read_text()
