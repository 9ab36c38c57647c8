"""`kvscope watch` (kvscope.core.records.scrape): inference servers' /metrics pages read with prometheus_client's parser,
usage turned into bytes with the predictor, and servers that are down, slow, drop the connection or serve
garbage shown as such, within the timeout. Every server here is a test server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvscope.core.base.sample import Sample
from kvscope.core.live.metrics import MetricsExporter, RunCollector
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.sources import load_spec
from kvscope.core.prediction.predict import kv_bytes
from kvscope.core.records.scrape import (DOWN, DROPPED, GARBAGE, HTTP_ERROR, OK, SLOW, ScrapeError, Watcher,
                                         metrics_url, preset_for, render_reading, watch)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "servers"


class Handler(BaseHTTPRequestHandler):
    """Answers by path: /<fixture>/metrics and /<fixture>/v1/models serve tests/fixtures/servers/; /slow,
    /trickle, /drop, /half, /garbage, /html, /missing misbehave in their own way (all bounded)."""

    pages: dict[str, bytes] = {}

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, body: bytes, status: int = 200, ctype: str = "text/plain; version=0.0.4") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path
        if path.startswith("/slow"):
            time.sleep(3)  # longer than the tests' timeout; bounded
            return self._send(b"")
        if path.startswith("/trickle"):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            for _ in range(25):  # 1 byte every 0.2 s: each read is quick, the whole is not
                try:
                    self.wfile.write(b"#")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)
            return
        if path.startswith("/drop"):
            self.connection.shutdown(socket.SHUT_RDWR)  # no answer at all
            return
        if path.startswith("/half"):
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b"vllm:kv_cache_usage_perc 0.")
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if path.startswith("/garbage"):
            return self._send(bytes(range(256)) * 8)
        if path.startswith("/html"):
            return self._send(b"<html><body>It works!</body></html>", ctype="text/html")
        if path.startswith("/nonsense"):
            return self._send(b"vllm:kv_cache_usage_perc{engine=\"0\" 0.5\n")  # unclosed label set
        name, _, rest = path.strip("/").partition("/")
        page = self.pages.get(f"{name}/{rest}")
        if page is None:
            return self._send(b"not found", status=404)
        return self._send(page, ctype="application/json" if rest.endswith("models") else "text/plain; version=0.0.4")


@pytest.fixture(scope="module")
def server():
    pages = {}
    for fixture in FIXTURES.glob("*.txt"):
        pages[f"{fixture.stem}/metrics"] = fixture.read_bytes()
    pages["vllm/v1/models"] = (FIXTURES / "vllm_models.json").read_bytes()
    # The same vLLM page without its model_name labels: the model then comes from /v1/models.
    unlabelled = (FIXTURES / "vllm.txt").read_text().replace(',model_name="meta-llama/Meta-Llama-3-8B-Instruct"', "")
    pages["vllm-bare/metrics"] = unlabelled.encode()
    pages["vllm-bare/v1/models"] = pages["vllm/v1/models"]
    Handler.pages = pages
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="test-metrics-server", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_vllm_page_to_bytes_with_the_model_it_names(server):
    w = Watcher(f"{server}/vllm/metrics", timeout=2)
    r = w.scrape()
    assert r.status == OK and r.engine == "vllm" and r.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert (r.num_gpu_blocks, r.block_size) == (3062, 16)
    assert r.kv_capacity_tokens == 3062 * 16 == 48_992
    assert r.kv_tokens == round(0.42 * 48_992)
    spec = load_spec("llama-3-8b")  # the served name matched to the preset, no download
    assert r.kv_bytes == kv_bytes(spec, RunSettings(), r.kv_tokens) == r.kv_tokens * 131_072
    assert r.kv_capacity_bytes == 48_992 * 131_072
    assert (r.running, r.waiting, r.preemptions) == (8, 0, 0) and r.warning is None
    line = render_reading(r)
    assert "vllm" in line and "42.0%" in line and "predicted bytes" in line


def test_the_model_from_v1_models(server):
    r = Watcher(f"{server}/vllm-bare/metrics", timeout=2).scrape()
    assert r.status == OK and r.model is None  # the page names none
    assert r.kv_bytes == r.kv_tokens * 131_072  # Llama-3-8B, from /v1/models matched to the preset


def test_sglang_llamacpp_tgi_pages(server):
    spec = load_spec("llama-3-8b")  # given by the user: SGLang's page names Llama-3.1, which has no preset
    sg = Watcher(f"{server}/sglang/metrics", spec=spec).scrape()
    assert sg.engine == "sglang" and sg.kv_usage == 0.28 and sg.kv_tokens == 123_859
    assert sg.kv_bytes == 123_859 * 131_072 and sg.waiting == 2826
    assert sg.warning is None
    lc = Watcher(f"{server}/llamacpp/metrics", spec=spec).scrape()
    assert lc.engine == "llama.cpp" and lc.kv_usage is None and lc.kv_bytes is None
    assert "high-water mark" in lc.note and "42,094" in lc.note and lc.running == 1
    tgi = Watcher(f"{server}/tgi/metrics", spec=spec).scrape()
    assert tgi.engine == "tgi" and tgi.kv_tokens == 12_288 and tgi.kv_bytes == 12_288 * 131_072
    assert tgi.waiting == 2
    # without --model and no /v1/models: says what to give, invents nothing
    bare = Watcher(f"{server}/sglang/metrics").scrape()
    assert bare.kv_bytes is None and "--model" in bare.note


def test_warns_before_preemption():
    from dataclasses import replace

    from kvscope.core.records.scrape import ServerReading, _with_warning

    base = ServerReading("u", 100.0, OK, engine="vllm", kv_usage=0.5, preemptions=0, waiting=0)
    assert _with_warning(base, None, 0.9).warning is None
    full = replace(base, kv_usage=0.95, waiting=3)
    assert "95% full, 3 waiting" in _with_warning(full, None, 0.9).warning
    rising = replace(base, time_s=110.0, kv_usage=0.8)  # +0.3 in 10 s: full in about 7 s
    assert "full in about 7 s" in _with_warning(rising, base, 0.9).warning
    preempted = replace(base, time_s=102.0, preemptions=4)
    assert _with_warning(preempted, base, 0.9).warning.startswith("preempting: 4")


@pytest.mark.parametrize("path,status", [
    ("/slow", SLOW), ("/trickle", SLOW), ("/drop", DROPPED), ("/half", DROPPED), ("/garbage", GARBAGE),
    ("/html", GARBAGE), ("/nonsense", GARBAGE), ("/missing/metrics", HTTP_ERROR),
])
def test_misbehaving_servers_show_as_such_within_the_timeout(server, path, status):
    start = time.monotonic()
    r = Watcher(server + path, timeout=0.5, ask_models=False).scrape()
    took = time.monotonic() - start
    assert r.status == status, (r.status, r.problem)
    assert r.problem and took < 1.5, took
    assert r.url in render_reading(r) and status.upper() in render_reading(r)


def test_a_server_that_is_down():
    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = Watcher(f"http://127.0.0.1:{port}", timeout=0.5).scrape()
    assert r.status == DOWN and "refused" in r.problem


def test_kvscope_own_exporter():
    collector = RunCollector(model="embedded")
    collector.observe(Sample(token=5, phase="decode", time_s=0.5, text="x", attention="mha", attn_impl="sdpa",
                             cache="dynamic", kernel="sdpa-math", device="cpu", dtype="float32",
                             kv_bytes_held=221_184, kv_bytes_reserved=221_184, kv_bytes_storage=221_184, weights_bytes=1, kv_bytes_predicted=221_184,
                             context_tokens=27))
    with MetricsExporter(collector) as exporter:
        r = Watcher(exporter.url).scrape()
    assert r.status == OK and r.engine == "kvscope" and r.model == "embedded"
    assert r.kv_bytes == r.kv_bytes_predicted == 221_184 and r.kv_tokens == 27


def test_urls_and_presets():
    assert metrics_url("127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("http://127.0.0.1:8000/custom") == "http://127.0.0.1:8000/custom"
    from kvscope.core.records.scrape import models_url

    assert models_url("http://127.0.0.1:8000/metrics") == "http://127.0.0.1:8000/v1/models"
    assert models_url("http://127.0.0.1:8000/custom") == "http://127.0.0.1:8000/v1/models"
    for bad in ("file:///etc/passwd", "ftp://127.0.0.1/x", "http://"):
        with pytest.raises(ScrapeError):
            metrics_url(bad)
    assert preset_for("meta-llama/Meta-Llama-3-8B-Instruct") == "llama-3-8b"
    assert preset_for("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert preset_for("someone/unknown-13b") is None


def test_watch_rounds_never_block_on_a_slow_server(server):
    seen = []
    start = time.monotonic()
    last = watch([f"{server}/vllm/metrics", f"{server}/slow"], interval=0.2, count=2, timeout=0.5, emit=seen.append)
    assert time.monotonic() - start < 4  # two rounds, the slow one cut at 0.5 s each time
    assert [r.status for r in last] == [OK, SLOW] and len(seen) == 4


def test_cli_watch_json(server):
    out = subprocess.run([sys.executable, "main.py", "watch", f"{server}/vllm/metrics", f"{server}/garbage",
                          "--count", "2", "--interval", "0.2", "--timeout", "1", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["status"] for r in rows] == [OK, GARBAGE, OK, GARBAGE]
    assert rows[0]["kv_bytes"] == rows[0]["kv_tokens"] * 131_072
    bad = subprocess.run([sys.executable, "main.py", "watch", "file:///etc/passwd"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "http(s) URL" in bad.stderr
