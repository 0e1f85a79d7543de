"""The `/dev/kmsg` reader: owns the record format (`PRI,SEQ,USEC,FLAGS[,…];TEXT` plus
` KEY=VALUE` dictionary lines), undoing the kernel's `\\xNN` escaping, and reading the
ring without ever blocking or wedging the event loop.

Reading rules (Documentation/ABI/testing/dev-kmsg):
- one `read()` returns one whole record; `EPIPE` means records were overwritten since the
  last read: count the gap (from the sequence numbers) and carry on;
- a fresh start seeks to the end (old lines are history, not news); the last sequence
  number handled is saved on disk (atomically, at most once a `save_interval`) together
  with the boot id, so a restart neither re-alerts old records nor misses new ones, and a
  reboot (sequence numbers restart at 0) is noticed;
- records come in bounded batches with a yield to the loop between them: a 10 000-line
  flood never freezes the poller (node-problem-detector's reader died silently under
  floods; bench/kmsg_burst.py measures it);
- records the reader never saw (overwritten in the ring while it was paused or behind) are
  counted and reported through `on_lost` with the count; no read size avoids that loss:
  the device hands out one record per read() whatever the buffer, and what the kernel
  overwrote while gpuguard was not running is gone (only `log_buf_len=` keeps more);
- a sequence number no kernel can have (above u64, or more records than the kernel can
  have logged since boot) is a malformed record: never handed out, never saved as the
  position (a bogus one made the next start skip every record of its run).
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import AsyncIterator, Callable, Mapping

from gpuguard.hw.sysfs import SysfsError, SysfsRoot
from gpuguard.hw.pci_address import normalise_bdf

log = logging.getLogger(__name__)

# CONSOLE_EXT_LOG_MAX is 8192; a buffer that is too small makes read() fail with EINVAL
# without advancing, so start above it and grow if a kernel ever sends more.
READ_SIZE = 16384
READ_SIZE_MAX = 1 << 20
BOOT_ID = "/proc/sys/kernel/random/boot_id"
SEQ_MAX = 2**64 - 1  # the kernel's record sequence number is a u64
# printk stores a record in about a microsecond at best: ten million a second since boot is
# more than any kernel logs, so a sequence number above that cannot be this kernel's.
MAX_RECORDS_PER_SECOND = 10_000_000
# a loss while the reader stays behind is reported at most this often (the counter always)
LOST_REPORT_EVERY = 30.0

_ESCAPE_RE = re.compile(rb"\\x([0-9a-fA-F]{2})")


class KmsgFormatError(ValueError):
    """A record that does not follow the /dev/kmsg format."""


class KmsgError(OSError):
    """The kernel log cannot be read (missing, no permission, device error)."""


@dataclass(frozen=True)
class KmsgRecord:
    """One kernel log record. `text` is the message with escapes undone (real newlines for
    multi-line printks); `raw_text` the message as /dev/kmsg sent it; `fields` the
    dictionary lines (`SUBSYSTEM`, `DEVICE`, …)."""

    pri: int
    facility: int
    level: int
    seq: int
    usec: int
    flags: str
    text: str
    raw_text: str
    fields: Mapping[str, str] = field(default_factory=dict)
    caller: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))

    @property
    def from_kernel(self) -> bool:
        """User space can write /dev/kmsg but never with facility 0."""
        return self.facility == 0

    @property
    def device_bdf(self) -> str | None:
        """The PCI address from the `DEVICE=+pci:dddd:bb:dd.f` dictionary line, the most
        reliable address a record can carry."""
        dev = self.fields.get("DEVICE", "")
        if dev.startswith("+pci:"):
            return normalise_bdf(dev[5:])
        return None


def unescape_kmsg(text: str | bytes) -> str:
    """Undo /dev/kmsg's escaping: every `\\xNN` becomes byte NN; the bytes are then UTF-8
    (invalid sequences become U+FFFD, never an exception)."""
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    if b"\\x" in data:
        data = _ESCAPE_RE.sub(lambda m: bytes((int(m.group(1), 16),)), data)
    return data.decode("utf-8", "replace")


def parse_record(line: bytes) -> KmsgRecord:
    """Parse one record as read from /dev/kmsg (header, `;`, text, dictionary lines).
    Unknown header fields after FLAGS are ignored except `caller=`."""
    if isinstance(line, str):
        line = line.encode("utf-8", "surrogateescape")
    head, sep, rest = line.partition(b";")
    if not sep:
        raise KmsgFormatError(f"kmsg record without ';' after the header: {line[:60]!r}")
    parts = head.split(b",")
    if len(parts) < 4:
        raise KmsgFormatError(f"kmsg header needs PRI,SEQ,USEC,FLAGS: {head[:60]!r}")
    try:
        pri, seq, usec = int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        raise KmsgFormatError(f"kmsg header fields are not numbers: {head[:60]!r}") from None
    if pri < 0 or seq < 0:
        raise KmsgFormatError(f"kmsg header has negative PRI/SEQ: {head[:60]!r}")
    if seq > SEQ_MAX:
        raise KmsgFormatError(f"kmsg sequence number {seq} is beyond the kernel's u64: {head[:60]!r}")
    flags = parts[3].decode("ascii", "replace")
    caller = None
    for extra in parts[4:]:
        if extra.startswith(b"caller="):
            caller = extra[7:].decode("ascii", "replace")
    lines = rest.split(b"\n")
    message = lines[0]
    fields: dict[str, str] = {}
    for dict_line in lines[1:]:
        if not dict_line.startswith(b" "):
            continue  # the trailing "" after the final newline
        key, eq, value = dict_line[1:].partition(b"=")
        if eq:
            fields[key.decode("ascii", "replace")] = unescape_kmsg(value)
    raw_text = message.decode("utf-8", "replace")
    return KmsgRecord(
        pri=pri, facility=pri >> 3, level=pri & 7, seq=seq, usec=usec, flags=flags,
        text=unescape_kmsg(message), raw_text=raw_text, fields=fields, caller=caller,
    )


def seq_ceiling(boottime: float | None = None) -> int:
    """The highest sequence number this kernel can have reached by now: records are
    numbered from 0 at boot, at most MAX_RECORDS_PER_SECOND of them a second."""
    up = time.clock_gettime(time.CLOCK_BOOTTIME) if boottime is None else boottime
    return min(SEQ_MAX, int((up + 1.0) * MAX_RECORDS_PER_SECOND))


def _merge_fragments(parts: list[KmsgRecord]) -> KmsgRecord:
    """Fragments of one continued line (flag `c`/`+`, older kernels) become one record."""
    first = parts[0]
    fields: dict[str, str] = {}
    for p in parts:
        fields.update(p.fields)
    return KmsgRecord(
        pri=first.pri, facility=first.facility, level=first.level, seq=first.seq,
        usec=first.usec, flags=first.flags, text="".join(p.text for p in parts),
        raw_text="".join(p.raw_text for p in parts), fields=fields, caller=first.caller,
    )


class KmsgReader:
    """Reads kernel log records from `path` (default /dev/kmsg) on the asyncio loop.

    `async for rec in reader.records()` or `await reader.run(callback)`. Counters:
    `lost_records` (sequence numbers never seen: overwritten in the ring, or logged while
    gpuguard was stopped and overwritten since), `overruns` (EPIPE returns),
    `bad_records` (malformed, or a sequence number no kernel can have), `skipped_userspace`.
    `on_lost(count)`, where set, is called with the records lost since its last call: once
    the reader has caught up, or every LOST_REPORT_EVERY seconds while it stays behind."""

    def __init__(
        self,
        path: str | os.PathLike[str] = "/dev/kmsg",
        state_file: str | os.PathLike[str] | None = None,
        allow_userspace: bool = False,
        *,
        batch: int = 256,
        save_interval: float = 1.0,
        poll_interval: float = 2.0,
        slice_seconds: float = 0.005,
        proc_root: SysfsRoot | None = None,
        max_fragments: int = 16,
    ) -> None:
        if batch < 1:
            raise ValueError("kmsg batch must be >= 1")
        self.path = os.fspath(path)
        self.state_file = Path(state_file) if state_file is not None else None
        self.allow_userspace = allow_userspace
        self.batch = batch
        self.save_interval = save_interval
        self.poll_interval = poll_interval
        self.slice_seconds = slice_seconds
        self.max_fragments = max_fragments
        self._proc = proc_root or SysfsRoot("/")
        self.lost_records = 0
        self.overruns = 0
        self.bad_records = 0
        self.skipped_userspace = 0
        self.records_read = 0
        self.last_seq: int | None = None  # last sequence number read from the ring
        self.done_seq: int | None = None  # last one handed out and handled (what is saved)
        self.start_mode = "unopened"  # "end" (fresh), "resume", "new_boot"
        self.on_lost: Callable[[int], object] | None = None
        self._lost_reported = 0
        self._lost_reported_at = -math.inf
        self._ceiling = -1  # seq_ceiling() as last computed: recomputed only when passed
        self._fd: int | None = None
        self._read_size = READ_SIZE
        self._skip_upto = -1
        self._resume_seq: int | None = None
        self._catching_up = False
        self._max_seen = -1
        self._pending: list[KmsgRecord] = []
        self._boot_id: str | None = None
        self._save_handle: asyncio.TimerHandle | None = None
        self._saved_seq: int | None = None
        self._state_warned = False
        self._save_lock = threading.Lock()
        # The one seam for tests: the ring cannot be made to overwrite on demand everywhere.
        self._os_read: Callable[[int, int], bytes] = os.read

    # ── state file ──────────────────────────────────────────────────────────────
    def _read_boot_id(self) -> str | None:
        try:
            return self._proc.read_text(BOOT_ID) or None
        except SysfsError:
            return None

    def _load_state(self) -> tuple[str | None, int] | None:
        if self.state_file is None:
            return None
        try:
            raw = self.state_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            log.warning("kernel log state file %s unreadable (%s); starting at the end of "
                        "the log", self.state_file, e)
            return None
        try:
            data = json.loads(raw)
            seq = data["seq"]
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
                raise ValueError(f"seq {seq!r} is not a non-negative integer")
            boot = data.get("boot_id")
            if not self._plausible(seq):
                # Ahead of the log is read as a reboot (see _end_catch_up); beyond any
                # kernel it cannot be a position: skipping up to it skips the whole run.
                log.warning("kernel log position %d in %s is beyond what this kernel can have "
                            "logged (at most %d records since boot): ignoring it, reading the log "
                            "from its start (the file is rewritten with the new position)",
                            seq, self.state_file, self._ceiling)
                return None, -1
            return (boot if isinstance(boot, str) else None), seq
        except (ValueError, KeyError, TypeError) as e:
            log.warning("kernel log state file %s is not gpuguard's JSON {boot_id, seq} (%s); "
                        "starting at the end of the log (the file is rewritten with the new position)",
                        self.state_file, e)
            return None

    def save_state(self) -> None:
        """Write the last handled sequence number atomically (tmp file, fsync, rename)."""
        self._save_handle = None
        with self._save_lock:
            self._save_locked()

    def _save_locked(self) -> None:
        seq = self.done_seq  # the loop thread may move it on while this thread writes
        if self.state_file is None or seq is None or seq == self._saved_seq:
            return
        data = json.dumps({"boot_id": self._boot_id, "seq": seq}).encode()
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.state_file)
            self._saved_seq = seq
        except OSError as e:
            if not self._state_warned:
                log.warning("cannot save kernel log position to %s (%s): a restart may "
                            "re-report or skip lines; fix kernel.state_file", self.state_file, e)
                self._state_warned = True

    def commit(self, seq: int) -> None:
        """Record `seq` as handled and save the position now, synchronously. Called just
        before an alert about record `seq` is queued: with the 1 s save interval alone, a
        SIGKILL right after an alert re-alerted that line on the next start."""
        if self.done_seq is None or seq > self.done_seq:
            self.done_seq = seq
        with self._save_lock:
            self._save_locked()

    def _schedule_save(self) -> None:
        if self.state_file is None or self._save_handle is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.save_state()
            return
        # fsync may stall on a slow disk: save from a worker thread, never on the loop.
        self._save_handle = loop.call_later(
            self.save_interval, lambda: loop.run_in_executor(None, self.save_state))

    # ── opening ─────────────────────────────────────────────────────────────────
    def open(self) -> None:
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KmsgError(errno.ENOENT, f"kernel log {self.path} not found; set "
                            "kernel.kmsg_path or disable the kernel source") from None
        except PermissionError:
            raise KmsgError(errno.EACCES, f"kernel log {self.path}: permission denied; run "
                            "gpuguard as root or with CAP_SYSLOG") from None
        except OSError as e:
            raise KmsgError(e.errno, f"kernel log {self.path}: {e.strerror}") from None
        self._fd = fd
        self._boot_id = self._read_boot_id()
        state = self._load_state()
        if state is None:
            self.start_mode = "end"
            self._seek(os.SEEK_END)
            # the newest record's number: without it an overrun before the first record
            # read was not counted (a daemon paused right after its start lost 2,288 unsaid)
            self.last_seq = self._newest_seq()
            return
        saved_boot, seq = state
        if seq < 0 or (saved_boot and self._boot_id and saved_boot != self._boot_id):
            # A reboot: sequence numbers restarted, everything in the ring is new to us.
            self.start_mode = "new_boot"
            self._seek(os.SEEK_SET)
            self.last_seq = -1
            return
        self.start_mode = "resume"
        self._seek(os.SEEK_SET)
        self._skip_upto = seq
        self._resume_seq = seq
        self.last_seq = seq
        self.done_seq = self._saved_seq = seq
        self._catching_up = True

    def _newest_seq(self) -> int | None:
        """The sequence number of the newest record in the ring, read on a second fd (the
        device only: a FIFO standing in would lose what this read takes). Records logged
        meanwhile are also read by the reader's own fd, so none is missed or miscounted."""
        try:
            if not stat.S_ISCHR(os.stat(self.path).st_mode):
                return None
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        newest = None
        try:
            while True:
                try:
                    data = os.read(fd, self._read_size)
                except BrokenPipeError:
                    continue
                except InterruptedError:
                    continue
                except OSError:
                    break  # EAGAIN: the end
                if not data:
                    break
                head = data.split(b",", 2)
                if len(head) > 2 and head[1].isdigit() and self._plausible(int(head[1])):
                    newest = int(head[1])
        finally:
            os.close(fd)
        return newest

    def _seek(self, whence: int) -> None:
        assert self._fd is not None
        try:
            os.lseek(self._fd, 0, whence)
        except OSError as e:
            # A FIFO or plain file standing in for /dev/kmsg cannot seek: read from here.
            if e.errno not in (errno.ESPIPE, errno.EINVAL):
                raise KmsgError(e.errno, f"kernel log {self.path}: seek failed: {e.strerror}") from None

    def close(self) -> None:
        if self._save_handle is not None:
            self._save_handle.cancel()
            self._save_handle = None
        self.save_state()
        if self._fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._fd)
            except (RuntimeError, ValueError):
                pass
            os.close(self._fd)
            self._fd = None

    def fileno(self) -> int | None:
        return self._fd

    # ── reading ─────────────────────────────────────────────────────────────────
    def read_batch(self) -> list[KmsgRecord] | None:
        """Up to `batch` new records without blocking; None when the ring has nothing new
        (EAGAIN), possibly [] when a batch held only skipped records."""
        if self._fd is None:
            self.open()
        out: list[KmsgRecord] = []
        for _ in range(self.batch):
            try:
                data = self._os_read(self._fd, self._read_size)  # type: ignore[arg-type]
            except BlockingIOError:
                self._flush_pending(out)
                if self._end_catch_up():
                    return out  # re-reading the ring from its start
                return out or None
            except BrokenPipeError:
                # Overwritten while we were behind; the next read gives the oldest record
                # still there and the sequence gap says how many we lost.
                self.overruns += 1
                continue
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.EINVAL and self._read_size < READ_SIZE_MAX:
                    self._read_size *= 2  # a record larger than the buffer is not consumed
                    continue
                raise KmsgError(e.errno, f"kernel log {self.path}: read failed: {e.strerror}") from None
            if not data:  # a plain file standing in for the device: end of it
                self._flush_pending(out)
                if self._end_catch_up():
                    return out
                return out or None
            self._take(data, out)
        return out

    def _take(self, data: bytes, out: list[KmsgRecord]) -> None:
        try:
            rec = parse_record(data)
        except KmsgFormatError as e:
            self.bad_records += 1
            if self.bad_records <= 5 or self.bad_records % 1000 == 0:
                log.warning("kernel log %s: skipped a malformed record (%d so far): %s",
                            self.path, self.bad_records, e)
            return
        if not self._plausible(rec.seq):
            self.bad_records += 1
            log.warning("kernel log %s: skipped a record with sequence number %d: more than this "
                        "kernel can have logged since boot (at most %d); not saved as the position",
                        self.path, rec.seq, self._ceiling)
            return
        self.records_read += 1
        self._max_seen = max(self._max_seen, rec.seq)
        if rec.seq <= self._skip_upto:
            return  # handled before the restart
        if self.last_seq is not None and rec.seq > self.last_seq + 1:
            self.lost_records += rec.seq - self.last_seq - 1
        if self.last_seq is None or rec.seq > self.last_seq:
            self.last_seq = rec.seq
        if not rec.from_kernel and not self.allow_userspace:
            self.skipped_userspace += 1
            return
        if rec.flags in ("c", "+"):
            # Older kernels hand a continued line over in fragments: one run, one record.
            if len(self._pending) >= self.max_fragments:
                self._flush_pending(out)
            self._pending.append(rec)
            return
        self._flush_pending(out)
        out.append(rec)

    def _plausible(self, seq: int) -> bool:
        if seq <= self._ceiling:
            return True
        self._ceiling = seq_ceiling()  # uptime grew since the last look
        return seq <= self._ceiling

    def _report_lost(self, caught_up: bool) -> None:
        new = self.lost_records - self._lost_reported
        if new <= 0 or self.on_lost is None:
            return
        now = time.monotonic()
        if not caught_up and now - self._lost_reported_at < LOST_REPORT_EVERY:
            return  # still behind a flood: one report for its losses, not one per gap
        self._lost_reported, self._lost_reported_at = self.lost_records, now
        try:
            self.on_lost(new)
        except Exception:  # noqa: BLE001 - a bad consumer must not stop the reader
            log.exception("kernel log loss consumer failed")  # pragma: no mutate

    def _flush_pending(self, out: list[KmsgRecord]) -> None:
        if self._pending:
            out.append(_merge_fragments(self._pending) if len(self._pending) > 1 else self._pending[0])
            self._pending = []

    def _end_catch_up(self) -> bool:
        """At the first EAGAIN after a resume: True when the saved position turned out to
        be from another boot and the ring is being read again from its start."""
        if not self._catching_up:
            return False
        self._catching_up = False
        if self._resume_seq is not None and 0 <= self._max_seen < self._resume_seq:
            # The saved position is ahead of everything in the ring: it belongs to another
            # boot (no boot id told us). Read the ring again from its start.
            log.warning("kernel log position %d in %s is newer than the log (newest %d): "
                        "assuming a reboot, reading the log from its start",
                        self._resume_seq, self.state_file, self._max_seen)
            self._skip_upto = -1
            self.last_seq = -1
            self.start_mode = "new_boot"
            self.done_seq = self._saved_seq = None
            self._seek(os.SEEK_SET)
            return True
        return False

    def _mark_done(self, seq: int) -> None:
        if self.done_seq is None or seq > self.done_seq:
            self.done_seq = seq
            self._schedule_save()

    def _done_upto(self) -> int | None:
        """Everything read so far is handled, except fragments still waiting for the rest."""
        if self._pending:
            return self._pending[0].seq - 1
        return self.last_seq

    async def _wait_readable(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = self._fd
        assert fd is not None

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, ready)
        # printk wakes /dev/kmsg pollers from deferred irq_work; a read attempt every
        # `poll_interval` bounds the delay should a wakeup ever be missed (the fd is
        # non-blocking, so an empty attempt costs one syscall). 2 s, not less: each
        # attempt is a wakeup of an otherwise idle daemon, for a wakeup never seen missed;
        # on a whole second, where the poll and the power sampler wake the daemon anyway
        # (hw/power_sampler.on_grid)
        when = loop.time() + self.poll_interval
        timer = loop.call_at(math.floor(when) if self.poll_interval >= 1.0 else when, ready)
        try:
            await fut
        finally:
            timer.cancel()
            loop.remove_reader(fd)

    async def records(self) -> AsyncIterator[KmsgRecord]:
        """New records as they arrive, forever. Yields to the loop after every batch."""
        self.open()
        try:
            while True:
                batch = self.read_batch()
                if batch is None:
                    upto = self._done_upto()
                    if upto is not None and upto >= 0:
                        self._mark_done(upto)
                    self._report_lost(caught_up=True)
                    await self._wait_readable()
                    continue
                self._report_lost(caught_up=False)
                slice_start = time.monotonic()
                for rec in batch:
                    yield rec
                    self._mark_done(rec.seq)
                    if time.monotonic() - slice_start > self.slice_seconds:
                        # The consumer's work counts too: hand the loop back mid-batch.
                        await asyncio.sleep(0)
                        slice_start = time.monotonic()
                upto = self._done_upto()
                if upto is not None and upto >= 0:
                    self._mark_done(upto)  # skipped user-space records count as handled
                # INCIDENTS §1 / NPD: a flood must not starve the poller. Hand the loop
                # back between batches even when more records are waiting.
                await asyncio.sleep(0)
        finally:
            self.close()

    async def run(self, callback: Callable[[KmsgRecord], object]) -> None:
        """Call `callback(record)` for every new record (exceptions are logged, not fatal)."""
        async for rec in self.records():
            try:
                result = callback(rec)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 - a bad consumer must not stop the reader
                log.exception("kernel log consumer failed on record %d", rec.seq)

    def stats(self) -> dict[str, int | str | None]:
        return {
            "records_read": self.records_read, "lost_records": self.lost_records,
            "overruns": self.overruns, "bad_records": self.bad_records,
            "skipped_userspace": self.skipped_userspace, "last_seq": self.last_seq,
            "done_seq": self.done_seq, "start_mode": self.start_mode,
        }
