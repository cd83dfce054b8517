"""Prometheus exposition of one service: `/metrics` served from the service's own event loop,
and collectors that read the service's live state when scraped."""

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from relaygr.bucket_counts import BucketCounts
from relaygr.errors import ConfigError

_log = logging.getLogger(__name__)
Labels = TypeVar("Labels", bound=tuple[str, ...])  # one value per label name
_READ_TIMEOUT_S = 10.0
_MAX_HEAD_BYTES = 16 * 1024


class LiveCollector(Collector):
    """Metric families built by `collect` when scraped: counters the service keeps anyway
    (dicts of counts, queue lengths, tier usage) are read, not counted a second time."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())

    def describe(self) -> Iterable[Metric]:
        return ()  # names are not known before the first scrape; nothing to check collisions on


def counter(
    name: str, documentation: str, labels: Sequence[str], values: Mapping[Labels, float]
) -> CounterMetricFamily:
    """A counter family (`name` without `_total`) with one sample per label tuple."""
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    for label_values, value in values.items():
        family.add_metric(list(label_values), value)
    return family


def gauge(
    name: str, documentation: str, labels: Sequence[str], values: Mapping[Labels, float]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    for label_values, value in values.items():
        if not math.isnan(value):
            family.add_metric(list(label_values), value)
    return family


def histogram(name: str, documentation: str, counts: BucketCounts) -> HistogramMetricFamily:
    """A histogram family (no labels) from counts kept by the service (`BucketCounts`)."""
    cumulative, buckets = 0, []
    for bound, n in zip((*counts.bounds, math.inf), counts.counts, strict=True):
        cumulative += n
        buckets.append((str(float(bound)) if bound != math.inf else "+Inf", cumulative))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=counts.total)


def connectivity(etcd_connected: bool | None, rankers: int | None) -> list[Metric]:
    """What every service reports about the mesh: etcd reachability (when it uses etcd) and the
    rankers in its membership view (when it keeps one)."""
    families: list[Metric] = []
    if etcd_connected is not None:
        families.append(
            gauge(
                "relaygr_etcd_connected",
                "1 while every etcd watch and kept lease of this service is connected, else 0",
                [],
                {(): float(etcd_connected)},
            )
        )
    if rankers is not None:
        families.append(
            gauge(
                "relaygr_cluster_rankers", "Live rankers in this service's view", [], {(): rankers}
            )
        )
    return families


class MetricsServer:
    """Serves `GET /metrics` (and `HEAD`) of one registry over HTTP/1.1, one request per
    connection, from the event loop that started it.

    Scrapes run on the service's loop, so collectors read state that the loop owns without locks
    and see a consistent snapshot, and no thread is added. Prometheus text or OpenMetrics is
    chosen by the request's Accept header.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._server: asyncio.Server | None = None

    async def start(self, address: tuple[str, int]) -> None:
        """Listen on (host, port); port 0 picks a free one (see `port`)."""
        host, port = address
        try:
            self._server = await asyncio.start_server(
                self.handle, host, port, reuse_address=True, limit=_MAX_HEAD_BYTES
            )
        except OSError as err:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {err.strerror}") from err

    @property
    def port(self) -> int:
        """The bound port (the real one when port 0 was asked for)."""
        assert self._server is not None, "metrics server not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            status, content_type, body, method = self._answer(head.decode("latin-1"))
            writer.write(
                (
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode("latin-1")
            )
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            pass  # the client went away or sent no complete request: nothing to answer
        finally:
            writer.close()

    def _answer(self, head: str) -> tuple[str, str, bytes, str]:
        """(status line, content type, body, method) for one request head."""
        request_line, *header_lines = head.split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3:
            return "400 Bad Request", "text/plain", b"bad request line\n", ""
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET /metrics\n", method
        path = urlsplit(target).path
        if path == "/":
            return "200 OK", "text/plain", b"metrics at /metrics\n", method
        if path != "/metrics":
            return "404 Not Found", "text/plain", b"not found: try /metrics\n", method
        headers = {}
        for line in header_lines:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(self._registry)
        except Exception:
            _log.exception("metrics collection failed")
            return "500 Internal Server Error", "text/plain", b"collection failed\n", method
        return "200 OK", content_type, body, method


async def start_metrics_server(
    registry: CollectorRegistry, address: tuple[str, int]
) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics (port 0: a free port, see `.port`)."""
    server = MetricsServer(registry)
    await server.start(address)
    return server
