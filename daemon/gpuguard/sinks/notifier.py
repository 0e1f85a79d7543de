"""Webhook alerts: every alert-grade event (stall, kill, device lost, reset failed,
profile unverified, thermal emergency, link downgrade — severity alert/critical) is POSTed
as JSON to each configured URL.

Never blocks the loop: the hub callback only puts the event on a bounded queue per URL;
one worker task per URL sends with httpx, retrying with exponential backoff. A dead or
slow webhook fills only its own queue (further events for it are dropped and counted) and
never delays another URL. Failures are counted per URL and exported as
`gpuguard_webhook_failures_total{url}`, never fatal. Every alert a URL admits ends counted
once, as sent, dropped (queue full, or the URL removed by a reload) or given up (its last
retry failed): sent + dropped + given up + queued = admitted, per URL, on /metrics.
INCIDENTS §1: the owner noticed a GPU loss 18 minutes late; an alert must leave the host
within a second.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
from typing import TYPE_CHECKING, Iterable
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuguard.sinks.alert_gate import AlertGate, AlertQueue

from gpuguard import __version__
from gpuguard.config.service import WebhookConfig
from gpuguard.state.events import Event
from gpuguard.state.hub import Hub

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("gpuguard.webhook")

QUEUE_SIZE = 256
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0


def redact_url(url: str) -> str:
    """scheme://host[:port]/… — webhook paths and queries often carry secrets (Slack,
    Discord), so logs and metrics labels show only where it goes."""
    u = urlsplit(url)
    host = u.hostname or "?"
    port = f":{u.port}" if u.port else ""
    return f"{u.scheme}://{host}{port}/…" if (u.path not in ("", "/") or u.query) else f"{u.scheme}://{host}{port}/"


def payload(event: Event) -> dict:
    return {
        "source": "gpuguard",
        "host": socket.gethostname(),
        "version": __version__,
        "event": event.to_dict(),
        "text": f"[{event.severity}] {event.kind}: {event.message}",
    }


class _Target:
    def __init__(self, cfg: WebhookConfig) -> None:
        self.cfg = cfg
        self.label = redact_url(cfg.url)
        self.queue = AlertQueue(QUEUE_SIZE)  # severity-aware when full (sinks/alert_gate.py)
        self.gate = AlertGate(cfg.debounce_seconds)
        self.task: asyncio.Task | None = None
        self.in_flight = 0  # the alert being delivered (0 or 1)


class WebhookNotifier:
    def __init__(self, hub: Hub, webhooks: Iterable[WebhookConfig] = ()) -> None:
        self.hub = hub
        self.failures: collections.Counter[str] = collections.Counter()  # label -> failed deliveries
        self.sent: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.admitted: collections.Counter[str] = collections.Counter()
        self.given_up: collections.Counter[str] = collections.Counter()  # last retry failed
        self._targets: dict[str, _Target] = {}
        self._configs = list(webhooks)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        # called on the loop, synchronously, before an admitted alert is queued (the kmsg
        # reader saves its position here: a crash never re-alerts an alerted line)
        self.before_send: list = []
        self.suppressed: collections.Counter[str] = collections.Counter()  # kind -> debounced repeats
        hub.on_event(self._on_event)

    # -- lifecycle (inside the running loop) -------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.configure(self._configs)

    def configure(self, webhooks: Iterable[WebhookConfig]) -> None:
        """Apply a (re)loaded webhook list: new URLs get a worker, removed ones are stopped,
        unchanged ones keep their queue."""
        self._configs = list(webhooks)
        if self._loop is None:
            return
        wanted = {w.url: w for w in self._configs}
        if wanted and self._client is None:
            # made with the first URL, not at the first alert: importing httpx then took
            # up to a second on a loaded host, late for an alert promised within one
            import httpx

            self._client = httpx.AsyncClient(follow_redirects=False)
        for url in list(self._targets):
            if url not in wanted or self._targets[url].cfg != wanted[url]:
                t = self._targets.pop(url)
                self._fold(t)
                if t.task is not None:
                    t.task.cancel()
        for url, cfg in wanted.items():
            if url not in self._targets:
                t = _Target(cfg)
                t.task = self._loop.create_task(self._worker(t), name=f"webhook {t.label}")
                self._targets[url] = t

    async def close(self) -> None:
        tasks = [t.task for t in self._targets.values() if t.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._targets.clear()
        if self._client is not None:
            await self._client.aclose()

    # -- intake (hub callback; must not block) ------------------------------------------------
    def _on_event(self, event: Event) -> None:
        if not event.alert_grade or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._enqueue(event)
        elif not self._loop.is_closed():  # published from a reader thread
            self._loop.call_soon_threadsafe(self._enqueue, event)

    def _enqueue(self, event: Event) -> None:
        admitted = [(t, e) for t in self._targets.values() if (e := t.gate.admit(event)) is not None]
        if not admitted:
            return
        for fn in self.before_send:
            try:
                fn(event)
            except Exception as e:  # noqa: BLE001 - never lose the alert for a hook
                log.error("webhook before_send hook failed: %s: %s", type(e).__name__, e)
        for t, e in admitted:
            self.admitted[t.label] += 1
            dropped = t.queue.put(e)
            if dropped is not None:
                self.dropped[t.label] += 1
                log.warning("webhook queue full url=%s dropped kind=%s severity=%s", t.label, dropped.kind,
                            dropped.severity)

    def _fold(self, t: _Target) -> None:
        """A URL removed by a reload: its repeats stay counted, and what it still held
        (queued, or being delivered when its worker is cancelled) is dropped."""
        for kind, n in t.gate.suppressed.items():
            self.suppressed[kind] += n
        self.dropped[t.label] += len(t.queue) + t.in_flight

    # -- delivery --------------------------------------------------------------------------
    async def _worker(self, t: _Target) -> None:
        while True:
            event = await t.queue.get()
            t.in_flight = 1
            try:
                ok = await self._deliver(t, event)
            except Exception as e:  # noqa: BLE001 — not an HTTP error (a bad URL, a bug): this alert, not the worker
                log.error("webhook url=%s kind=%s not delivered: %s: %s", t.label, event.kind, type(e).__name__, e)
                ok = False
            t.in_flight = 0
            if not ok:
                self.given_up[t.label] += 1

    async def _deliver(self, t: _Target, event: Event) -> bool:
        import httpx  # imported by configure() with the first URL: a host without webhooks never pays it

        assert self._client is not None
        body = payload(event)
        delay = BACKOFF_FIRST
        for attempt in range(t.cfg.retries + 1):
            try:
                r = await self._client.post(t.cfg.url, json=body, timeout=t.cfg.timeout_seconds)
                if r.status_code < 300:
                    self.sent[t.label] += 1
                    return True
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self.failures[t.label] += 1
            last = attempt == t.cfg.retries
            log.warning(
                "webhook failed url=%s kind=%s attempt=%d/%d error=%s%s",
                t.label,
                event.kind,
                attempt + 1,
                t.cfg.retries + 1,
                why,
                " giving up" if last else f" retry_in={delay:g}s",
            )
            if last:
                return False
            await asyncio.sleep(delay)  # backoff between attempts; other URLs are unaffected
            delay = min(delay * 2, BACKOFF_MAX)
        return False

    # -- metrics ---------------------------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(
            "gpuguard_webhook_failures", "Failed webhook POST attempts (each retry counts)", labels=["url"]
        )
        sent = CounterMetricFamily("gpuguard_webhook_sent", "Alert events delivered to a webhook", labels=["url"])
        dropped = CounterMetricFamily(
            "gpuguard_webhook_dropped", "Alert events dropped because the webhook's queue was full "
            "(or the webhook was removed by a reload)", labels=["url"]
        )
        admitted = CounterMetricFamily(
            "gpuguard_webhook_admitted", "Alert events admitted for a webhook (after debounce): each ends sent, "
            "dropped or given up", labels=["url"])
        given_up = CounterMetricFamily(
            "gpuguard_webhook_given_up", "Alert events not delivered to a webhook after all retries", labels=["url"])
        queued = GaugeMetricFamily(
            "gpuguard_webhook_queued", "Alert events waiting for a webhook or being delivered now", labels=["url"])
        labels = sorted({t.label for t in self._targets.values()} | set(self.failures) | set(self.sent)
                        | set(self.admitted))
        held = collections.Counter({t.label: len(t.queue) + t.in_flight for t in self._targets.values()})
        for label in labels:
            fam.add_metric([label], self.failures[label])
            sent.add_metric([label], self.sent[label])
            dropped.add_metric([label], self.dropped[label])
            admitted.add_metric([label], self.admitted[label])
            given_up.add_metric([label], self.given_up[label])
            queued.add_metric([label], held[label])
        suppressed = CounterMetricFamily(
            "gpuguard_alerts_suppressed", "Alert events not sent because the same condition (kind, GPU, engine) "
            "was alerted within the webhook's debounce window", labels=["kind"])
        total = collections.Counter(self.suppressed)
        for t in self._targets.values():
            total.update(t.gate.suppressed)
        for kind, n in sorted(total.items()):
            suppressed.add_metric([kind], n)
        yield from (fam, sent, dropped, admitted, given_up, queued, suppressed)
