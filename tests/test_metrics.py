"""The Prometheus exporter (kvscope.core.live.metrics): served by prometheus_client on 127.0.0.1, scraped over HTTP with
urllib, parsed with prometheus_client's own parser, and compared with the real embedded model's samples."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.core.base.sample import Sample
from kvscope.core.live.metrics import LOOPBACK, MetricsError, MetricsExporter, RunCollector, check_bind
from kvscope.core.live.run import RunHooks, run_generation
from kvscope.core.model.request import RunRequest
from kvscope.core.runtimes import parse_switch

ROOT = Path(__file__).resolve().parent.parent


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the page at ``url`` (2 s timeout: never hangs a test)."""
    with urllib.request.urlopen(url, timeout=2) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sample(**kw) -> Sample:
    base = dict(token=1, phase="decode", time_s=0.1, text="x", attention="mha", attn_impl="sdpa", cache="dynamic",
                kernel="sdpa-math", device="cpu", dtype="float32", kv_bytes_held=100, kv_bytes_reserved=100,
                kv_bytes_storage=100,
                weights_bytes=1000)
    base.update(kw)
    return Sample(**base)


def test_page_matches_every_sample_of_a_real_run():
    """The embedded model generates 24 tokens with two live switches; at every token the exporter is
    scraped from inside the emit hook, so the page must carry exactly that Sample's figures."""
    collector = RunCollector(model="embedded", device="cpu")
    checked = []
    with MetricsExporter(collector, LOOPBACK, 0) as exporter:
        assert exporter.port > 0 and exporter.url.startswith("http://127.0.0.1:")

        def emit(s: Sample) -> None:
            collector.observe(s)
            if s.phase == "event":
                return
            page = scrape(exporter.url)
            assert page[("kvscope_kv_cache_observed_bytes", ())] == s.kv_bytes_reserved
            assert page[("kvscope_kv_cache_predicted_bytes", ())] == s.kv_bytes_predicted
            assert page[("kvscope_weights_bytes", ())] == s.weights_bytes
            assert page[("kvscope_predicted_bytes", (("part", "total"),))] == s.total_predicted
            assert page[("kvscope_generated_tokens", ())] == s.token
            assert page[("kvscope_context_tokens", ())] == s.context_tokens
            assert page[("kvscope_process_memory_bytes", (("kind", "rss"),))] == s.process_rss
            if s.tokens_per_s is not None:
                assert page[("kvscope_tokens_per_second", ())] == pytest.approx(s.tokens_per_s)
            # what the CPU cannot report is absent, never 0
            if s.device_used is None:
                assert not any(name == "kvscope_device_memory_bytes" and dict(labels).get("kind") == "used"
                               for name, labels in page)
            info = {dict(labels)["attention"]: dict(labels) for name, labels in page if name == "kvscope_run_info"}
            assert info[s.attention]["cache"] == s.cache and info[s.attention]["kernel"] == s.kernel
            checked.append(s.token)

        request = RunRequest(max_new_tokens=24, device="cpu",
                             switches=(parse_switch("8:attention=gqa:2"), parse_switch("16:attention=mqa")))
        run_generation(request, RunHooks(emit=emit))
        collector.finish()
        page = scrape(exporter.url)
    assert checked == list(range(0, 25))
    assert page[("kvscope_events_total", (("event", "switch"),))] == 2
    assert sum(v for (name, _), v in page.items() if name == "kvscope_spikes_total") == sum(collector.spikes.values())


def test_spikes_are_counted_by_cause():
    collector = RunCollector(device="cpu")  # 4 MiB threshold on the CPU
    t = 0.0
    for i in range(30):
        t += 0.05
        collector.observe(_sample(token=i, time_s=t, process_rss=100 << 20))
    collector.observe(_sample(token=30, time_s=t + 0.05, process_rss=300 << 20))
    for i in range(31, 45):
        collector.observe(_sample(token=i, time_s=t + 0.05 * (i - 29), process_rss=300 << 20))
    collector.finish()
    with MetricsExporter(collector) as exporter:
        page = scrape(exporter.url)
    spikes = {dict(labels)["cause"]: v for (name, labels), v in page.items() if name == "kvscope_spikes_total"}
    assert sum(spikes.values()) == 1 and spikes == {k: 1 for k in spikes}


def test_loopback_by_default_and_explicit_hosts():
    exporter = MetricsExporter(RunCollector())
    assert exporter.host == "127.0.0.1"
    with pytest.raises(MetricsError):
        check_bind(LOOPBACK, 70000)
    with pytest.raises(MetricsError):
        check_bind("", 0)
    # a port in use is one line, not a traceback
    with MetricsExporter(RunCollector()) as first:
        with pytest.raises(MetricsError, match="cannot serve"):
            MetricsExporter(RunCollector(), LOOPBACK, first.port).start()


def test_empty_page_before_the_first_sample():
    with MetricsExporter(RunCollector()) as exporter:
        page = scrape(exporter.url)
    assert not any(name.startswith("kvscope_kv_cache") for name, _ in page)


def test_cli_run_serves_metrics():
    """`run --metrics-port 0` says where, serves while it runs and lingers for a last scrape."""
    proc = subprocess.Popen([sys.executable, "main.py", "run", "--tokens", "16", "--device", "cpu", "--metrics-port", "0",
                             "--metrics-linger", "20"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "Prometheus metrics at " in line:
                url = line.split("Prometheus metrics at ", 1)[1].split()[0]
        assert url and url.startswith("http://127.0.0.1:"), url
        page = {}
        while time.monotonic() < deadline:
            page = scrape(url)
            if page.get(("kvscope_generated_tokens", ())) == 16:
                break
            time.sleep(0.2)
        assert page[("kvscope_generated_tokens", ())] == 16
        assert page[("kvscope_kv_cache_observed_bytes", ())] == page[("kvscope_kv_cache_predicted_bytes", ())]
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    bad = subprocess.run([sys.executable, "main.py", "run", "--metrics-host", "0.0.0.0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "needs --metrics-port" in bad.stderr


def test_grafana_dashboard_plots_only_what_the_exporter_serves():
    """packaging/grafana-kvscope.json: valid JSON for Grafana's import, every query names metrics the
    exporter really serves (checked against a page with every figure present)."""
    import json
    import re

    dash = json.loads((ROOT / "packaging" / "grafana-kvscope.json").read_text())
    assert dash["__inputs"][0]["pluginId"] == "prometheus" and dash["panels"]
    collector = RunCollector(model="m")
    collector.observe(_sample(allocator_allocated=1, allocator_reserved=2, allocator_peak=3, device_used=4,
                              device_total=5, process_gpu=6, process_rss=7, kv_bytes_predicted=100,
                              weights_predicted=1000, activations_predicted=10, total_predicted=1110, tokens_per_s=9.0))
    collector.observe(_sample(phase="event", event="switch", token=2, time_s=0.2))
    with MetricsExporter(collector) as exporter:
        served = {name for name, _ in scrape(exporter.url)}
        with urllib.request.urlopen(exporter.url, timeout=2) as response:  # a counter with no series yet (spikes)
            served |= {f.name + "_total" for f in text_string_to_metric_families(response.read().decode())
                       if f.type == "counter"}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    used = {m for e in exprs for m in re.findall(r"\bkvscope_[a-z_]+", e)}
    assert {"kvscope_kv_cache_observed_bytes", "kvscope_kv_cache_predicted_bytes"} <= used
    assert used <= served, used - served
    titles = " ".join(p["title"] for p in dash["panels"])
    assert "observed vs predicted" in titles and "Memory" in titles


def test_the_window_exports_its_run(qtbot, window):
    """The window (engine in its own process) with an exporter among its sample observers, as
    `python main.py --metrics-port PORT` sets it up: the page carries the last Sample the window took."""
    collector = RunCollector(model="embedded")
    taken = []
    window.sample_observers.extend([collector.observe, taken.append])
    with MetricsExporter(collector) as exporter:
        with qtbot.waitSignal(window.run_finished, timeout=180_000):
            window.start_run(RunRequest(source="embedded", device="cpu", max_new_tokens=12))
        page = scrape(exporter.url)
    last = [s for s in taken if s.phase != "event"][-1]
    assert last.token == 12
    assert page[("kvscope_generated_tokens", ())] == 12
    assert page[("kvscope_kv_cache_observed_bytes", ())] == last.kv_bytes_reserved == last.kv_bytes_predicted
