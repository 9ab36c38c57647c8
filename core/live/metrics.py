"""A Prometheus exporter for a run: the latest Sample as gauges, spikes and events as counters.

Served by the real ``prometheus_client`` (its WSGI server on a daemon thread), from a private
registry, on 127.0.0.1 unless a host is given explicitly (``--metrics-host``): a run's memory
figures are nobody else's business by default. Memory a device cannot report is left out of the
page (no sample), never exported as 0, as everywhere in KV Scope.

Metric names (all bytes are bytes, all counters end in ``_total`` on the page)::

    kvscope_kv_cache_observed_bytes      walking the cache's tensors
    kvscope_kv_cache_predicted_bytes     kvscope.core.prediction.predict for the same instant
    kvscope_weights_bytes                observed
    kvscope_predicted_bytes{part}        weights | activations | total
    kvscope_allocator_bytes{kind}        allocated | reserved | peak (torch's caching allocator)
    kvscope_device_memory_bytes{kind}    used | total (NVML, the whole device)
    kvscope_process_memory_bytes{kind}   gpu (NVML, this process) | rss
    kvscope_tokens_per_second, kvscope_generated_tokens, kvscope_context_tokens
    kvscope_forward_peak_{observed,predicted}_bytes   the last prefill's / re-run's peak above the weights
    kvscope_memory_breakdown_bytes{part,source}   kvscope.core.live.breakdown: weights | kv_held | kv_reserved_free |
                                         activations | allocator_cache | runtime | other_processes
    kvscope_memory_observed_total_bytes{source}   the total they add up to (NVML device used, RSS...)
    kvscope_run_info{model,attention,attn_impl,cache,kernel,device,dtype}   1
    kvscope_spikes_total{cause}          kvscope.core.live.spikes.SpikeMonitor over the samples' memory
    kvscope_events_total{event}          switch, refused, note, error, budget, ...
"""

from __future__ import annotations

import ipaddress
import threading
from collections import Counter

from kvscope.core.base.errors import BAD_INPUT, KVScopeError
from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.live.breakdown import memory_breakdown
from kvscope.core.live.spikes import SpikeMonitor, reading_from_sample, spike_events, spike_threshold

LOOPBACK = "127.0.0.1"
PREFIX = "kvscope"


class MetricsError(KVScopeError, ValueError):
    """A port or host the exporter refuses (said in one line)."""

    category = BAD_INPUT


def check_bind(host: str, port: int) -> tuple[str, int]:
    """The (host, port) to bind, checked: a port 0-65535 (0: any free one); any host is allowed, but
    only because the caller asked for it by name (the default is loopback)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise MetricsError(f"--metrics-port {port!r}: give a port from 0 to 65535 (0: any free port)")
    host = str(host).strip()
    if not host:
        raise MetricsError("--metrics-host is empty; leave it out for 127.0.0.1")
    return host, port


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _cause_label(cause: str) -> str:
    """The short name of a spike's cause ("dynamic-cache growth", "prefill activations", ...)."""
    return (cause.split(":", 1)[0] or "unknown").strip()


class RunCollector:
    """Holds the run's latest token Sample and its counters; ``collect`` builds the page from them.

    ``observe`` is called from the generation thread, ``collect`` from the HTTP server's: a lock
    keeps each page consistent (one Sample's figures, not two half-samples).
    """

    def __init__(self, model: str = "", device: str | None = None) -> None:
        self._lock = threading.Lock()
        self.model = model
        self._last: Sample | None = None
        self._settings: Sample | None = None  # the latest sample of any kind: the settings in force
        self._events: Counter[str] = Counter()
        self._spikes: Counter[str] = Counter()
        self._monitor = SpikeMonitor(min_rise_bytes=spike_threshold(device))
        self._previous_cache: str | None = None
        self._peak: tuple[int | None, int | None] = (None, None)

    def observe(self, sample: Sample) -> None:
        """Take one Sample (a token or an event) from the run."""
        with self._lock:
            self._settings = sample
            for event in spike_events(sample, self._previous_cache):
                self._monitor.add_event(event)
            self._previous_cache = sample.cache
            if sample.peak_bytes_observed is not None or sample.peak_bytes_predicted is not None:
                self._peak = (sample.peak_bytes_observed, sample.peak_bytes_predicted)  # kept past the decode steps
            if sample.phase == PHASE_EVENT:
                self._events[sample.event or "event"] += 1
                return
            self._last = sample
            for spike in self._monitor.feed(reading_from_sample(sample)):
                self._spikes[_cause_label(spike.cause)] += 1

    def finish(self) -> None:
        """The run ended: count the spikes still rising at its last sample."""
        with self._lock:
            for spike in self._monitor.flush():
                self._spikes[_cause_label(spike.cause)] += 1

    @property
    def spikes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._spikes)

    def describe(self):  # prometheus_client: no samples at registration
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        with self._lock:
            s, settings, peak = self._last, self._settings, self._peak
            events, spikes = dict(self._events), dict(self._spikes)

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily | None:
            if value is None:
                return None
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            g.add_metric([], float(value))
            return g

        def labelled(name: str, doc: str, label: str, values: dict) -> GaugeMetricFamily | None:
            present = {k: v for k, v in values.items() if v is not None}
            if not present:
                return None
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=[label])
            for k, v in present.items():
                g.add_metric([k], float(v))
            return g

        out = []
        if s is not None:
            out += [
                gauge("kv_cache_observed_bytes", "KV cache bytes, walking the cache's tensors", s.kv_bytes_reserved),
                gauge("kv_cache_predicted_bytes", "KV cache bytes the predictor gives for the same instant",
                      s.kv_bytes_predicted),
                gauge("kv_cache_storage_bytes", "Bytes of the storage blocks the cache tensors keep alive",
                      s.kv_bytes_storage),
                gauge("weights_bytes", "Model weights, observed", s.weights_bytes),
                labelled("predicted_bytes", "Predicted memory by part", "part",
                         {"weights": s.weights_predicted, "activations": s.activations_predicted,
                          "total": s.total_predicted}),
                labelled("allocator_bytes", "torch caching allocator", "kind",
                         {"allocated": s.allocator_allocated, "reserved": s.allocator_reserved,
                          "peak": s.allocator_peak}),
                labelled("device_memory_bytes", "NVML, the whole device", "kind",
                         {"used": s.device_used, "total": s.device_total}),
                labelled("process_memory_bytes", "This process: NVML GPU memory and resident host memory", "kind",
                         {"gpu": s.process_gpu, "rss": s.process_rss}),
                gauge("tokens_per_second", "Generation rate", s.tokens_per_s),
                gauge("generated_tokens", "Tokens generated so far", s.token),
                gauge("context_tokens", "Tokens in the sequence (prompt + generated)", s.context_tokens),
                gauge("forward_peak_observed_bytes", "The last prefill's (or re-run's) allocator peak above the "
                      "weights", peak[0]),
                gauge("forward_peak_predicted_bytes", "The same peak as kvscope.core.prediction.predict.prefill_peak replays it",
                      peak[1]),
                *_breakdown_families(s),
            ]
        if settings is not None:
            info = InfoMetricFamily(f"{PREFIX}_run", "The run's settings in force")
            info.add_metric([], {"model": self.model, "attention": settings.attention, "attn_impl": settings.attn_impl,
                                 "cache": settings.cache, "kernel": settings.kernel, "device": settings.device,
                                 "dtype": settings.dtype})
            out.append(info)
        spike_family = CounterMetricFamily(f"{PREFIX}_spikes", "Memory spikes seen, by likely cause", labels=["cause"])
        for cause, n in sorted(spikes.items()):
            spike_family.add_metric([cause], n)
        event_family = CounterMetricFamily(f"{PREFIX}_events", "Run events (switches, refusals, errors...)",
                                           labels=["event"])
        for event, n in sorted(events.items()):
            event_family.add_metric([event], n)
        out += [spike_family, event_family]
        return [m for m in out if m is not None]


def _breakdown_families(s: Sample) -> list:
    """``kvscope_memory_breakdown_bytes{part,source}`` (kvscope.core.live.breakdown: the parts of the observed total, a part the
    device does not report left out) and ``kvscope_memory_observed_total_bytes{source}``."""
    from prometheus_client.core import GaugeMetricFamily

    b = memory_breakdown(s)
    parts = GaugeMetricFamily(f"{PREFIX}_memory_breakdown_bytes", "Where the observed total went, by part; source "
                              "says measured, predicted or a measured remainder", labels=["part", "source"])
    for p in b.parts:
        if p.bytes is not None:
            parts.add_metric([p.name, p.source], float(p.bytes))
    out = [parts] if parts.samples else []
    if b.total is not None:
        total = GaugeMetricFamily(f"{PREFIX}_memory_observed_total_bytes", "The observed total the parts add up to",
                                  labels=["source"])
        total.add_metric([b.total_source], float(b.total))
        out.append(total)
    return out


class MetricsExporter:
    """``start`` serves ``collector`` at http://HOST:PORT/metrics; ``stop`` closes the socket."""

    def __init__(self, collector: RunCollector, host: str = LOOPBACK, port: int = 0) -> None:
        self.collector = collector
        self.host, self.port = check_bind(host, port)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> "MetricsExporter":
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        try:
            self._server, self._thread = start_http_server(self.port, addr=self.host, registry=registry)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}") from None
        self._thread.name = "kvscope-metrics"
        self.port = self._server.server_address[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "MetricsExporter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
