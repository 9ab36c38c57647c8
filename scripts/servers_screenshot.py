"""docs/screenshot-servers.png: the Servers tab watching, for about 25 s, four servers on 127.0.0.1:

- a stand-in vLLM: tests/fixtures/servers/vllm.txt (written from vLLM 0.33.0's metric code) served with
  vllm:kv_cache_usage_perc rising from 10% to 97% and requests starting to wait, so the tab warns;
- a stand-in SGLang: tests/fixtures/servers/sglang.txt (SGLang's documented example page), as is;
- a real KV Scope run (`main.py run --metrics-port`, the embedded model on the CPU);
- a port nothing listens on (down).

No real vLLM or SGLang runs here: their pages are the fixtures, served by this script. Usage:

    QT_QPA_PLATFORM=offscreen python scripts/servers_screenshot.py [OUT.png]
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures" / "servers"
SECONDS = 25.0
START = time.monotonic()


def vllm_page() -> bytes:
    frac = min(1.0, (time.monotonic() - START) / SECONDS)
    usage = 0.10 + 0.87 * frac ** 1.5
    waiting = 0 if usage < 0.85 else int((usage - 0.85) * 100)
    text = (FIXTURES / "vllm.txt").read_text()
    text = re.sub(r"(vllm:kv_cache_usage_perc\{[^}]*\}) [0-9.]+", rf"\g<1> {usage:.4f}", text)
    text = re.sub(r"(vllm:num_requests_waiting\{[^}]*\}) [0-9.]+", rf"\g<1> {waiting}.0", text)
    text = re.sub(r"(vllm:num_requests_running\{[^}]*\}) [0-9.]+", rf"\g<1> {int(2 + 20 * frac)}.0", text)
    return text.encode()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith("/vllm/v1/models"):
            body = (FIXTURES / "vllm_models.json").read_bytes()
        elif self.path.startswith("/vllm/metrics"):
            body = vllm_page()
        elif self.path.startswith("/sglang/metrics"):
            body = (FIXTURES / "sglang.txt").read_bytes()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "screenshot-servers.png")
    from PySide6.QtWidgets import QApplication

    from kvscope.ui.servers import ServersTab
    from kvscope.ui.theme import DARK, stylesheet

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True, name="screenshot-servers").start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "run", "--device", "cpu", "--tokens", "1500",
                            "--metrics-port", "0", "--metrics-linger", "60"],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kvscope_url = None
    while kvscope_url is None:
        line = run.stderr.readline()
        if not line:
            print("the KV Scope run ended before serving metrics", file=sys.stderr)
            return 1
        if "Prometheus metrics at " in line:
            kvscope_url = line.split("Prometheus metrics at ", 1)[1].split()[0]
    threading.Thread(target=lambda: [None for _ in run.stderr], daemon=True).start()  # drain
    app = QApplication.instance() or QApplication([])
    tab = ServersTab(DARK)
    tab.setStyleSheet(stylesheet(DARK))
    tab.resize(1280, 720)
    tab.show()
    urls = [f"{base}/vllm/metrics", f"{base}/sglang/metrics", kvscope_url, f"http://127.0.0.1:{port}"]
    tab.urls.setText("  ".join(urls))
    tab.model.setText("llama-3-8b")
    tab.watch(urls, "llama-3-8b", interval_s=0.5, timeout_s=1.0)
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)
    tab.stop()
    app.processEvents()
    tab.grab().save(str(out))
    run.kill()
    run.wait(timeout=30)
    httpd.shutdown()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
