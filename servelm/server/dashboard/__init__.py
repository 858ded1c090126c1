"""`GET /dashboard`: a live page of the engine's KV pool, its queue and the server's latencies.

    /dashboard                 the page (static/index.html; the script and style beside it)
    /dashboard/static/<file>   its assets, shipped in the package: no CDN, no build step
    /dashboard/feed            server-sent events, one JSON object each (`DashboardHub.payload`)

The engine part of each event is the engine core's own snapshot (servelm/engine/dashboard.py),
asked for only while a page is connected, at most every `SNAPSHOT_INTERVAL` seconds. The rest
is this process's: TTFT, TPOT and ITL percentiles over the last minutes from the histograms in
metrics.py, tokens per second, the prefix cache's hit rate from its counters, and the recent
steps' composition (prompt vs decode tokens, step time). Every page shares one payload per
update: a slow page skips updates, it never queues them.

With `--api-key` these routes need the key like every other: `Authorization: Bearer KEY`, or,
so that a browser can open the page, HTTP Basic with the key as the password (the browser asks
for it once, then sends it with the feed too).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from servelm.engine.client import AsyncEngineClient
from servelm.engine.dashboard import DashboardSnapshot
from servelm.server.metrics import ServerMetrics
from servelm.server.sse import SSE_HEADERS

SNAPSHOT_INTERVAL = 0.25  # seconds between two engine snapshots, at most 4 a second
HEARTBEAT = 1.0  # an event at least this often (latencies move while the engine idles)
WINDOW = 300.0  # seconds the latency percentiles and the hit rate look back over
SAMPLE_EVERY = 5.0  # seconds between two readings of the metrics kept for that window
RATE_WINDOW = 10.0  # seconds tokens per second are averaged over
STEPS_SENT = 200  # the most recent steps each event carries
QUANTILES = (0.5, 0.9, 0.99)
STREAM_SECONDS = 15.0  # one stream's life; the page reconnects after RECONNECT_MS
RECONNECT_MS = 250
LINGER = 3.0  # seconds the engine keeps sending snapshots after the last page left
STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_encoder = msgspec.json.Encoder()


def static_text(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def page(kind: str) -> bytes:
    """The page; `kind` is "server" or "router" (which panels the script draws)."""
    return static_text("index.html").replace(b"{{KIND}}", kind.encode())


def histogram_buckets(histogram) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of every bucket of a one-series Histogram."""
    out = []
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out.append((float(s.labels["le"]), s.value))
    return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative buckets, interpolated inside its bucket as Prometheus'
    histogram_quantile does; None without observations. In the +Inf bucket: the last bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def counter_value(counter) -> float:
    return sum(s.value for f in counter.collect() for s in f.samples if s.name.endswith("_total"))


class FeedHub:
    """Pages watching one feed: the latest payload, a version that counts updates, and the
    start and stop of whatever produces them (`_start`, `_stop`, defined by subclasses).

    A stream ends after `STREAM_SECONDS` and the page reconnects at once (`retry:`): an open page
    never holds up a server's graceful shutdown for longer. The producer stops `LINGER` seconds
    after the last page left, so a reconnect does not stop and restart it."""

    def __init__(self) -> None:
        self.watchers = 0
        self.version = 0
        self.payload = b"{}"
        self._changed = asyncio.Event()
        self._producing = False
        self._stopper: asyncio.Task | None = None
        self.closed = False

    def close(self) -> None:
        """Ends every page's stream now, and new ones at once: the server is draining, and an
        open page would otherwise hold the drain up for a stream's life."""
        self.closed = True
        self._changed.set()

    def _start(self) -> None: ...

    def _stop(self) -> None: ...

    def publish(self) -> None: ...

    def subscribe(self) -> None:
        self.watchers += 1
        if self._stopper is not None:
            self._stopper.cancel()
            self._stopper = None
        if not self._producing:
            self._producing = True
            self._start()
        self.publish()

    def unsubscribe(self) -> None:
        self.watchers -= 1
        if self.watchers == 0 and self._stopper is None:
            self._stopper = asyncio.get_running_loop().create_task(self._stop_later())

    async def _stop_later(self) -> None:
        await asyncio.sleep(LINGER)
        self._stopper = None
        if self.watchers == 0 and self._producing:
            self._producing = False
            self._stop()

    def _updated(self, payload: bytes) -> None:
        self.payload = payload
        self.version += 1
        self._changed.set()

    async def events(self) -> AsyncIterator[bytes]:
        """The stream of one page: each new payload (at least every 2 * HEARTBEAT seconds)."""
        yield b"retry: %d\n\n" % RECONNECT_MS
        end = time.monotonic() + STREAM_SECONDS
        seen = -1
        while time.monotonic() < end and not self.closed:
            if self.version == seen:
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 2 * HEARTBEAT)
            seen = self.version
            yield b"data: " + self.payload + b"\n\n"

    def response(self) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            self.subscribe()
            try:
                async for chunk in self.events():
                    yield chunk
            finally:
                self.unsubscribe()

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


class DashboardHub(FeedHub):
    """What all pages of one server share: the latest engine snapshot, recent steps, samples
    of the metrics, and the payload built from them."""

    def __init__(self, engine: AsyncEngineClient, metrics: ServerMetrics, model: str) -> None:
        super().__init__()
        self.engine, self.metrics, self.model = engine, metrics, model
        self.snapshot: DashboardSnapshot | None = None
        self.steps: deque[tuple[float, int, int, float]] = deque(maxlen=4 * STEPS_SENT)
        # (time, metric readings): one at start, then every SAMPLE_EVERY seconds of steps
        self.samples: deque[tuple[float, dict[str, Any]]] = deque([(time.time(), self._read())])
        self._outs: deque[tuple[float, float]] = deque(maxlen=int(RATE_WINDOW / HEARTBEAT) + 2)
        self.rates: deque[tuple[float, float, float]] = deque(maxlen=300)  # (time, in/s, out/s)
        self._ticker: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last_server = 0.0
        self._watched_since = 0.0
        self._server: dict[str, Any] = {}
        engine.dashboard_listeners.append(self.on_snapshot)
        engine.stats_listeners.append(self.on_stats)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start(self) -> None:
        self._watched_since = time.time()
        self._spawn(self.engine.watch_dashboard(SNAPSHOT_INTERVAL))
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def _stop(self) -> None:
        self._spawn(self.engine.watch_dashboard(0.0))  # the engine stops building them
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            if time.time() - self._last_server >= HEARTBEAT:
                self.publish()

    # -- updates ----------------------------------------------------------------------------
    def on_snapshot(self, snapshot: DashboardSnapshot) -> None:
        self.snapshot = snapshot
        self.steps.extend(snapshot.steps)
        if self._producing:
            self.publish()

    def publish(self) -> None:
        now = time.time()
        if now - self._last_server >= HEARTBEAT or not self._server:
            self._server = self._server_part(now)
            self._last_server = now
        engine = None
        if self.snapshot is not None:
            engine = msgspec.to_builtins(self.snapshot)
            engine["steps"] = list(self.steps)[-STEPS_SENT:]
        self._updated(
            _encoder.encode(
                {"kind": "server", "model": self.model, "time": now, "engine": engine}
                | self._server
            )
        )

    def _read(self) -> dict[str, Any]:
        """The metrics the panels are computed from (cumulative since the server started)."""
        m = self.metrics
        name = m.model_name
        return {
            "ttft": histogram_buckets(m.ttft.labels(name)),
            "tpot": histogram_buckets(m.tpot.labels(name)),
            "itl": histogram_buckets(m.itl.labels(name)),
            "e2e": histogram_buckets(m.e2e.labels(name)),
            "out": counter_value(m.generation_tokens),
            "queries": counter_value(m.prefix_queries),
            "hits": counter_value(m.prefix_hits),
            "preemptions": counter_value(m.preemptions),
        }

    def on_stats(self, stats) -> None:
        """Per engine step, watched or not: a reading every SAMPLE_EVERY seconds, so a page
        opened now shows the last minutes, not only what happened since it connected."""
        now = time.time()
        if now - self.samples[-1][0] >= SAMPLE_EVERY:
            self.samples.append((now, self._read()))
            while len(self.samples) > 1 and self.samples[0][0] < now - WINDOW - SAMPLE_EVERY:
                self.samples.popleft()

    def _server_part(self, now: float) -> dict[str, Any]:
        """Latency percentiles, token rates and the hit rate, from this process's metrics."""
        reading = self._read()
        # The window starts at the oldest reading at most WINDOW (+ one sampling period) old.
        # With none that recent no step has run in the window, so it is empty: the last reading
        # is no base, since the requests of its last steps finished (and were recorded) after it.
        start = next((x for x in self.samples if x[0] >= now - WINDOW - SAMPLE_EVERY), None)
        base_time, base = start if start is not None else (now - WINDOW, reading)
        latency = {}
        for key in ("ttft", "tpot", "itl", "e2e"):
            delta = [(b, c - c0) for (b, c), (_, c0) in zip(reading[key], base[key], strict=True)]
            latency[key] = {
                "count": int(delta[-1][1]) if delta else 0,
                **{f"p{round(q * 100)}": quantile(q, delta) for q in QUANTILES},
            }
        self._outs.append((now, reading["out"]))
        t0, out0 = next(x for x in self._outs if x[0] >= now - RATE_WINDOW)
        out_rate = (reading["out"] - out0) / (now - t0) if now > t0 else 0.0
        # prompt tokens the engine computed (the steps are known only while a page watches)
        in_span = min(RATE_WINDOW, now - self._watched_since)
        in_rate = (
            sum(p for t, p, _, _ in self.steps if t >= now - in_span) / in_span
            if in_span > 0
            else 0.0
        )
        self.rates.append((round(now, 2), round(in_rate, 1), round(out_rate, 1)))
        queries = reading["queries"] - base["queries"]
        hits = reading["hits"] - base["hits"]
        return {
            "window_seconds": round(min(now - base_time, WINDOW), 1),
            "latency": latency,
            "throughput": {"in": in_rate, "out": out_rate, "history": list(self.rates)},
            "prefix_cache": {
                "hit_rate": hits / queries if queries else None,
                "hit_rate_total": reading["hits"] / reading["queries"]
                if reading["queries"]
                else None,
                "queries_total": reading["queries"],
                "hits_total": reading["hits"],
            },
            "preemptions_total": reading["preemptions"],
        }


ASK_FOR_BASIC = b'Basic realm="servelm dashboard"'


def basic_as_bearer(value: bytes) -> bytes:
    """`Basic base64(user:KEY)` as `Bearer KEY` (the user name when the password is empty);
    any other Authorization value as it is."""
    if value[:6].lower() != b"basic ":
        return value
    try:
        user, _, password = base64.b64decode(value[6:].strip(), validate=True).partition(b":")
    except ValueError:
        return value
    return b"Bearer " + (password or user)


class BasicAsBearer:
    """Pure ASGI, outside the API-key check, on /dashboard paths only: a browser cannot set an
    Authorization header on a page it opens, but it speaks HTTP Basic. The key given as the
    password (or the user name) becomes `Bearer <key>` for the key check; its 401s there ask
    for Basic too, so the browser shows its login box."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/dashboard"):
            return await self.app(scope, receive, send)
        headers = [
            (name, basic_as_bearer(value) if name == b"authorization" else value)
            for name, value in scope["headers"]
        ]
        scope = {**scope, "headers": headers}

        async def ask_for_basic(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 401:
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (b"www-authenticate", ASK_FOR_BASIC),
                    ],
                }
            await send(message)

        await self.app(scope, receive, ask_for_basic)


def static_response(name: str) -> Response:
    if name not in STATIC_FILES:
        from servelm.server.errors import error_response

        return error_response(404, f"no dashboard file {name!r}")
    return Response(
        static_text(name), media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"}
    )


def install_dashboard(app: FastAPI, hub: DashboardHub) -> None:
    """The routes (left out of /openapi.json: a page and an endless stream, not API)."""
    app.state.dashboard = hub  # (closed when the server starts to drain)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(page("server"), media_type="text/html; charset=utf-8")

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        return static_response(name)

    @app.get("/dashboard/feed", include_in_schema=False)
    async def dashboard_feed() -> Response:
        return hub.response()
