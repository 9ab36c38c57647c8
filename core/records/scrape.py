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
- KV Scope's own exporter (``kvscope.core.live.metrics``): observed and predicted KV bytes, as they are.

Every scrape is bounded in time (``timeout`` per request, the whole answer read within it) and in
size; a server that is down, slow, drops the connection or serves something that is not
Prometheus text gives a reading that says so, never an exception and never a wait without end.
Only http(s) URLs are fetched, and a redirect is followed only on the same server (scheme, host and
port): never to ftp://, file:// or another host. Parsing is prometheus_client's own parser.

A server is untrusted input: every figure is range-checked (a usage is a fraction from 0 to 1; counts
of tokens, blocks, requests and bytes are finite, not negative and below a bound no real server
reaches); one that is not is left out (n/a) and the reading says so in ``absurd``. Whatever one
server serves, even what makes our own code fail, is that server's reading (status ``error``): the
other servers go on being watched.
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

from kvscope.core.base.errors import UNAVAILABLE, KVScopeError
from kvscope.core.base.safe_text import safe_text
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import human_bytes, preset_names
from kvscope.core.prediction.predict import kv_bytes

#: The most a metrics page may be; a vLLM page with histograms is ~100 KiB.
MAX_PAGE_BYTES = 8 << 20
#: Usage at which a warning is raised before the server starts preempting (vLLM preempts when no
#: free block is left for a running request's next token).
WARN_USAGE = 0.90
#: Warn when the usage trend reaches 1.0 within this many seconds.
WARN_HORIZON_S = 60.0

DOWN, SLOW, DROPPED, HTTP_ERROR, GARBAGE, OK = "down", "slow", "dropped", "http error", "garbage", "ok"
#: A reading our own code failed on (a bug met by one server's page): that server's row, never the watch's end.
ERROR = "error"
#: Bounds no real server reaches: past them a figure is absurd (flagged, not used). 2^40 tokens is a
#: trillion; a vLLM block holds at most a few hundred tokens; 2^60 bytes is an exbibyte.
MAX_TOKENS = 1 << 40
MAX_BLOCKS = 1 << 40
MAX_BLOCK_SIZE = 1 << 20
MAX_REQUESTS = 1 << 32
MAX_BYTES = 1 << 60
#: Redirects followed, on the same server only.
MAX_REDIRECTS = 4


class ScrapeError(KVScopeError, ValueError):
    """A URL watch refuses (said in one line)."""

    category = UNAVAILABLE


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


def _server(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL: what a redirect may not change."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:  # a port that is not a number
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


class _SameServerRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the same scheme, host and port as the URL asked (``/metrics`` moved to
    ``/metrics/``), at most ``MAX_REDIRECTS``; to another host or scheme (ftp://, file://, a server elsewhere)
    the answer is an HTTP error that says where it pointed."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, origin: str) -> None:
        super().__init__()
        self.origin = _server(origin)

    def http_error_302(self, req, fp, code, msg, headers):  # noqa: D102 (urllib's hook, before its own checks)
        location = headers.get("location") or headers.get("uri")
        if location:
            target = urllib.parse.urljoin(req.full_url, location)
            if _server(target) != self.origin:
                raise urllib.error.HTTPError(target, code, f"redirect to {target[:120]} refused: it leaves "
                                                           f"{self.origin[0]}://{self.origin[1]}:{self.origin[2]}",
                                             headers, fp)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _fetch(url: str, timeout: float, max_bytes: int) -> Fetched:
    start = time.monotonic()
    deadline = start + timeout

    def took() -> float:
        return time.monotonic() - start

    try:
        request = urllib.request.Request(url, headers={"User-Agent": "kvscope-watch", "Accept": "text/plain"})
        opener = urllib.request.build_opener(_SameServerRedirects(url))
        with opener.open(request, timeout=timeout) as response:  # noqa: S310 (http/https only, checked)
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
        return Fetched(HTTP_ERROR, f"HTTP {exc.code} {exc.reason}"[:300], seconds=took())
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
        """The first value of the first name present, as served (NaN and inf too: the checks flag them)."""
        for name in names:
            for _, value in self.samples.get(name, ()):
                return value
        return None

    def total(self, *names: str) -> float | None:
        """Sum over the label sets of the first name present (e.g. several vLLM engines); a sum that
        overflows is inf, flagged by the checks."""
        for name in names:
            values = [v for _, v in self.samples.get(name, ())]
            if values:
                return math.fsum(values) if all(math.isfinite(v) for v in values) else sum(values)
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


class Figures:
    """Range checks of one page's figures: each ``fraction``/``count`` gives the value or None, and what was
    absurd (NaN, inf, negative, past its bound) is kept in ``absurd``, one phrase each."""

    def __init__(self) -> None:
        self.absurd: list[str] = []

    def _flag(self, name: str, value, why: str) -> None:
        shown = f"{value:g}" if isinstance(value, float) else str(value)[:24]
        self.absurd.append(f"{name} {shown} {why}")

    def fraction(self, name: str, value: float | None) -> float | None:
        """A usage: a finite fraction from 0 to 1 (a rounding hair above 1 is 1)."""
        if value is None:
            return None
        if not math.isfinite(value) or value < 0 or value > 1.0 + 1e-9:
            self._flag(name, value, "is not a fraction from 0 to 1")
            return None
        return min(value, 1.0)

    def count(self, name: str, value: float | None, limit: int) -> float | None:
        """A count (tokens, requests, bytes): finite, not negative, at most ``limit``."""
        if value is None:
            return None
        if not math.isfinite(value):
            self._flag(name, value, "is not a number")
            return None
        if value < 0:
            self._flag(name, value, "is negative")
            return None
        if value > limit:
            self._flag(name, value, f"is past any real server (more than {limit:,})")
            return None
        return value

    def whole(self, name: str, value: float | None, limit: int) -> int | None:
        checked = self.count(name, value, limit)
        return int(checked) if checked is not None else None

    def label_int(self, name: str, text: str | None, limit: int) -> int | None:
        """A positive whole number in a label (vLLM's cache_config_info), at most ``limit``."""
        if text is None or str(text) in ("", "None"):
            return None
        text = str(text).strip()
        if not text.isdigit() or len(text) > 20:
            self._flag(name, text, "is not a whole number of at most 20 digits")
            return None
        value = int(text)
        if value == 0:
            return None  # not known yet (vLLM publishes 0 before its profiling run)
        if value > limit:
            self._flag(name, value, f"is past any real server (more than {limit:,})")
            return None
        return value


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
    absurd: str | None = None  # figures the page served that no real server can have (left out as n/a)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def read_page(url: str, page: Page) -> dict:
    """The KV figures of a parsed page, by engine, range-checked; {} when no known metric is on it. A figure
    that is absurd is None, and ``absurd`` (a list, possibly empty) says what the page claimed."""
    names = set(page.samples)
    check = Figures()
    figures = _read_engine(names, page, check)
    if figures:
        figures["absurd"] = check.absurd
    return figures


def _model_label(page: Page) -> str | None:
    return next((lab.get("model_name") for rows in page.samples.values() for lab, _ in rows if lab.get("model_name")),
                None)


def _read_engine(names: set[str], page: Page, check: Figures) -> dict:
    if any(n.startswith("vllm:") for n in names):
        info = page.labels("vllm:cache_config_info") or {}
        blocks = check.label_int("num_gpu_blocks", info.get("num_gpu_blocks"), MAX_BLOCKS)
        block = check.label_int("block_size", info.get("block_size"), MAX_BLOCK_SIZE)
        usage = check.fraction("kv_cache_usage_perc", page.first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
        capacity = blocks * block if blocks and block else None
        if capacity is not None and capacity > MAX_TOKENS:
            check.absurd.append(f"capacity {capacity:,} tokens (num_gpu_blocks x block_size) is past any real server")
            capacity = None
        return dict(engine="vllm", model=_model_label(page), kv_usage=usage, num_gpu_blocks=blocks, block_size=block,
                    kv_capacity_tokens=capacity,
                    kv_tokens=round(usage * capacity) if usage is not None and capacity else None,
                    running=check.count("running", page.total("vllm:num_requests_running"), MAX_REQUESTS),
                    waiting=check.count("waiting", page.total("vllm:num_requests_waiting"), MAX_REQUESTS),
                    preemptions=check.count("preemptions", page.total("vllm:num_preemptions_total",
                                                                      "vllm:num_preemptions"), MAX_TOKENS),
                    cache_dtype=info.get("cache_dtype"))
    if any(n.startswith("sglang:") for n in names):
        usage = check.fraction("token_usage", page.first("sglang:token_usage", "sglang:kv_cache_usage_perc"))
        used = check.whole("num_used_tokens", page.first("sglang:num_used_tokens"), MAX_TOKENS)
        capacity = check.count("max_total_num_tokens", page.first("sglang:max_total_num_tokens",
                                                                  "sglang:kv_cache_total_tokens"), MAX_TOKENS)
        if capacity is None and used is not None and usage:
            capacity = check.count("capacity (num_used_tokens / token_usage)", used / usage, MAX_TOKENS)
        return dict(engine="sglang", model=_model_label(page), kv_usage=usage, kv_tokens=used,
                    kv_capacity_tokens=round(capacity) if capacity else None,
                    running=check.count("running", page.total("sglang:num_running_reqs"), MAX_REQUESTS),
                    waiting=check.count("waiting", page.total("sglang:num_queue_reqs"), MAX_REQUESTS))
    if any(n.startswith("llamacpp:") for n in names):
        usage = check.fraction("kv_cache_usage_ratio", page.first("llamacpp:kv_cache_usage_ratio"))
        tokens = check.whole("kv_cache_tokens", page.first("llamacpp:kv_cache_tokens"), MAX_TOKENS)
        note = None
        if usage is None and tokens is None:
            # the parser adds _total to a counter
            high = check.whole("n_tokens_max", page.first("llamacpp:n_tokens_max", "llamacpp:n_tokens_max_total"),
                               MAX_TOKENS)
            note = ("no live KV figure on this build's /metrics; n_tokens_max "
                    f"{high:,} is a high-water mark" if high is not None else "no live KV figure on /metrics")
        return dict(engine="llama.cpp", kv_usage=usage, kv_tokens=tokens,
                    running=check.count("running", page.total("llamacpp:requests_processing"), MAX_REQUESTS),
                    waiting=check.count("waiting", page.total("llamacpp:requests_deferred"), MAX_REQUESTS),
                    note=note)
    if any(n.startswith("tgi_") for n in names):
        return dict(engine="tgi",
                    kv_tokens=check.whole("tgi_batch_current_max_tokens", page.first("tgi_batch_current_max_tokens"),
                                          MAX_TOKENS),
                    running=check.count("running", page.total("tgi_batch_current_size"), MAX_REQUESTS),
                    waiting=check.count("waiting", page.total("tgi_queue_size"), MAX_REQUESTS),
                    note="tgi_batch_current_max_tokens: tokens the current batch may hold (no usage fraction)")
    if "kvscope_kv_cache_observed_bytes" in names or "kvscope_run_info" in names:
        info = page.labels("kvscope_run_info") or {}
        return dict(engine="kvscope", model=info.get("model") or None,
                    kv_bytes=check.whole("kv_cache_observed_bytes", page.first("kvscope_kv_cache_observed_bytes"),
                                         MAX_BYTES),
                    kv_bytes_predicted=check.whole("kv_cache_predicted_bytes",
                                                   page.first("kvscope_kv_cache_predicted_bytes"), MAX_BYTES),
                    kv_tokens=check.whole("context_tokens", page.first("kvscope_context_tokens"), MAX_TOKENS))
    return {}


# ------------------------------------------------------------------------------------------------
# The model's KV per token


def preset_for(served_name: str | None) -> str | None:
    """A bundled preset whose name matches what a server calls its model (``meta-llama/Meta-Llama-3-8B-Instruct``
    -> ``llama-3-8b``), else None. No download: anything else needs ``--model``."""
    if not served_name:
        return None

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
        ident = str(first["id"])[:200]
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

        self.spec = load_spec(preset)

    def _bytes(self, tokens: int | None, cache_dtype: str | None) -> int | None:
        if tokens is None or self.spec is None:
            return None

        kv_dtype = "fp8" if cache_dtype and cache_dtype.startswith("fp8") else None
        return kv_bytes(self.spec, RunSettings(kv_dtype=kv_dtype), tokens) if tokens > 0 else 0

    def scrape(self) -> ServerReading:
        """One bounded scrape; a reading whatever happened, never an exception: what our own code failed on
        (one server's page meeting a bug) is this server's reading, status ``error``."""
        try:
            return self._scrape()
        except Exception as exc:  # noqa: BLE001 - isolated to this server's row; the others go on
            self._previous = None
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            return ServerReading(self.url, time.time(), ERROR,
                                 f"internal error on this server's page: {type(exc).__name__}: {first}")

    def _scrape(self) -> ServerReading:
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
        absurd = figures.pop("absurd", None)
        if figures.get("model"):
            figures["model"] = str(figures["model"])[:200]  # a label of megabytes is not a name
        figures["absurd"] = "; ".join(absurd) if absurd else None
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
    if r.absurd:
        line += f"  ABSURD (left out): {r.absurd}"
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
