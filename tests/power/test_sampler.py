"""The fast power sampler against the simulated amdgpu driver (in process, real errno):
which sensor it reads, the per-interval statistics, and every fault — EIO from a lost
card, garbage, a vanished file, a wedged read — as a named error, never a zero, never
stopping the other GPUs. Plus its CPU budget."""
from __future__ import annotations

import errno
import threading
import time
from types import SimpleNamespace

import pytest

from gpuguard.hw import power_sampler
from gpuguard.hw.power_sampler import PowerChannel, PowerSampler, p99
from gpuguard.hw.power_sources import amdgpu_channel
from gpuguard.sim.cards import R9700 as R9700_MODEL, with_changes
from gpuguard.sim.host import SimHost
from gpuguard.sim.topology import single_gpu_spec
from support import poll_until

A, B = "0000:05:00.0", "0000:08:00.0"


def channel(root, host, bdf, name):
    return amdgpu_channel(root, SimpleNamespace(bdf=bdf, hwmon_path=host.hwmon_path(bdf)), name)


@pytest.fixture
def two(sim_root):
    host = SimHost.incident(seed=9, xtx=False)
    host.set_load(A, 1.0)
    for _ in range(20):
        host.step(0.5)
    root = sim_root(host)
    sampler = PowerSampler(hz=50, cpu_budget_ratio=0.5)
    yield SimpleNamespace(host=host, root=root, sampler=sampler,
                          channels=[channel(root, host, A, "a"), channel(root, host, B, "b")])
    host.release_all()
    sampler.close()


def samples(sampler, gpu, n=5):
    poll_until(lambda: sampler.samplers[gpu].samples_total >= n, timeout=30, what=f"{n} samples of {gpu}")


def test_p99_is_nearest_rank():
    assert p99([1.0, 2.0, 3.0]) == 3.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0


def test_r9700_has_only_power1_average_and_says_so(two):
    a = two.channels[0]
    assert a.source == "power1_average" and a.where.endswith("/power1_average")
    assert a.read() == int(two.host.read(a.where)) / 1e6


def test_power1_input_is_preferred_where_the_card_has_it(sim_root):
    host = SimHost(single_gpu_spec(with_changes(R9700_MODEL, has_power_input=True), 0x03, "6.14", 16.0, 16))
    bdf = host.gpus[0]
    ch = channel(sim_root(host), host, bdf, "x")
    assert ch.source == "power1_input"


def test_window_statistics_follow_the_samples(two):
    s = two.sampler
    s.sync(two.channels)
    samples(s, "a", 10)
    samples(s, "b", 10)
    w = s.take_windows()
    a, b = w["a"], w["b"]
    assert a.samples >= 10 and a.errors == 0 and a.source == "power1_average"
    assert a.peak_w >= a.p99_w >= a.mean_w > 100          # loaded R9700
    assert b.mean_w < 40                                  # idle card
    # a new window starts empty: the next take has only newer samples
    nxt = s.take_windows()["a"]
    assert nxt.start >= a.end


def test_lost_card_gives_named_errors_and_the_other_keeps_sampling(two):
    s = two.sampler
    s.sync(two.channels)
    samples(s, "a")
    two.host.lose_gpu(A, errno.EIO, steps_before_removal=100)
    poll_until(lambda: s.samplers["a"].errors_total >= 3, timeout=30, what="EIO samples")
    s.take_windows()   # a read in flight at the loss is done by now: the next window is all errors
    errors = s.samplers["a"].errors_total
    poll_until(lambda: s.samplers["a"].errors_total >= errors + 2, timeout=30, what="more EIO samples")
    before_b = s.samplers["b"].samples_total
    samples(s, "b", before_b + 3)
    w = s.take_windows()
    assert w["a"].peak_w is None and w["a"].mean_w is None   # absent, never a zero
    assert "power1_average" in w["a"].last_error and "EIO" in w["a"].last_error
    assert w["b"].samples >= 1 and w["b"].errors == 0


def test_garbage_is_an_error_naming_the_file(two):
    s = two.sampler
    two.host.garbage(A, "power1_average", "xyz\n")
    s.sync(two.channels[:1])
    poll_until(lambda: s.samplers["a"].errors_total >= 2, timeout=30, what="garbage errors")
    w = s.take_windows()["a"]
    assert w.samples == 0 and "power1_average" in w.last_error and "xyz" in w.last_error


def test_vanished_hwmon_file_is_enoent_then_a_new_channel_reads_again(two):
    s = two.sampler
    s.sync(two.channels[:1])
    samples(s, "a")
    two.host.renumber_hwmon()                     # hwmon index changes, old path is gone
    poll_until(lambda: s.samplers["a"].errors_total >= 2, timeout=30, what="ENOENT errors")
    assert "ENOENT" in s.take_windows()["a"].last_error
    s.sync([channel(two.root, two.host, A, "a")])  # the poller's rediscovery gives a new path
    samples(s, "a")
    assert s.take_windows()["a"].samples >= 1


def test_a_wedged_read_blocks_only_its_own_gpu(two, caplog):
    """One thread reads both cards; A's read never returns. The next interval (the poll
    cycle takes windows every second) moves B to a new thread, and B samples on while A
    stays absent — never a zero."""
    s = two.sampler
    two.host.block(A, "power1_average")
    s.sync(two.channels)
    poll_until(lambda: s.samplers["a"].driver.reading is s.samplers["a"], timeout=30, what="A's read to hang")
    stuck_thread = s.samplers["a"].thread
    got = {"a": 0, "b": 0}

    def interval() -> bool:
        for gpu, w in s.take_windows().items():
            got[gpu] += w.samples
            if gpu == "a":
                assert w.peak_w is None and w.mean_w is None
        return got["b"] >= 20

    poll_until(interval, timeout=30, interval=0.2, what="20 samples of b in its windows")
    assert got["a"] == 0 and s.samplers["a"].samples_total == 0
    assert s.samplers["b"].thread is not stuck_thread and s.samplers["a"].thread is stuck_thread
    assert any("gpu=a" in r.getMessage() and "has not returned" in r.getMessage() for r in caplog.records)


def test_sync_stops_sampling_a_gpu_that_is_gone_and_the_thread_ends_with_the_last(two):
    s = two.sampler
    s.sync(two.channels)
    samples(s, "b")
    gone = s.samplers["b"]
    thread = gone.thread
    s.sync(two.channels[:1])
    assert "b" not in s.samplers
    frozen = gone.samples_total + 1  # a read in flight at the sync may still land
    samples(s, "a", s.samplers["a"].samples_total + 5)
    assert gone.samples_total <= frozen
    s.sync([])
    thread.join(5)
    assert not thread.is_alive()


def test_over_budget_sampler_lowers_its_rate(monkeypatch):
    """A read that costs far more CPU than the budget allows halves the rate."""
    monkeypatch.setattr(power_sampler, "BUDGET_CHECK_S", 0.5)

    def expensive() -> float:
        t = time.thread_time()
        while time.thread_time() - t < 0.004:   # 4 ms of CPU per sample: 20 % at 50 Hz
            pass
        return 1.0

    s = PowerSampler(hz=50, cpu_budget_ratio=0.02)
    try:
        s.sync([PowerChannel("x", "-", "test", "a CPU-hungry read", expensive)])
        poll_until(lambda: s.samplers["x"].hz < 50, timeout=30, what="the rate to drop")
        assert s.samplers["x"].hz >= power_sampler.MIN_HZ
        assert s.samplers["x"].cpu_seconds > 0
    finally:
        s.close()


def test_a_window_nobody_takes_stays_bounded_but_keeps_its_peak(monkeypatch):
    monkeypatch.setattr(power_sampler, "MAX_WINDOW_SAMPLES", 5)
    values = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 99.0] + [7.0] * 10_000)
    s = PowerSampler(hz=100, cpu_budget_ratio=1.0)
    try:
        s.sync([PowerChannel("x", "-", "test", "a counter", lambda: next(values))])
        poll_until(lambda: s.samplers["x"].samples_total >= 10, timeout=30, what="10 samples")
        s.samplers["x"].stop()
        s.samplers["x"].thread.join(5)
        w = s.take_windows()["x"]
    finally:
        s.close()
    assert w.samples >= 10 and w.peak_w == 99.0       # every sample counted, the peak exact
    assert w.mean_w == 3.0                            # statistics of the first 5 kept
    assert len(s.samplers["x"]._values) == 0


def test_a_stopped_gpu_lets_go_of_its_file_on_its_reading_thread(two):
    """The held power1_average of a GPU that is gone is closed by the thread that read it
    (a lost card must not keep an fd of a removed device for the daemon's life)."""
    closed: list[str] = []
    chans = [PowerChannel(c.gpu, c.bdf, c.source, c.where, c.read,
                          close=lambda g=c.gpu: closed.append((g, threading.current_thread().name)))
             for c in two.channels]
    s = two.sampler
    s.sync(chans)
    samples(s, "b")
    reader = s.samplers["b"].thread.name
    s.sync(chans[:1])
    poll_until(lambda: closed, timeout=10, what="the file of b to be closed")
    assert closed == [("b", reader)]
    s.sync([])
    poll_until(lambda: len(closed) == 2, timeout=10, what="the file of a to be closed")
    assert closed[1][0] == "a"


def test_on_grid_is_the_next_multiple_of_the_period():
    assert power_sampler.on_grid(10.0, 0.05) == pytest.approx(10.05)
    assert power_sampler.on_grid(10.049, 0.05) == pytest.approx(10.05)
    assert power_sampler.on_grid(1234.5, 1.0) == 1235.0
    assert power_sampler.on_grid(1234.0, 1.0) == 1235.0   # after now, never now


def test_ticks_fall_on_multiples_of_the_period():
    """Every wakeup of the sampler is on the period's grid of the monotonic clock, where the
    poll's once-a-second work lands too (poller.py): one wakeup serves both."""
    ticks: list[float] = []

    def read() -> float:
        ticks.append(time.monotonic())
        return 1.0

    s = PowerSampler(hz=20, cpu_budget_ratio=1.0)
    try:
        s.sync([PowerChannel("x", "-", "test", "a clock", read)])
        poll_until(lambda: len(ticks) >= 30, timeout=30, what="30 ticks")
    finally:
        s.close()
    phases = sorted((t % 0.05) for t in ticks[1:])   # the first read is at the start, not a tick
    # a wakeup comes a little after its deadline, never before; most within 15 ms even on
    # a loaded machine (a grid off by half a period would put the median at 25 ms)
    assert phases[len(phases) // 2] < 0.015, phases


def test_no_sample_is_lost_when_windows_are_taken_while_it_reads():
    """Windows take the samples counted so far off the front of the list the reading thread
    appends to, without a lock:
    every sample read lands in exactly one window."""
    n = iter(range(1, 10**9))
    s = PowerSampler(hz=100, cpu_budget_ratio=1.0)
    windows = []
    try:
        s.sync([PowerChannel("x", "-", "test", "a counter", lambda: float(next(n)))])
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            windows.append(s.take_windows()["x"])
        s.samplers["x"].stop()
        s.samplers["x"].thread.join(5)
        windows.append(s.take_windows()["x"])
        total = s.samplers["x"].samples_total
    finally:
        s.close()
    assert total > 50
    assert sum(w.samples for w in windows) == total
    means = [w for w in windows if w.samples]
    # the counter's values are consecutive: the windows' sums add up to 1 + 2 + ... + total
    assert round(sum(w.mean_w * w.samples for w in means)) == total * (total + 1) // 2


def test_a_host_at_rest_is_read_once_a_second_and_work_brings_the_full_rate_back():
    """Every GPU under its rest line for `rest_after_s`: one tick a second, on the whole
    second (the poll's wakeup), instead of 20 — an idle inference host pays ~nothing for
    the sampler (issue 15). The first reading over the line brings the full rate back."""
    watts = {"x": 10.0}
    ticks: list[tuple[float, float]] = []

    def read() -> float:
        ticks.append((time.monotonic(), watts["x"]))
        return watts["x"]

    s = PowerSampler(hz=20, cpu_budget_ratio=1.0, rest_after_s=0.3)
    try:
        s.set_rest_lines({"x": 50.0})
        s.sync([PowerChannel("x", "-", "test", "a dial", read)])
        poll_until(lambda: s.samplers["x"].hz == power_sampler.REST_HZ, timeout=10, what="the rest rate")
        n = len(ticks)
        poll_until(lambda: len(ticks) >= n + 3, timeout=10, what="three ticks at rest")
        rest = [t for t, _ in ticks[n:n + 3]]
        assert all(b - a >= 0.9 for a, b in zip(rest, rest[1:])), rest
        assert all(t % 1.0 < 0.015 for t in rest[1:]), rest      # on the whole second
        assert s.take_windows()["x"].hz == power_sampler.REST_HZ
        watts["x"] = 200.0
        poll_until(lambda: s.samplers["x"].hz == 20, timeout=5, what="the full rate back")
        m = len(ticks)
        poll_until(lambda: len(ticks) >= m + 10, timeout=5, what="ten fast ticks")
        fast = [t for t, _ in ticks[m:m + 10]]
        assert max(b - a for a, b in zip(fast, fast[1:])) < 0.5, fast
    finally:
        s.close()


def test_a_gpu_without_a_rest_line_keeps_the_full_rate():
    """No cap known (no line), or one GPU working while the other rests: full rate."""
    values = {"idle": 10.0, "busy": 300.0}
    s = PowerSampler(hz=20, cpu_budget_ratio=1.0, rest_after_s=0.2)
    try:
        s.set_rest_lines({"idle": 50.0, "busy": 50.0})
        s.sync([PowerChannel(g, "-", "test", g, lambda g=g: values[g]) for g in values])
        poll_until(lambda: s.samplers["idle"].samples_total >= 20, timeout=10, what="20 samples")
        assert s.samplers["idle"].hz == 20          # its neighbour works: one thread, one rate
        values["busy"] = 10.0
        poll_until(lambda: s.samplers["idle"].hz == power_sampler.REST_HZ, timeout=10, what="rest")
        s.set_rest_lines({"idle": 50.0})            # the other's cap unknown now
        poll_until(lambda: s.samplers["idle"].hz == 20, timeout=5, what="the full rate back")
    finally:
        s.close()


def test_a_gpu_that_joins_a_resting_thread_reports_the_rate_it_is_read_at():
    s = PowerSampler(hz=20, cpu_budget_ratio=1.0, rest_after_s=0.2)
    try:
        s.set_rest_lines({"x": 50.0, "y": 50.0})
        s.sync([PowerChannel("x", "-", "test", "x", lambda: 10.0)])
        poll_until(lambda: s.samplers["x"].hz == power_sampler.REST_HZ, timeout=10, what="rest")
        s.sync([PowerChannel("x", "-", "test", "x", lambda: 10.0), PowerChannel("y", "-", "test", "y", lambda: 10.0)])
        assert s.samplers["y"].hz == s.samplers["x"].hz      # one thread, one rate, said by both
        poll_until(lambda: s.samplers["y"].samples_total >= 1, timeout=10, what="y read")
        poll_until(lambda: s.samplers["y"].hz == s.samplers["x"].hz == power_sampler.REST_HZ, timeout=10,
                   what="both at rest")
    finally:
        s.close()
