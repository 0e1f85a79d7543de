"""Saved kernel logs: turns the text of `dmesg`, `dmesg -T`/`-x`/`-r`/`--time-format iso`,
`journalctl -k` (short, short-iso, short-precise, short-monotonic), syslog files and raw
/dev/kmsg dumps back into kernel messages, so "what happened last night" can be asked of an
old log (`gpuguard events classify FILE`).

Each entry is one kernel message: prefixes are stripped (they stack: syslog's, then the
kernel's `[  312.52]`, then `[ T291]` caller ids), dictionary lines of raw records are
attached to their record, and continuation lines of multi-line messages (unprefixed, or
indented by journalctl) are joined with a newline, as /dev/kmsg carries them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from gpuguard.kernel.kmsg import KmsgFormatError, KmsgRecord, parse_record

_MON = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
# journalctl/rsyslog write `.123456`, dmesg --time-format iso writes `,123456`: that
# comma is what tells the host-less dmesg form apart.
_ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_ISO_DMESG = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d+(?:Z|[+-]\d\d:?\d\d)?"
_IDENT = r"(?P<ident>[^\s:\[]+)(?:\[\d+\])?:(?: |$)"

# (format name, regex). Order matters: the host/ident forms before the bare stamps.
_PREFIXES: list[tuple[str, re.Pattern[str]]] = [
    ("syslog", re.compile(rf"^(?:<\d{{1,3}}>\d? ?)?(?P<stamp>{_MON} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?) (?P<host>\S+) {_IDENT}")),
    ("syslog-iso", re.compile(rf"^(?:<\d{{1,3}}>\d? ?)?(?P<stamp>{_ISO}) (?P<host>\S+) {_IDENT}")),
    ("journal-monotonic", re.compile(r"^(?P<stamp>\[\s*\d+\.\d+\]) (?P<host>\S+) (?P<ident>kernel): ?")),
    ("dmesg-iso", re.compile(rf"^(?P<stamp>{_ISO_DMESG}) ")),
    ("dmesg-T", re.compile(rf"^(?P<stamp>\[{_DAY} {_MON} [ \d]\d \d\d:\d\d:\d\d \d{{4}}\]) ?")),
    ("dmesg-x", re.compile(r"^(?P<stamp>)(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local\d)\s*:\s*(?:emerg|alert|crit|err|warn|notice|info|debug)\s*: ")),
    ("dmesg-r", re.compile(r"^(?P<stamp>)<\d{1,3}>(?=\S|\[)")),
    ("dmesg", re.compile(r"^(?P<stamp>\[\s*\d+\.\d+\]) ?")),
    ("caller", re.compile(r"^(?P<stamp>)\[\s*[TC]\d+\] ?")),
]
_RAW_RE = re.compile(rb"^\d+,\d+,\d+,[^;]*;")


@dataclass(frozen=True)
class LogEntry:
    """One kernel message from a saved log. `line_no` is its first line (1-based);
    `stamp` the first timestamp as written (None when the line had none); `record` the
    parsed record for raw /dev/kmsg lines (it carries the DEVICE= address)."""

    line_no: int
    text: str
    stamp: str | None
    format: str
    record: KmsgRecord | None = None


def strip_prefixes(line: str) -> tuple[str, str | None, str | None, str | None]:
    """(message text, first stamp, outermost format name, syslog ident) of one line."""
    stamp: str | None = None
    fmt: str | None = None
    ident: str | None = None
    for _ in range(4):  # prefixes stack: syslog, then dmesg stamp, then caller id
        for name, regex in _PREFIXES:
            m = regex.match(line)
            if m is None:
                continue
            if stamp is None and m.group("stamp"):
                stamp = m.group("stamp")
            if fmt is None:
                fmt = name
            if ident is None and "ident" in regex.groupindex:
                ident = m.group("ident")
            line = line[m.end():]
            break
        else:
            break
    return line, stamp, fmt, ident


def parse_saved_log(lines: Iterable[str | bytes]) -> Iterator[LogEntry]:
    """Kernel messages from the lines of a saved log. Lines of other programs in a syslog
    file (ident not `kernel`) are skipped."""
    current: dict | None = None
    seen_prefix = False

    def finish(entry: dict | None) -> Iterator[LogEntry]:
        if entry is None:
            return
        if entry["raw"] is not None:
            try:
                record = parse_record(b"\n".join(entry["raw"]) + b"\n")
            except KmsgFormatError:
                record = None
            if record is not None:
                yield LogEntry(entry["line_no"], record.text, entry["stamp"], "kmsg", record)
                return
        yield LogEntry(entry["line_no"], "\n".join(entry["text"]), entry["stamp"], entry["format"])

    for no, line in enumerate(lines, 1):
        raw = line if isinstance(line, bytes) else line.encode("utf-8", "surrogateescape")
        raw = raw.rstrip(b"\r\n")
        if not raw.strip():
            continue
        if _RAW_RE.match(raw):
            yield from finish(current)
            seen_prefix = True
            current = {"line_no": no, "raw": [raw], "text": [], "stamp": raw.split(b";", 1)[0].decode(), "format": "kmsg"}
            continue
        if current is not None and current["raw"] is not None and raw.startswith(b" "):
            current["raw"].append(raw)  # a dictionary line (` DEVICE=+pci:…`)
            continue
        text = raw.decode("utf-8", "replace")
        msg, stamp, fmt, ident = strip_prefixes(text)
        if fmt is None:
            # Unprefixed (dmesg) or indented (journalctl) continuation of a multi-line
            # message, when the log has prefixes at all; else a plain one-message line.
            if current is not None and seen_prefix and current["raw"] is None:
                current["text"].append(text.strip())
                continue
            yield from finish(current)
            current = {"line_no": no, "raw": None, "text": [text], "stamp": None, "format": "plain"}
            continue
        seen_prefix = True
        if ident is not None and ident != "kernel":
            yield from finish(current)
            current = None
            continue
        if (current is not None and current["raw"] is None and stamp and stamp == current["stamp"]
                and msg.startswith("NVRM:") and current["text"][0].startswith("NVRM: The NVIDIA GPU ")
                and len(current["text"]) < 5 and not current["text"][-1].rstrip().endswith(".")):
            # syslog splits NVRM's multi-line record ("The NVIDIA GPU <bdf>" / "… has" /
            # "fallen off the bus …") into lines with one stamp: put it back together.
            current["text"].append(msg)
            continue
        yield from finish(current)
        current = {"line_no": no, "raw": None, "text": [msg], "stamp": stamp, "format": fmt}
    yield from finish(current)
