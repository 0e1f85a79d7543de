"""`gpuguard doctor --config FILE`: whether each configured engine is open to the network
without an API key (INCIDENTS §10). Finds the engine's processes and their listening
sockets in /proc, asks each socket bound beyond loopback over loopback (engines/exposure.py)
and gives one verdict per socket. Sends nothing to any other address; writes nothing."""
from __future__ import annotations

import asyncio
from typing import Any, Iterable

from gpuguard.engines.exposure import Exposure, Listener, judge, listening_sockets
from gpuguard.engines.process import ProcessLookupFailed, resolve
from gpuguard.policy.doctor import Finding

CHECK = "engine"
TODO_OPEN = ("start the engine with --api-key (vLLM, SGLang, llama-server), or bind it to 127.0.0.1 "
             "behind an authenticating proxy (INCIDENTS §10)")


def exposure_findings(engine: str, listeners: Iterable[Listener], exposures: Iterable[Exposure]) -> list[Finding]:
    listeners, exposures = list(listeners), list(exposures)
    out: list[Finding] = []
    for x in exposures:
        if x.verdict == "open":
            out.append(Finding("WARN", CHECK, x.sentence(), engine, TODO_OPEN))
        elif x.verdict == "unprobed":
            out.append(Finding("WARN", CHECK, x.sentence(), engine,
                               "check that it refuses a request without the key, or bind it to 127.0.0.1"))
        else:
            out.append(Finding("OK", CHECK, x.sentence(), engine))
    if listeners and not exposures:
        out.append(Finding("OK", CHECK, "listens on loopback only (" +
                           ", ".join(x.endpoint for x in listeners) + ")", engine))
    elif not listeners:
        out.append(Finding("OK", CHECK, "running, but none of its processes listens on TCP", engine))
    return out


async def _one(cfg: Any) -> list[Finding]:
    try:
        procs = await asyncio.to_thread(resolve, cfg)
    except ProcessLookupFailed as exc:
        return [Finding("WARN", CHECK, f"its processes were not found: {exc}", cfg.name,
                        f"check engines.{cfg.name}.process")]
    if procs is None:
        return [Finding("OK", CHECK, "not running now: its listening sockets were not checked", cfg.name)]
    listeners = await asyncio.to_thread(listening_sockets, procs.pids)
    return exposure_findings(cfg.name, listeners, await judge(cfg, listeners))


def engine_findings(engines: Iterable[Any]) -> list[Finding]:
    """Every configured engine's exposure verdicts, the engines asked concurrently."""
    engines = list(engines)
    if not engines:
        return []

    async def all_of() -> list[list[Finding]]:
        return await asyncio.gather(*(_one(cfg) for cfg in engines))

    return [f for fs in asyncio.run(all_of()) for f in fs]
