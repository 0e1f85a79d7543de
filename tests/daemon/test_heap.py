"""gpuguard.heap: a large block freed and allocated again is still mmapped, not carved from
the heap whose top then stays in the RSS (issue 15). Each case in a fresh interpreter: this
one's allocator has long since moved its threshold."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

if platform.libc_ver()[0] != "glibc":
    pytest.skip("glibc's mallopt and mallinfo2 are what this checks; this host's C library is another",
                allow_module_level=True)

PROBE = textwrap.dedent("""
    import ctypes, sys
    from gpuguard.heap import return_large_blocks
    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    fixed = return_large_blocks() if sys.argv[1] == "fixed" else None
    first = bytearray(400_000)  # a scrape body at 32 GPUs, mmapped
    del first                   # freed: glibc's default raises its threshold to 400 KB
    before = libc.mallinfo2().hblks
    second = bytearray(300_000)
    print(fixed, libc.mallinfo2().hblks - before)  # mmapped blocks it added
""")


def probe(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_glibcs_default_carves_the_next_large_block_from_the_heap():
    assert probe("default") == ["None", "0"]


def test_with_the_threshold_fixed_the_next_large_block_is_mmapped_again():
    assert probe("fixed") == ["True", "1"]
