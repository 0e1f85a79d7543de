"""Webhook alerts against a real HTTP receiver: an alert-grade event reaches it within 1 s
of being published on the hub; info events do not go out; a dead or failing webhook is
retried with backoff, counted in /metrics, and never holds up another webhook."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.config.service import WebhookConfig
from gpuguard.sinks.metrics import MetricsSink
from gpuguard.sinks.notifier import WebhookNotifier, redact_url
from gpuguard.state.events import Event
from gpuguard.state.hub import Hub

pytestmark = [pytest.mark.slow, pytest.mark.network]  # registered in pyproject.toml


class Receiver:
    """A real HTTP server that records each POST (arrival time, JSON) and answers with
    the next status in `answers` (then 200)."""

    def __init__(self, answers: list[int] | None = None) -> None:
        self.got: list[tuple[float, dict]] = []
        self.answers = list(answers or [])
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = outer.answers.pop(0) if outer.answers else 200
                outer.got.append((time.monotonic(), json.loads(body)))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hooks/secret-path?key=s3cret"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def dead_url() -> str:
    """A port nobody listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/dead"


async def until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


def stall(**kw) -> Event:
    return Event("engine_stalled", "alert", "engines", "vllm-a: 1 request running, no token for 12 s", engine="vllm-a", **kw)


def test_alert_reaches_the_receiver_within_a_second(receiver):
    async def main():
        hub = Hub()
        n = WebhookNotifier(hub, [WebhookConfig(url=receiver.url)])
        await n.start()
        try:
            hub.publish(Event("gpu_appeared", "info", "poller", "not for webhooks"))
            t0 = time.monotonic()
            hub.publish(stall())
            await until(lambda: receiver.got, 1.0, "the stall alert at the receiver")
            assert receiver.got[0][0] - t0 < 1.0
            sent = receiver.got[0][1]
            assert sent["event"]["kind"] == "engine_stalled" and sent["event"]["engine"] == "vllm-a"
            assert sent["event"]["severity"] == "alert" and "vllm-a" in sent["text"]
            hub.publish(Event("gpu_lost", "critical", "poller", "gone", gpu="gpu0"))
            await until(lambda: len(receiver.got) == 2, 1.0, "the critical event")
            assert [g[1]["event"]["kind"] for g in receiver.got] == ["engine_stalled", "gpu_lost"]  # no info event
        finally:
            await n.close()

    asyncio.run(main())


def test_alert_from_a_reader_thread_is_delivered(receiver):
    async def main():
        hub = Hub()
        n = WebhookNotifier(hub, [WebhookConfig(url=receiver.url)])
        await n.start()
        try:
            t = threading.Thread(target=hub.publish, args=(stall(),))
            t.start()
            t.join()
            await until(lambda: receiver.got, 1.0, "the alert published from another thread")
        finally:
            await n.close()

    asyncio.run(main())


def test_dead_webhook_is_counted_and_does_not_delay_a_live_one(receiver):
    dead = dead_url()

    async def main():
        hub = Hub()
        metrics = MetricsSink(hub)
        n = WebhookNotifier(hub, [WebhookConfig(url=dead, retries=2, timeout_seconds=1),
                                  WebhookConfig(url=receiver.url)])
        metrics.add("webhooks", n.collect)
        await n.start()
        try:
            t0 = time.monotonic()
            hub.publish(stall())
            await until(lambda: receiver.got, 1.0, "the live webhook despite the dead one")
            assert receiver.got[0][0] - t0 < 1.0
            # first try + 2 retries with 0.5 s, 1 s backoff
            await until(lambda: n.failures[redact_url(dead)] == 3, 5.0, "three failed attempts at the dead webhook")
            await until(lambda: n.sent[redact_url(receiver.url)] == 1, 1.0, "the live delivery to be counted")
            return metrics.render().decode()
        finally:
            await n.close()

    text = asyncio.run(main())
    samples = {(s.name, s.labels.get("url")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("gpuguard_webhook_failures_total", redact_url(dead))] == 3
    assert samples[("gpuguard_webhook_failures_total", redact_url(receiver.url))] == 0
    assert samples[("gpuguard_webhook_sent_total", redact_url(receiver.url))] == 1
    assert "s3cret" not in text and "secret-path" not in text  # URLs carry secrets: labels are redacted


def test_failing_webhook_is_retried_with_backoff():
    r = Receiver(answers=[500, 503])
    try:

        async def main():
            hub = Hub()
            n = WebhookNotifier(hub, [WebhookConfig(url=r.url, retries=3)])
            await n.start()
            try:
                hub.publish(stall())
                # sent counts once the 200 came back (the receiver records before answering)
                await until(lambda: n.sent[redact_url(r.url)] == 1, 5.0, "delivery on the third attempt")
                return n
            finally:
                await n.close()

        n = asyncio.run(main())
        times = [t for t, _ in r.got]
        assert times[1] - times[0] >= 0.45 and times[2] - times[1] >= 0.95  # 0.5 s, then 1 s
        assert len(times) == 3 and n.failures[redact_url(r.url)] == 2
    finally:
        r.close()


def test_reload_adds_and_removes_webhooks(receiver):
    other = Receiver()
    try:

        async def main():
            hub = Hub()
            n = WebhookNotifier(hub, [WebhookConfig(url=receiver.url)])
            await n.start()
            try:
                n.configure([WebhookConfig(url=other.url)])
                hub.publish(stall())
                await until(lambda: other.got, 1.0, "the alert at the newly configured webhook")
            finally:
                await n.close()

        asyncio.run(main())
        assert receiver.got == []
    finally:
        other.close()


def test_redact_url():
    assert redact_url("https://hooks.slack.com/services/T0/B0/XXXX") == "https://hooks.slack.com/…"
    assert redact_url("http://10.0.0.5:9000/") == "http://10.0.0.5:9000/"


class _Slow(Receiver):
    """Answers every other POST only after `delay_s`, later than the notifier waits."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.calls = 0
        handler = self.httpd.RequestHandlerClass
        outer = self
        inner = handler.do_POST

        def do_POST(h) -> None:
            outer.calls += 1
            if outer.calls % 2 == 0:
                time.sleep(delay_s)
            inner(h)

        handler.do_POST = do_POST


class _Resetting:
    """Accepts each connection, reads the request, then resets it (RST, no answer)."""

    def __init__(self) -> None:
        import struct

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/reset"
        self.connections = 0
        self._linger = struct.pack("ii", 1, 0)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            c.settimeout(2)
            try:
                c.recv(65536)
            except OSError:
                pass
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, self._linger)
            c.close()

    def close(self) -> None:
        self.sock.close()


def _webhook_counts(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name.startswith("gpuguard_webhook_") and s.name.endswith("_total"):
                out.setdefault(s.labels["url"], {})[s.name[len("gpuguard_webhook_"):-len("_total")]] = s.value
    return out


def test_every_admitted_alert_is_sent_dropped_or_given_up_and_counted():
    """A slow receiver (every other answer later than the timeout), a dead port (300 alerts
    against a queue of 256) and one that resets every connection: each alert a webhook admits
    ends as sent, dropped (queue full) or given up (after its last retry), and
    sent + dropped + given up = admitted on /metrics, exactly, per URL."""
    slow, reset, dead = _Slow(delay_s=1.5), _Resetting(), dead_url()
    targets = {  # url -> (alerts published for it, config)
        slow.url: (10, WebhookConfig(url=slow.url, retries=0, timeout_seconds=0.3, debounce_seconds=0)),
        dead: (300, WebhookConfig(url=dead, retries=0, timeout_seconds=1, debounce_seconds=0)),
        reset.url: (5, WebhookConfig(url=reset.url, retries=1, timeout_seconds=1, debounce_seconds=0)),
    }
    try:
        async def main():
            hub = Hub()
            metrics = MetricsSink(hub)
            n = WebhookNotifier(hub, [])
            metrics.add("webhooks", n.collect)
            await n.start()
            try:
                for url, (count, cfg) in targets.items():
                    n.configure([cfg])  # one URL at a time: each gets its own count of alerts
                    for i in range(count):
                        hub.publish(stall(gpu=f"gpu{i}"))
                    label = redact_url(url)
                    await until(lambda: n.sent[label] + n.dropped[label] + n.given_up[label] == count, 30,
                                f"every alert to {label} sent, dropped or given up")
                    texts[url] = metrics.render().decode()
            finally:
                await n.close()

        texts: dict[str, str] = {}
        asyncio.run(main())
    finally:
        slow.close()
        reset.close()
    for url, (count, _) in targets.items():
        c = _webhook_counts(texts[url])[redact_url(url)]
        assert c["admitted"] == count, (url, c)
        assert c["sent"] + c["dropped"] + c["given_up"] == c["admitted"], (url, c)
    slow_c, dead_c, reset_c = (_webhook_counts(texts[u])[redact_url(u)] for u in (slow.url, dead, reset.url))
    assert slow_c["sent"] == 5 and slow_c["given_up"] == 5 and slow_c["dropped"] == 0, slow_c
    assert dead_c["sent"] == 0 and dead_c["dropped"] == 300 - 256 and dead_c["given_up"] == 256, dead_c
    assert reset_c == {**reset_c, "sent": 0, "dropped": 0, "given_up": 5, "failures": 10}, reset_c
    assert reset.connections == 10  # the first try and one retry of each


def test_a_webhook_removed_by_a_reload_counts_what_it_still_held_as_dropped():
    dead = dead_url()

    async def main():
        hub = Hub()
        n = WebhookNotifier(hub, [WebhookConfig(url=dead, retries=5, debounce_seconds=0)])
        await n.start()
        try:
            for i in range(3):
                hub.publish(stall(gpu=f"gpu{i}"))
            label = redact_url(dead)
            await until(lambda: n.failures[label] >= 1, 5, "the first failed attempt (then a backoff)")
            n.configure([])  # one alert in its retry backoff, two queued
            return n.admitted[label], n.sent[label], n.dropped[label], n.given_up[label]
        finally:
            await n.close()

    assert asyncio.run(main()) == (3, 0, 3, 0)
