"""Watching inference servers: scrape their Prometheus ``/metrics``, read the KV-cache figures each one
publishes, and turn usage fractions into bytes with the predictor.

What each server publishes (the names as their sources and docs give them; fixtures in
``tests/fixtures/servers/`` say where each page came from):

- vLLM (0.33.0, ``vllm/v1/metrics/loggers.py``): ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full),
  ``vllm:cache_config_info`` (labels: the CacheConfig, with ``num_gpu_blocks`` and ``block_size``),
  ``vllm:num_requests_running`` / ``_waiting``, ``vllm:num_preemptions_total``. Tokens in use =
  usage x num_gpu_blocks x block_size.
- SGLang (``docs/references/production_metrics.md``): ``sglang:token_usage`` (a fraction),
  ``sglang:num_used_tokens``, ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``.
- llama.cpp's server with ``--metrics`` (``tools/server/README.md``): ``llamacpp:requests_processing``
  / ``_deferred`` and ``llamacpp:n_tokens_max``, a high-water mark, not the cache in use; builds
  before the unified KV cache also published ``llamacpp:kv_cache_usage_ratio`` and
  ``llamacpp:kv_cache_tokens``, read when present.
- TGI (``docs/source/reference/metrics.md``): ``tgi_batch_current_max_tokens`` (tokens the current
  batch may hold), ``tgi_batch_current_size``, ``tgi_queue_size``; no usage fraction.
- KV Scope's own exporter (``core.metrics``): observed and predicted KV bytes, as they are.

Every scrape is bounded in time (``timeout`` per request, the whole answer read within it) and in
size; a server that is down, slow, drops the connection or serves something that is not
Prometheus text gives a reading that says so, never an exception and never a wait without end.
Only http(s) URLs are fetched. Parsing is prometheus_client's own parser.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field

#: The most a metrics page may be; a vLLM page with histograms is ~100 KiB.
MAX_PAGE_BYTES = 8 << 20
#: Usage at which a warning is raised before the server starts preempting (vLLM preempts when no
#: free block is left for a running request's next token).
WARN_USAGE = 0.90
#: Warn when the usage trend reaches 1.0 within this many seconds.
WARN_HORIZON_S = 60.0

DOWN, SLOW, DROPPED, HTTP_ERROR, GARBAGE, OK = "down", "slow", "dropped", "http error", "garbage", "ok"


class ScrapeError(ValueError):
    """A URL watch refuses (said in one line)."""


def metrics_url(url: str) -> str:
    """``url`` checked (http or https only) with ``/metrics`` added when it names no path."""
    text = str(url).strip()
    if "://" not in text:
        text = "http://" + text
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"{url!r}: give an http(s) URL such as http://127.0.0.1:8000")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def models_url(url: str) -> str:
    """The OpenAI-style model list beside a metrics URL: ``.../metrics`` -> ``.../v1/models`` (the root
    for the usual ``/metrics``)."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path[: -len("/metrics")] if parts.path.endswith("/metrics") else ""
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + "/v1/models", "", ""))


@dataclass(frozen=True)
class Fetched:
    status: str  # OK or what went wrong
    problem: str | None
    body: bytes = b""
    seconds: float = 0.0


def fetch(url: str, timeout: float = 2.0, max_bytes: int = MAX_PAGE_BYTES) -> Fetched:
    """GET ``url``; the answer within ``timeout`` seconds in all (connect, headers, body), else SLOW.

    The request runs on a daemon thread that is waited for ``timeout`` seconds: a server that trickles
    its headers or its body byte by byte cannot hold the caller longer (the thread itself ends at its
    socket's next timeout). Never raises.
    """
    import threading

    box: list[Fetched] = []
    worker = threading.Thread(target=lambda: box.append(_fetch(url, timeout, max_bytes)), daemon=True,
                              name="kvscope-scrape")
    start = time.monotonic()
    worker.start()
    worker.join(timeout + 0.25)
    if not box:
        return Fetched(SLOW, f"no complete answer within {timeout:g} s", seconds=time.monotonic() - start)
    return box[0]


def _fetch(url: str, timeout: float, max_bytes: int) -> Fetched:
    start = time.monotonic()
    deadline = start + timeout

    def took() -> float:
        return time.monotonic() - start

    try:
        request = urllib.request.Request(url, headers={"User-Agent": "kvscope-watch", "Accept": "text/plain"})
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http/https only, checked)
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Fetched(SLOW, f"the answer took more than {timeout:g} s", seconds=took())
                chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
                if not chunk:
                    if getattr(response, "length", None):  # Content-Length promised more than came
                        return Fetched(DROPPED, f"the connection closed mid-answer ({response.length:,} bytes "
                                                "short)", seconds=took())
                    break
                size += len(chunk)
                if size > max_bytes:
                    return Fetched(GARBAGE, f"the page is larger than {max_bytes >> 20} MiB", seconds=took())
                chunks.append(chunk)
            return Fetched(OK, None, b"".join(chunks), took())
    except urllib.error.HTTPError as exc:
        return Fetched(HTTP_ERROR, f"HTTP {exc.code} {exc.reason}", seconds=took())
    except (socket.timeout, TimeoutError):
        return Fetched(SLOW, f"no answer within {timeout:g} s", seconds=took())
    except (http.client.IncompleteRead, http.client.RemoteDisconnected, ConnectionResetError,
            http.client.BadStatusLine, BrokenPipeError) as exc:
        return Fetched(DROPPED, f"the connection closed mid-answer ({type(exc).__name__})", seconds=took())
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return Fetched(SLOW, f"no answer within {timeout:g} s", seconds=took())
        if isinstance(reason, ConnectionRefusedError):
            return Fetched(DOWN, "connection refused (nothing listens there)", seconds=took())
        if isinstance(reason, (ConnectionResetError, http.client.RemoteDisconnected)):
            return Fetched(DROPPED, "the connection closed mid-answer", seconds=took())
        return Fetched(DOWN, str(getattr(reason, "strerror", None) or reason), seconds=took())
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Fetched(DROPPED, f"{type(exc).__name__}: {exc}", seconds=took())


# ------------------------------------------------------------------------------------------------
# Reading a page


@dataclass
class Page:
    """The samples of one page: {name: [(labels, value)]}, names as the page spells them."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def first(self, *names: str) -> float | None:
        for name in names:
            for _, value in self.samples.get(name, ()):
                if math.isfinite(value):
                    return value
        return None

    def total(self, *names: str) -> float | None:
        """Sum over the label sets of the first name present (e.g. several vLLM engines)."""
        for name in names:
            values = [v for _, v in self.samples.get(name, ()) if math.isfinite(v)]
            if values:
                return sum(values)
        return None

    def labels(self, name: str) -> dict[str, str] | None:
        rows = self.samples.get(name)
        return dict(rows[0][0]) if rows else None


def parse_page(text: str) -> Page:
    """Parse Prometheus text with prometheus_client's parser; ValueError if it is not that."""
    from prometheus_client.parser import text_string_to_metric_families

    page = Page()
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                page.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"not Prometheus text ({exc})") from None
    return page


def _int(text: str | None) -> int | None:
    try:
        value = int(str(text))
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class ServerReading:
    """One scrape of one server. Figures a server does not publish are None."""

    url: str
    time_s: float  # time.time()
    status: str
    problem: str | None = None
    engine: str | None = None  # vllm | sglang | llama.cpp | tgi | kvscope
    model: str | None = None  # as the server names it
    kv_usage: float | None = None  # fraction of the KV cache in use
    kv_tokens: int | None = None  # tokens in the KV cache
    kv_capacity_tokens: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None  # cumulative
    kv_bytes: int | None = None  # the predictor's bytes for kv_tokens (or the exporter's own)
    kv_capacity_bytes: int | None = None
    kv_bytes_predicted: int | None = None  # KV Scope's exporter only
    note: str | None = None  # what a figure means where it is not plain (llama.cpp's high-water mark)
    warning: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def read_page(url: str, page: Page) -> dict:
    """The KV figures of a parsed page, by engine; {} when no known metric is on it."""
    names = set(page.samples)
    if any(n.startswith("vllm:") for n in names):
        info = page.labels("vllm:cache_config_info") or {}
        blocks, block = _int(info.get("num_gpu_blocks")), _int(info.get("block_size"))
        usage = page.first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        capacity = blocks * block if blocks and block else None
        model = next((lab.get("model_name") for rows in page.samples.values() for lab, _ in rows if lab.get("model_name")), None)
        return dict(engine="vllm", model=model, kv_usage=usage, num_gpu_blocks=blocks, block_size=block,
                    kv_capacity_tokens=capacity,
                    kv_tokens=round(usage * capacity) if usage is not None and capacity else None,
                    running=page.total("vllm:num_requests_running"), waiting=page.total("vllm:num_requests_waiting"),
                    preemptions=page.total("vllm:num_preemptions_total", "vllm:num_preemptions"),
                    cache_dtype=info.get("cache_dtype"))
    if any(n.startswith("sglang:") for n in names):
        usage = page.first("sglang:token_usage", "sglang:kv_cache_usage_perc")
        used = page.first("sglang:num_used_tokens")
        capacity = page.first("sglang:max_total_num_tokens", "sglang:kv_cache_total_tokens")
        if capacity is None and used is not None and usage:
            capacity = used / usage
        model = next((lab.get("model_name") for rows in page.samples.values() for lab, _ in rows if lab.get("model_name")), None)
        return dict(engine="sglang", model=model, kv_usage=usage,
                    kv_tokens=int(used) if used is not None else None,
                    kv_capacity_tokens=round(capacity) if capacity else None,
                    running=page.total("sglang:num_running_reqs"), waiting=page.total("sglang:num_queue_reqs"))
    if any(n.startswith("llamacpp:") for n in names):
        usage = page.first("llamacpp:kv_cache_usage_ratio")
        tokens = page.first("llamacpp:kv_cache_tokens")
        note = None
        if usage is None and tokens is None:
            high = page.first("llamacpp:n_tokens_max", "llamacpp:n_tokens_max_total")  # the parser adds _total to a counter
            note = ("no live KV figure on this build's /metrics; n_tokens_max "
                    f"{int(high):,} is a high-water mark" if high is not None else "no live KV figure on /metrics")
        return dict(engine="llama.cpp", kv_usage=usage, kv_tokens=int(tokens) if tokens is not None else None,
                    running=page.total("llamacpp:requests_processing"), waiting=page.total("llamacpp:requests_deferred"),
                    note=note)
    if any(n.startswith("tgi_") for n in names):
        tokens = page.first("tgi_batch_current_max_tokens")
        return dict(engine="tgi", kv_tokens=int(tokens) if tokens is not None else None,
                    running=page.total("tgi_batch_current_size"), waiting=page.total("tgi_queue_size"),
                    note="tgi_batch_current_max_tokens: tokens the current batch may hold (no usage fraction)")
    if "kvscope_kv_cache_observed_bytes" in names or "kvscope_run_info" in names:
        info = page.labels("kvscope_run_info") or {}
        observed = page.first("kvscope_kv_cache_observed_bytes")
        predicted = page.first("kvscope_kv_cache_predicted_bytes")
        tokens = page.first("kvscope_context_tokens")
        return dict(engine="kvscope", model=info.get("model") or None,
                    kv_bytes=int(observed) if observed is not None else None,
                    kv_bytes_predicted=int(predicted) if predicted is not None else None,
                    kv_tokens=int(tokens) if tokens is not None else None)
    return {}


# ------------------------------------------------------------------------------------------------
# The model's KV per token


def preset_for(served_name: str | None) -> str | None:
    """A bundled preset whose name matches what a server calls its model (``meta-llama/Meta-Llama-3-8B-Instruct``
    -> ``llama-3-8b``), else None. No download: anything else needs ``--model``."""
    if not served_name:
        return None
    from core.spec import preset_names

    def norm(s: str) -> str:
        s = s.lower().rsplit("/", 1)[-1]
        s = re.sub(r"^meta-", "", s)
        s = re.sub(r"-(instruct|chat|hf|it|base)$", "", s)
        return re.sub(r"[^a-z0-9.]", "", s)

    wanted = norm(served_name)
    for name in preset_names():
        if norm(name) == wanted:
            return name
    return None


def served_models(url: str, timeout: float) -> tuple[str | None, int | None]:
    """(model id, max_model_len) from the server's OpenAI-style ``/v1/models``; (None, None) on any failure."""
    got = fetch(models_url(url), timeout=timeout, max_bytes=1 << 20)
    if got.status != OK:
        return None, None
    try:
        data = json.loads(got.body.decode("utf-8"))
        first = data["data"][0]
        ident = str(first["id"])
        max_len = first.get("max_model_len")
        return ident, int(max_len) if isinstance(max_len, int) and not isinstance(max_len, bool) else None
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError):
        return None, None


class Watcher:
    """Scrapes one server each ``scrape()``; keeps what a trend needs (the last reading) and the model."""

    def __init__(self, url: str, spec=None, timeout: float = 2.0, warn_usage: float = WARN_USAGE,
                 ask_models: bool = True) -> None:
        self.url = metrics_url(url)
        self.spec = spec
        self.timeout = timeout
        self.warn_usage = warn_usage
        self.ask_models = ask_models and spec is None
        self._previous: ServerReading | None = None
        self._model_note: str | None = None

    def _resolve_model(self, served: str | None) -> None:
        if self.spec is not None or not self.ask_models:
            return
        self.ask_models = False  # once per server
        name = served
        if name is None:
            name, _ = served_models(self.url, self.timeout)
        preset = preset_for(name)
        if preset is None:
            self._model_note = (f"model {name!r}: give --model for bytes" if name else "give --model for bytes")
            return
        from core.spec import load_spec

        self.spec = load_spec(preset)

    def _bytes(self, tokens: int | None, cache_dtype: str | None) -> int | None:
        if tokens is None or self.spec is None:
            return None
        from core.predict import kv_bytes
        from core.settings import RunSettings

        kv_dtype = "fp8" if cache_dtype and cache_dtype.startswith("fp8") else None
        return kv_bytes(self.spec, RunSettings(kv_dtype=kv_dtype), tokens) if tokens > 0 else 0

    def scrape(self) -> ServerReading:
        """One bounded scrape; a reading whatever happened."""
        now = time.time()
        got = fetch(self.url, timeout=self.timeout)
        if got.status != OK:
            reading = ServerReading(self.url, now, got.status, got.problem, seconds=got.seconds)
            self._previous = None
            return reading
        try:
            text = got.body.decode("utf-8")
            figures = read_page(self.url, parse_page(text))
        except (UnicodeDecodeError, ValueError) as exc:
            reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc)
            return ServerReading(self.url, now, GARBAGE, reason, seconds=got.seconds)
        if not figures:
            return ServerReading(self.url, now, GARBAGE, "no inference-server metrics on this page", seconds=got.seconds)
        cache_dtype = figures.pop("cache_dtype", None)
        if figures["engine"] != "kvscope":
            self._resolve_model(figures.get("model"))
            figures["kv_bytes"] = self._bytes(figures.get("kv_tokens"), cache_dtype)
            figures["kv_capacity_bytes"] = self._bytes(figures.get("kv_capacity_tokens"), cache_dtype)
            if figures["kv_bytes"] is None and self._model_note and not figures.get("note"):
                figures["note"] = self._model_note
        reading = ServerReading(self.url, now, OK, seconds=got.seconds, **figures)
        reading = _with_warning(reading, self._previous, self.warn_usage)
        self._previous = reading
        return reading


def _with_warning(now: ServerReading, before: ServerReading | None, warn_usage: float) -> ServerReading:
    """A warning before the server preempts: preempting already, the cache nearly full, or full soon at
    the current rate, or requests waiting with the cache nearly full."""
    from dataclasses import replace

    if before is not None and now.preemptions is not None and before.preemptions is not None \
            and now.preemptions > before.preemptions:
        return replace(now, warning=f"preempting: {now.preemptions - before.preemptions:g} preemptions since the last scrape")
    usage = now.kv_usage
    if usage is None:
        return now
    if usage >= warn_usage:
        queued = f", {now.waiting:g} waiting" if now.waiting else ""
        return replace(now, warning=f"KV cache {usage:.0%} full{queued}: the server preempts when no block is left")
    if before is not None and before.kv_usage is not None and now.time_s > before.time_s:
        rate = (usage - before.kv_usage) / (now.time_s - before.time_s)
        if rate > 0:
            eta = (1.0 - usage) / rate
            if eta <= WARN_HORIZON_S:
                return replace(now, warning=f"KV cache full in about {eta:.0f} s at this rate: preemption follows")
    return now


def render_reading(r: ServerReading) -> str:
    """One line for the terminal."""
    from core.safe_text import safe_text  # the server's names and words, escaped
    from core.spec import human_bytes

    stamp = time.strftime("%H:%M:%S", time.localtime(r.time_s))
    if r.status != OK:
        return safe_text(f"{stamp}  {r.url}  {r.status.upper()}: {r.problem}")
    parts = [f"{stamp}  {r.url}  {r.engine}" + (f" ({r.model})" if r.model else "")]
    if r.engine == "kvscope":
        parts.append(f"KV observed {human_bytes(r.kv_bytes)}, predicted {human_bytes(r.kv_bytes_predicted)}")
    else:
        kv = []
        if r.kv_usage is not None:
            kv.append(f"{r.kv_usage:.1%}")
        if r.kv_tokens is not None:
            kv.append(f"{r.kv_tokens:,}" + (f" of {r.kv_capacity_tokens:,}" if r.kv_capacity_tokens else "") + " tokens")
        if r.kv_bytes is not None:
            kv.append(human_bytes(r.kv_bytes) + (f" of {human_bytes(r.kv_capacity_bytes)}" if r.kv_capacity_bytes else "")
                      + " (predicted bytes)")
        parts.append("KV " + (", ".join(kv) if kv else "n/a"))
    if r.running is not None or r.waiting is not None:
        parts.append(f"running {r.running:g}" if r.running is not None else "running n/a")
        parts.append(f"waiting {r.waiting:g}" if r.waiting is not None else "waiting n/a")
    if r.preemptions is not None:
        parts.append(f"preemptions {r.preemptions:g}")
    line = "  ".join(parts)
    if r.note:
        line += f"  [{r.note}]"
    if r.warning:
        line += f"  WARNING: {r.warning}"
    return safe_text(line)


def watch(urls: list[str], spec=None, interval: float = 2.0, count: int | None = None, timeout: float = 2.0,
          warn_usage: float = WARN_USAGE, emit=print, should_stop=lambda: False) -> list[ServerReading]:
    """Scrape every server each ``interval`` seconds, ``count`` rounds (None: until ``should_stop``),
    all servers at once (one thread each, each bounded by ``timeout``); ``emit`` gets every reading.
    Returns the last round."""
    from concurrent.futures import ThreadPoolExecutor

    watchers = [Watcher(u, spec=spec, timeout=timeout, warn_usage=warn_usage) for u in urls]
    last: list[ServerReading] = []
    done = 0
    with ThreadPoolExecutor(max_workers=min(16, len(watchers)), thread_name_prefix="kvscope-watch") as pool:
        while count is None or done < count:
            start = time.monotonic()
            last = list(pool.map(lambda w: w.scrape(), watchers))
            for reading in last:
                emit(reading)
            done += 1
            if should_stop() or (count is not None and done >= count):
                break
            pause = interval - (time.monotonic() - start)
            while pause > 0 and not should_stop():
                time.sleep(min(pause, 0.1))
                pause -= 0.1
    return last
