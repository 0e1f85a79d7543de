"""Logging to stderr in a journald-friendly form: one line per event, key=value fields.
Under systemd (JOURNAL_STREAM set) each line starts with the syslog priority `<N>`, so
journald stores the right level without a separate library."""
from __future__ import annotations

import logging
import os
import sys

_PRIO = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class KeyValueFormatter(logging.Formatter):
    def __init__(self, journald: bool) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage().replace("\n", " | ")
        line = f"level={record.levelname.lower()} logger={record.name} {msg}"
        if record.exc_info:
            # One line: the reason, never a multi-line traceback in the journal.
            line += f" error={type(record.exc_info[1]).__name__}:{record.exc_info[1]}"
        if self.journald:
            line = f"<{_PRIO.get(record.levelno, 6)}>{line}"
        return line


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(journald=bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: the engine probes would fill the journal
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
