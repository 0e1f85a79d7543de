"""gpuguard: keeps GPU inference hosts alive (telemetry, PCIe, profiles, watchdog)."""

__version__ = "0.1.0"
