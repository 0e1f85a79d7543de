"""Fixtures for the kernel-event tests: writing real records to the real /dev/kmsg."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

KMSG = "/dev/kmsg"
# printk_devkmsg=ratelimit lets one open file write 10 records per 5 s and silently drops
# the rest, so writers reopen the device well before that.
WRITES_PER_OPEN = 8


def kmsg_writable() -> str | None:
    """None when this process can write /dev/kmsg, else why not (for the skip reason)."""
    if os.geteuid() != 0:
        return "needs root to write /dev/kmsg"
    if not os.path.exists(KMSG):
        return f"{KMSG} does not exist here"
    try:
        fd = os.open(KMSG, os.O_WRONLY)
    except OSError as e:
        return f"{KMSG} not writable: {e.strerror}"
    os.close(fd)
    return None


def write_kmsg(lines: list[str] | list[bytes]) -> None:
    """Write each line as one record. Every write ends in a newline: a record without one
    stays open for continuation and readers do not see it until the next record."""
    fd = None
    try:
        for i, line in enumerate(lines):
            if i % WRITES_PER_OPEN == 0:
                if fd is not None:
                    os.close(fd)
                fd = os.open(KMSG, os.O_WRONLY)
            data = line if isinstance(line, bytes) else line.encode()
            os.write(fd, data if data.endswith(b"\n") else data + b"\n")
    finally:
        if fd is not None:
            os.close(fd)


@pytest.fixture
def kmsg_writer():
    """`write(lines)` into the real /dev/kmsg; skips the test (with the reason) when this
    process cannot write it. User-space records arrive with facility 1, so readers under
    test run with allow_userspace=True."""
    why = kmsg_writable()
    if why is not None:
        pytest.skip(why)
    return write_kmsg


@pytest.fixture
def tag() -> str:
    """A unique marker so a test finds its own records among the host's."""
    return f"gpuguard-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def kmsg_readable() -> None:
    """Skips unless /dev/kmsg can be opened for reading (dmesg_restrict needs CAP_SYSLOG)."""
    try:
        os.close(os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as e:
        pytest.skip(f"cannot read {KMSG}: {e.strerror}")


@pytest.fixture(scope="session")
def labelled(reference: Path) -> list[dict]:
    with open(reference / "kmsg" / "lines.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
