"""Clock/voltage/power profiles: validate, apply one card at a time, read back, retry,
wait for late cards, re-apply after drift, check the clock under load, safe mode.

Modules: schema (config models), plan (writes + validation + ordering), apply (one
card: write, read back, retry), nvidia (the same through NVML), kernel_reason (EINVAL
reasons from /dev/kmsg), wait, drift, effective, safemode, ledger (state + metrics), lifecycle (`ProfileRuntime`, wired by the daemon).
"""
from gpuguard.profiles.lifecycle import ProfileRuntime

__all__ = ["ProfileRuntime"]
