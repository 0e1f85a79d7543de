"""One poll of an engine's HTTP endpoints: /health and /metrics fetched concurrently, each
bounded by its own wall-clock timeout. An engine that accepts and never answers yields
`timeout` evidence here; it never holds up the caller longer than the timeout."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from typing import TYPE_CHECKING

from gpuguard.engines.adapters import Adapter, EngineReading, Health, slots_decoded
from gpuguard.engines.exposition import ExpositionError, Samples

if TYPE_CHECKING:
    import httpx

# httpx (and anyio) are imported at the first probe, not at start: with no engine
# configured the daemon never pays their ~7 MiB (httpx pulls in rich for its CLI).


@dataclass(frozen=True)
class ProbeResult:
    health: Health
    health_detail: str
    health_seconds: float
    reading: EngineReading | None
    metrics_error: str | None  # None, "timeout", "refused", "http 503", "garbage: ..."
    metrics_seconds: float
    metrics_text: str | None = None  # the raw scrape, kept briefly for incident bundles


class EngineProbe:
    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self._http: httpx.AsyncClient | None = None

    @property
    def _client(self) -> httpx.AsyncClient:
        # Made lazily, in the running loop; one per engine so a hung engine cannot exhaust
        # another engine's connection pool.
        if self._http is None or self._http.is_closed:
            self._http = self._new_client()
        return self._http

    def _new_client(self) -> httpx.AsyncClient:
        import httpx

        cfg = self.adapter.config
        return httpx.AsyncClient(
            base_url=cfg.url,
            timeout=httpx.Timeout(max(cfg.http_timeout, cfg.effective_health_timeout)),
            limits=httpx.Limits(max_connections=4, max_keepalive_connections=0),
            trust_env=False,
        )

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _get(self, path: str, timeout: float) -> tuple[str, int | None, str, float]:
        """-> (outcome, status, body, seconds); outcome ok|timeout|refused|error."""
        import anyio
        import httpx

        t0 = time.monotonic()
        try:
            # fail_after bounds the whole exchange (httpx's timeouts are per phase). It must be
            # anyio's own deadline, not asyncio.wait_for: anyio's happy-eyeballs connect can
            # swallow wait_for's cancellation, and a connect to a frozen (SIGSTOPped) engine
            # whose backlog is full then hangs for minutes — seen with the real llama-server.
            with anyio.fail_after(timeout):
                resp = await self._client.get(path, timeout=timeout)
            return "ok", resp.status_code, resp.text, time.monotonic() - t0
        except (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException):
            return "timeout", None, f"no answer within {timeout:g} s", time.monotonic() - t0
        except httpx.ConnectError as exc:
            return "refused", None, f"connect failed: {exc}", time.monotonic() - t0
        except httpx.HTTPError as exc:
            return "error", None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0

    async def health(self) -> tuple[Health, str, float]:
        cfg = self.adapter.config
        outcome, status, body, secs = await self._get(self.adapter.health_path, cfg.effective_health_timeout)
        if outcome != "ok":
            return outcome, body, secs  # type: ignore[return-value]
        return self.adapter.health(status or 0, body), f"HTTP {status}", secs

    async def slots(self) -> float | None:
        """llama-server's running slots' generated tokens (decode progress); None where the
        engine has no such endpoint or it did not answer."""
        path = self.adapter.slots_path
        if path is None:
            return None
        outcome, status, body, _ = await self._get(path, self.adapter.config.http_timeout)
        return slots_decoded(body) if outcome == "ok" and status == 200 else None

    async def metrics(self, slots: "asyncio.Future[float | None] | None" = None
                      ) -> tuple[EngineReading | None, str | None, float, str | None]:
        cfg = self.adapter.config
        outcome, status, body, secs = await self._get(cfg.metrics_path, cfg.http_timeout)
        if outcome != "ok":
            return None, outcome, secs, None
        if status != 200:
            return None, f"http {status}", secs, body[:4096]
        try:
            samples = Samples.parse(body, f"{cfg.url}{cfg.metrics_path}")
        except ExpositionError as exc:
            return None, f"garbage: {exc}", secs, body[:4096]
        return self.adapter.read(samples, await slots if slots is not None else None), None, secs, body

    async def poll(self) -> ProbeResult:
        # /slots alongside /metrics, not after: on llama-server both wait for the same main loop
        slots = asyncio.ensure_future(self.slots())
        try:
            (h, detail, hs), (reading, err, ms, text) = await asyncio.gather(self.health(), self.metrics(slots))
        finally:
            if not slots.done():
                slots.cancel()
        return ProbeResult(h, detail, hs, reading, err, ms, text)
