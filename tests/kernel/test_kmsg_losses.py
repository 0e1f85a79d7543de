"""Kernel log records gpuguard never read are counted and said: a daemon paused while the
ring overwrites exports the loss on /metrics and raises a warning event with the count;
a sequence number no kernel can have is never saved as the read position, and a saved
position ahead of the log is reset with a warning instead of skipping every record."""
from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.kernel.kmsg import KmsgReader
from service.failsafe_harness import GuardProcess
from support import poll_until

# a real corrected-AER line (reference/kmsg/lines.jsonl), one record per write
AER = "<4>pcieport 0000:00:1d.0: AER: Multiple Corrected error received: id=00e8 {tag} {i}"


def _records(seqs) -> bytes:
    """Real-format /dev/kmsg records (`PRI,SEQ,USEC,FLAGS;TEXT`), one per line as a
    plain-file stand-in for the device hands them out."""
    return b"".join(f"3,{s},{1000 + s},-;amdgpu 0000:aa:00.0: record {s}\n".encode() for s in seqs)


def _record_per_read(reader: KmsgReader) -> KmsgReader:
    """A plain file standing in for /dev/kmsg, read as the device hands records out: one
    whole record per read() (the reader's seam `_os_read`); b"" at the file's end."""
    def read(fd: int, size: int) -> bytes:
        data = os.read(fd, size)
        end = data.find(b"\n") + 1
        if end:
            os.lseek(fd, end - len(data), os.SEEK_CUR)
            data = data[:end]
        return data

    reader._os_read = read
    return reader


class _Daemon(GuardProcess):
    """`gpuguard run` as a real process on an empty hardware tree, reading the real
    /dev/kmsg (user-space records allowed: the test writes them)."""

    def __init__(self, tmp: Path) -> None:
        state = tmp / "state"
        self.recording = state / "flight.sqlite"
        (tmp / "sys").mkdir()
        cfg = tmp / "gpuguard.yaml"
        cfg.write_text(
            f"state_dir: {state}\nrecorder: {{path: {self.recording}}}\n"
            "listen: {address: 127.0.0.1, port: 0}\npoll: {interval_seconds: 0.5}\n"
            "kernel: {allow_userspace: true, udev: false}\n")
        super().__init__(cfg, tmp / "sys")
        self.find_base(poll_until, timeout=60)

    def value(self, name: str, **labels) -> float | None:
        for fam in text_string_to_metric_families(httpx.get(f"{self.base}/metrics", timeout=5).text):
            for s in fam.samples:
                if s.name == name and s.labels == labels:
                    return s.value
        return None

    def recorded(self, kind: str) -> list[dict]:
        """Events of `kind` in the flight recording (the API keeps only the newest 1,000:
        the classified lines after the loss push its event out there)."""
        db = sqlite3.connect(f"file:{self.recording}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT severity, message, fields FROM events WHERE kind = ?", (kind,)).fetchall()
        finally:
            db.close()
        return [{"severity": sev, "message": msg, "fields": json.loads(f)} for sev, msg, f in rows]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process would not see SIGTERM
        return super().stop()


@pytest.mark.slow
@pytest.mark.root
def test_records_overwritten_while_the_daemon_is_stopped_are_counted_and_said(kmsg_writer, tag, tmp_path):
    d = _Daemon(tmp_path)
    try:
        lost = "gpuguard_kernel_log_records_lost_total"
        aer = {"gpu": "host", "kind": "pcie_aer_corrected"}
        before = poll_until(lambda: d.value(lost) is not None and (d.value(lost),), timeout=20,
                            what=f"{lost} on /metrics")[0]
        classified_before = d.value("gpuguard_kernel_events_total", **aer) or 0.0
        n = 3000
        d.proc.send_signal(signal.SIGSTOP)
        try:
            # 3,000 lines into a 128 KiB ring while nobody reads: most are overwritten
            kmsg_writer([AER.format(tag=tag, i=i) for i in range(n)])
        finally:
            d.proc.send_signal(signal.SIGCONT)
        kmsg_writer([AER.format(tag=tag, i="done")])

        def settled():
            got = (d.value("gpuguard_kernel_events_total", **aer) or 0.0) - classified_before
            gone = d.value(lost) - before
            return got + gone >= n + 1 and (got, gone)

        classified, gone = poll_until(settled, timeout=60, what="every line classified or counted lost")
        assert gone > 0, "nothing was overwritten: the ring holds 3,000 lines here"
        assert classified < n + 1
        assert d.value("gpuguard_kernel_log_overruns_total") >= 1
        # one warning event names the count: what the loss events say adds up to the counter
        events = poll_until(lambda: [e for e in d.recorded("kernel_log_lost")
                                     if e["fields"]["lost_total"] > before] or None,
                            timeout=20, what="the kernel_log_lost event")
        assert all(e["severity"] == "warning" for e in events)
        assert sum(e["fields"]["lost"] for e in events) == gone
        assert f"{events[0]['fields']['lost']} kernel log records" in events[0]["message"]
    finally:
        d.stop()


def test_a_sequence_number_no_kernel_can_have_is_never_saved(tmp_path, caplog):
    kmsg, state = tmp_path / "kmsg", tmp_path / "pos.json"
    kmsg.write_bytes(_records([1, 2]) + _records([10**30]) + _records([3]) + _records([10**15]))
    state.write_text(json.dumps({"seq": 0}))  # resume from the file's start
    reader = _record_per_read(KmsgReader(kmsg, state))
    reader.open()
    with caplog.at_level(logging.WARNING):
        got = reader.read_batch()
    for rec in got:
        reader.commit(rec.seq)
    reader.close()
    assert [r.seq for r in got] == [1, 2, 3]
    assert json.loads(state.read_text())["seq"] == 3
    assert reader.bad_records == 2 and reader.lost_records == 0
    assert "sequence number 1000000000000000000000000000000" in caplog.text and str(kmsg) in caplog.text


def test_a_saved_position_ahead_of_the_log_resets_with_a_warning(tmp_path, caplog):
    """The next start after such a position: every one of 98 records is read, none skipped."""
    kmsg, state = tmp_path / "kmsg", tmp_path / "pos.json"
    kmsg.write_bytes(_records(range(1, 99)))
    for saved in (10**30, 5000):  # beyond any kernel; plausible but ahead of this log
        state.write_text(json.dumps({"seq": saved}))
        caplog.clear()
        reader = _record_per_read(KmsgReader(kmsg, state))
        with caplog.at_level(logging.WARNING):
            got = []
            while (batch := reader.read_batch()) is not None:
                got += batch
        assert [r.seq for r in got] == list(range(1, 99)), saved
        assert str(saved) in caplog.text and str(state) in caplog.text
        for rec in got:
            reader.commit(rec.seq)
        reader.close()
        assert json.loads(state.read_text())["seq"] == 98


@pytest.mark.root
def test_a_saved_position_beyond_the_kernel_is_reset_on_the_real_log(kmsg_writer, tag, tmp_path, caplog):
    state = tmp_path / "pos.json"
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    state.write_text(json.dumps({"boot_id": boot, "seq": 10**30}))  # this boot, a bogus position
    kmsg_writer([f"<6>gpuguard position test {tag}"])
    reader = KmsgReader(state_file=state, allow_userspace=True)
    with caplog.at_level(logging.WARNING):
        reader.open()
        got = []
        while not any(tag in r.text for r in got):
            batch = reader.read_batch()
            assert batch is not None, "the ring was read to its end without the test's record"
            got += batch or []
    assert reader.start_mode == "new_boot"
    assert str(10**30) in caplog.text and str(state) in caplog.text
    reader.commit(got[-1].seq)
    reader.close()
    assert json.loads(state.read_text())["seq"] == got[-1].seq < 2**64
