"""The Servers tab: readings arrive from its own thread and fill the table and the plot; a server that
is down shows as such and never holds the window. Test servers on 127.0.0.1 only."""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from kvscope.core.base.sample import Sample
from kvscope.core.live.metrics import MetricsExporter, RunCollector
from tests.test_watch import FIXTURES, Handler

pytest.importorskip("pytestqt")


@pytest.fixture
def servers():
    Handler.pages = {f"{f.stem}/metrics": f.read_bytes() for f in FIXTURES.glob("*.txt")}
    Handler.pages["vllm/v1/models"] = (FIXTURES / "vllm_models.json").read_bytes()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="test-servers-tab", daemon=True).start()
    collector = RunCollector(model="embedded")
    collector.observe(Sample(token=3, phase="decode", time_s=0.3, text="x", attention="mha", attn_impl="sdpa",
                             cache="dynamic", kernel="sdpa-math", device="cpu", dtype="float32",
                             kv_bytes_held=196_608, kv_bytes_reserved=196_608, kv_bytes_storage=196_608, weights_bytes=1,
                             kv_bytes_predicted=196_608, context_tokens=24))
    exporter = MetricsExporter(collector).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    yield f"http://127.0.0.1:{httpd.server_address[1]}", exporter.url, down
    exporter.stop()
    httpd.shutdown()
    httpd.server_close()


def test_servers_tab_shows_each_server(qtbot, servers):
    from kvscope.ui.servers import ServersTab

    base, kvscope_url, down = servers
    tab = ServersTab()
    qtbot.addWidget(tab)
    urls = [f"{base}/vllm/metrics", kvscope_url, down, f"{base}/slow"]
    with qtbot.waitSignal(tab.poller.readings, timeout=10_000) as blocker:
        assert tab.watch(urls, interval_s=0.5, timeout_s=0.5)
    readings = blocker.args[0]
    assert [r.status for r in readings] == ["ok", "ok", "down", "slow"]
    assert tab.table.rowCount() == 4
    assert tab.table.item(0, 1).text() == "vllm" and tab.table.item(0, 3).text() == "42.0%"
    assert tab.table.item(0, 5).text() == "2.5 GiB"  # 20,577 tokens x 128 KiB (Llama-3-8B from /v1/models)
    assert tab.table.item(1, 1).text() == "kvscope" and tab.table.item(1, 5).text() == "192.0 KiB"
    assert tab.table.item(2, 2).text() == "down" and "refused" in tab.table.item(2, 10).text()
    xs, ys = tab._curves[urls[0]][0].getData()
    assert len(xs) == 1 and ys[0] == readings[0].kv_bytes
    tab.stop()
    assert not tab.poller.is_running()


def test_refuses_a_bad_url(qtbot):
    from kvscope.ui.servers import ServersTab

    tab = ServersTab()
    qtbot.addWidget(tab)
    assert not tab.watch(["file:///etc/passwd"])
    assert "http(s)" in tab.note.text() and not tab.poller.is_running()
