"""Hostile inference servers for `watch` (issue 29, items 4, 5 and 7): a generated matrix of servers on 127.0.0.1.

Every server here is an ``http.server`` of this process on the loopback interface (no other host is ever
reached: the redirect targets are other loopback ports this test listens on, and count every connection).

The matrix (``cases``), all watched together in one ``watch()`` round beside a good server:

* **figures**: every figure of every engine's page (vLLM, SGLang, llama.cpp, TGI, KV Scope's exporter) served
  as NaN, +Inf, -Inf, negative, 1e308 (the issue's OverflowError) and just past its bound; vLLM's block labels
  as -1, 1e3, 5,000 digits, text. Each must be left out (n/a) and named in the reading's ``absurd``, the other
  figures of the page exact;
* **redirects**: to another port, another host name, ftp://, file://, https://, a scheme-relative URL, a loop,
  a chain of 20; each refused (``http error``, one line) with at most ``MAX_REDIRECTS`` + 1 requests, and no
  connection at the other end. A redirect on the same server is followed;
* **bodies**: escape codes and a bidi override in the model's name (in the page and in /v1/models), a label
  of 1 MiB, a page of 9 MiB, NUL bytes, bytes that are not UTF-8, a Content-Length that lies.

Outcomes: **refused** (a status that says what went wrong), **flagged** (read, the absurd figures left out and
named), **correct**; failures: **raised** (the round ended in an exception: every server lost), **unflagged**
(an absurd figure shown, or a right one lost), **left the server** (a connection reached the other end),
**too many requests**, **raw control characters** (in the terminal line or the Servers tab). The table by
category is printed (visible without ``-s``).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvscope import main as kvscope_main
from kvscope.core.records import scrape
from kvscope.core.records.scrape import (DROPPED, ERROR, GARBAGE, HTTP_ERROR, MAX_BYTES, MAX_REDIRECTS, MAX_REQUESTS,
                                         MAX_TOKENS, OK, Watcher, render_reading, watch)

CONTROL = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


@dataclass(frozen=True)
class Figure:
    """One figure of one engine's page: the line (``{v}`` the value), the reading's attribute, the good value
    served and read, the name the checks give it, and its kind (fraction, tokens, requests, bytes, label)."""

    line: str
    attr: str
    good: str
    read: object
    name: str
    kind: str
    bad_read: object = None  # what the reading holds when this figure is absurd (None: n/a)


ENGINES: dict[str, tuple[list[str], list[Figure]]] = {
    "vllm": ([], [
        Figure('vllm:kv_cache_usage_perc{{model_name="m"}} {v}', "kv_usage", "0.25", 0.25, "kv_cache_usage_perc",
               "fraction"),
        Figure('vllm:num_requests_running{{model_name="m"}} {v}', "running", "3", 3.0, "running", "requests"),
        Figure('vllm:num_requests_waiting{{model_name="m"}} {v}', "waiting", "1", 1.0, "waiting", "requests"),
        Figure('vllm:num_preemptions_total{{model_name="m"}} {v}', "preemptions", "0", 0.0, "preemptions", "tokens"),
        Figure('vllm:cache_config_info{{block_size="16",num_gpu_blocks="{v}"}} 1', "num_gpu_blocks", "1000", 1000,
               "num_gpu_blocks", "label"),
    ]),
    "sglang": ([], [
        Figure('sglang:token_usage{{model_name="m"}} {v}', "kv_usage", "0.5", 0.5, "token_usage", "fraction"),
        Figure("sglang:num_used_tokens {v}", "kv_tokens", "500", 500, "num_used_tokens", "tokens"),
        Figure("sglang:max_total_num_tokens {v}", "kv_capacity_tokens", "1000", 1000, "max_total_num_tokens", "tokens",
               bad_read=1000),  # then derived: used / usage
        Figure("sglang:num_running_reqs {v}", "running", "2", 2.0, "running", "requests"),
        Figure("sglang:num_queue_reqs {v}", "waiting", "0", 0.0, "waiting", "requests"),
    ]),
    "llama.cpp": (["llamacpp:n_tokens_max 10"], [
        Figure("llamacpp:kv_cache_usage_ratio {v}", "kv_usage", "0.125", 0.125, "kv_cache_usage_ratio", "fraction"),
        Figure("llamacpp:kv_cache_tokens {v}", "kv_tokens", "64", 64, "kv_cache_tokens", "tokens"),
        Figure("llamacpp:requests_processing {v}", "running", "1", 1.0, "running", "requests"),
        Figure("llamacpp:requests_deferred {v}", "waiting", "0", 0.0, "waiting", "requests"),
    ]),
    "tgi": ([], [
        Figure("tgi_batch_current_max_tokens {v}", "kv_tokens", "4096", 4096, "tgi_batch_current_max_tokens", "tokens"),
        Figure("tgi_batch_current_size {v}", "running", "4", 4.0, "running", "requests"),
        Figure("tgi_queue_size {v}", "waiting", "2", 2.0, "waiting", "requests"),
    ]),
    "kvscope": (['kvscope_run_info{model="m"} 1'], [
        Figure("kvscope_kv_cache_observed_bytes {v}", "kv_bytes", "221184", 221_184, "kv_cache_observed_bytes", "bytes"),
        Figure("kvscope_kv_cache_predicted_bytes {v}", "kv_bytes_predicted", "221184", 221_184, "kv_cache_predicted_bytes",
               "bytes"),
        Figure("kvscope_context_tokens {v}", "kv_tokens", "27", 27, "context_tokens", "tokens"),
    ]),
}
BOUND = {"tokens": MAX_TOKENS, "requests": MAX_REQUESTS, "bytes": MAX_BYTES}
BAD_NUMBERS = {"NaN": "NaN", "+Inf": "+Inf", "-Inf": "-Inf", "negative": "-5", "1e308": "1e308"}
BAD_LABELS = {"negative": "-1", "float": "1e3", "5,000 digits": "9" * 5000, "text": "lots", "past bound": str(2 ** 41)}


def page(engine: str, bad: tuple[Figure, str] | None = None) -> bytes:
    extra, figures = ENGINES[engine]
    lines = list(extra)
    for f in figures:
        lines.append(f.line.format(v=bad[1] if bad is not None and bad[0] is f else f.good))
    return ("\n".join(lines) + "\n").encode()


@dataclass
class Case:
    category: str
    name: str
    path: str
    expect: str  # "flagged", "refused", "correct"
    check: object = None  # (reading) -> problem or None
    max_requests: int = 2  # /metrics and /v1/models


@dataclass
class Servers:
    """The main test server (pages by path, hits counted) and two loopback listeners that must never be reached."""

    base: str
    pages: dict[str, tuple[int, dict, bytes]] = field(default_factory=dict)
    hits: Counter = field(default_factory=Counter)
    other_hits: Counter = field(default_factory=Counter)


def cases(srv: Servers, other_port: int, ftp_port: int) -> list[Case]:
    out: list[Case] = []
    for engine, (_extra, figures) in ENGINES.items():
        for f in figures:
            values = dict(BAD_LABELS) if f.kind == "label" else dict(BAD_NUMBERS)
            if f.kind == "fraction":
                values.update({"1.5": "1.5", "-0.5": "-0.5"})
            elif f.kind != "label":
                values["past bound"] = str(BOUND[f.kind] * 2)
            for label, value in values.items():
                path = f"/fig/{engine}/{f.attr}/{len(out)}/metrics"
                srv.pages[path] = (200, {}, page(engine, (f, value)))

                def check(r, f=f, engine=engine):
                    if r.status != OK:
                        return f"status {r.status}: {r.problem}"
                    if getattr(r, f.attr) != f.bad_read:
                        return f"{f.attr} = {getattr(r, f.attr)!r}, not left out"
                    if not r.absurd or f.name not in r.absurd:
                        return f"absurd {r.absurd!r} does not name {f.name}"
                    for g in ENGINES[engine][1]:
                        if g is not f and g.attr != f.attr and getattr(r, g.attr) != g.read:
                            return f"{g.attr} = {getattr(r, g.attr)!r}, not {g.read!r}"
                    if "ABSURD" not in render_reading(r):
                        return "the terminal line does not flag it"
                    return None

                out.append(Case(f"figures: {engine}", f"{f.attr} {label}", path, "flagged", check))
    # Redirects: where they point, and what must happen.
    targets = {
        "another port": f"http://127.0.0.1:{other_port}/metrics",
        "another host name": f"http://localhost:{srv.base.rsplit(':', 1)[1]}/good/metrics",
        "ftp://": f"ftp://127.0.0.1:{ftp_port}/metrics",
        "file://": "file:///etc/passwd",
        "https://": f"https://127.0.0.1:{other_port}/metrics",
        "scheme-relative": f"//127.0.0.1:{other_port}/metrics",
        "escape codes in Location": f"http://127.0.0.1:{other_port}/\x1b]0;pwned\x07",
    }
    for code in (301, 302, 307, 308):
        for label, target in targets.items():
            path = f"/redir/{code}/{len(out)}/metrics"
            srv.pages[path] = (code, {"Location": target}, b"")
            out.append(Case("redirects", f"{code} to {label}", path, "refused",
                            lambda r: None if r.status == HTTP_ERROR and "refused" in (r.problem or "") else
                            f"status {r.status}: {r.problem}", max_requests=1))
    srv.pages["/redir/same/metrics"] = (302, {"Location": "/good/metrics"}, b"")
    out.append(Case("redirects", "302 on the same server", "/redir/same/metrics", "correct",
                    lambda r: None if r.status == OK and r.kv_usage == 0.25 else f"{r.status}: {r.problem}",
                    max_requests=2))
    srv.pages["/loop/metrics"] = (302, {"Location": "/loop/metrics"}, b"")
    out.append(Case("redirects", "a loop", "/loop/metrics", "refused",
                    lambda r: None if r.status == HTTP_ERROR else f"{r.status}: {r.problem}", max_requests=MAX_REDIRECTS + 1))
    for i in range(20):
        srv.pages[f"/chain/{i}/metrics"] = (302, {"Location": f"/chain/{i + 1}/metrics"}, b"")
    out.append(Case("redirects", "a chain of 20", "/chain/0/metrics", "refused",
                    lambda r: None if r.status == HTTP_ERROR else f"{r.status}: {r.problem}", max_requests=MAX_REDIRECTS + 1))
    # Hostile bodies.
    evil = "\x1b]0;pwned\x07\x1b[2J\u202eevil\r"
    srv.pages["/evil-name/metrics"] = (200, {}, page("vllm").replace(b'model_name="m"', f'model_name="{evil}"'.encode()))
    out.append(Case("bodies", "escape codes in the model's name", "/evil-name/metrics", "correct",
                    lambda r: None if r.status == OK and r.model == evil else f"{r.status}: {r.model!r}"))
    bare = page("vllm").replace(b'{model_name="m"}', b"")
    srv.pages["/evil-models/metrics"] = (200, {}, bare)
    srv.pages["/evil-models/v1/models"] = (200, {}, json.dumps({"data": [{"id": evil * 3}]}).encode())
    out.append(Case("bodies", "escape codes in /v1/models", "/evil-models/metrics", "correct",
                    lambda r: None if r.status == OK and "give --model" in (r.note or "") and r.model is None
                    and r.note.isprintable() else f"{r.status}: {r.note!r}"))
    srv.pages["/long-label/metrics"] = (200, {}, page("vllm").replace(b'model_name="m"', b'model_name="' + b"x" * (1 << 20) + b'"'))
    out.append(Case("bodies", "a label of 1 MiB", "/long-label/metrics", "correct",
                    lambda r: None if r.status == OK and r.model == "x" * 200 else f"{r.status}: {len(r.model or '')}"))
    srv.pages["/huge/metrics"] = (200, {}, b"# " + b"x" * (9 << 20))
    out.append(Case("bodies", "a page of 9 MiB", "/huge/metrics", "refused",
                    lambda r: None if r.status == GARBAGE and "larger than 8 MiB" in r.problem else r.problem))
    srv.pages["/nul/metrics"] = (200, {}, page("vllm").replace(b"0.25", b"0.\x0025"))
    out.append(Case("bodies", "NUL bytes", "/nul/metrics", "refused",
                    lambda r: None if r.status == GARBAGE else f"{r.status}: {r.problem}"))
    srv.pages["/latin1/metrics"] = (200, {}, page("vllm").replace(b'"m"', b'"\xe9\xff"'))
    out.append(Case("bodies", "not UTF-8", "/latin1/metrics", "refused",
                    lambda r: None if r.status == GARBAGE and "UTF-8" in r.problem else f"{r.status}: {r.problem}"))
    srv.pages["/lie/metrics"] = (200, {"Content-Length": "100000"}, page("vllm"))
    out.append(Case("bodies", "a Content-Length that lies", "/lie/metrics", "refused",
                    lambda r: None if r.status in (DROPPED, GARBAGE) else f"{r.status}: {r.problem}"))
    srv.pages["/digits/metrics"] = (200, {}, page("vllm").replace(b"} 0.25", b"} " + b"9" * 5000))
    out.append(Case("bodies", "a usage of 5,000 digits", "/digits/metrics", "flagged",
                    lambda r: None if r.status == OK and r.kv_usage is None and "kv_cache_usage_perc inf" in (r.absurd or "")
                    else f"{r.status}: {r.absurd!r}"))
    return out


class Handler(BaseHTTPRequestHandler):
    servers: Servers

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        srv = self.servers
        srv.hits[self.path] += 1
        if self.path == "/good/metrics":
            status, headers, body = 200, {}, page("vllm")
        else:
            status, headers, body = srv.pages.get(self.path, (404, {}, b"not found"))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass


def _listener(counter: Counter, key: str) -> tuple[socket.socket, threading.Thread]:
    """A loopback TCP port that counts every connection (a redirect must never reach it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.2)

    def accept() -> None:
        while sock.fileno() != -1:
            try:
                conn, _ = sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            counter[key] += 1
            conn.close()

    thread = threading.Thread(target=accept, daemon=True, name=f"test-{key}")
    thread.start()
    return sock, thread


@pytest.fixture
def hostile():
    srv = Servers(base="")
    handler = type("H", (Handler,), {"servers": srv})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    srv.base = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, name="test-hostile-servers", daemon=True)
    thread.start()
    other, _ = _listener(srv.other_hits, "other port")
    ftp, _ = _listener(srv.other_hits, "ftp port")
    yield srv, other.getsockname()[1], ftp.getsockname()[1]
    other.close()
    ftp.close()
    httpd.shutdown()
    httpd.server_close()


def outcome(case: Case, r, srv: Servers) -> tuple[str, str]:
    line = render_reading(r)
    if any(c in line for c in CONTROL) or "\n" in line:
        return "raw control characters", repr(line[:200])
    if srv.hits[case.path] > case.max_requests:
        return "too many requests", f"{srv.hits[case.path]} requests"
    problem = case.check(r)
    if problem:
        return "unflagged" if case.expect == "flagged" else "wrong", problem
    return case.expect, ""


def test_every_hostile_server_is_its_own_row_in_one_round(hostile, capsys):
    srv, other_port, ftp_port = hostile
    matrix = cases(srv, other_port, ftp_port)
    assert len(matrix) >= 150
    urls = [srv.base + "/good/metrics"] + [srv.base + c.path for c in matrix]
    started = time.monotonic()
    seen = []
    last = watch(urls, count=1, timeout=2.0, emit=seen.append)  # one round: any exception fails the test here
    elapsed = time.monotonic() - started
    assert len(last) == len(urls) == len(seen)
    good = last[0]
    assert good.status == OK and good.kv_usage == 0.25 and good.absurd is None
    table: dict[str, Counter] = {}
    failures = []
    for case, r in zip(matrix, last[1:]):
        assert r.url == srv.base + case.path
        what, why = outcome(case, r, srv)
        table.setdefault(case.category, Counter())[what] += 1
        if what not in ("flagged", "refused", "correct"):
            failures.append(f"{case.category} / {case.name}: {what}: {why}")
    if srv.other_hits:
        failures.append(f"left the server: {dict(srv.other_hits)}")
    with capsys.disabled():
        print()
        print(f"hostile servers for watch: {len(matrix)} on 127.0.0.1 in one round of {elapsed:.1f} s "
              f"({sum(srv.hits.values())} requests in all)")
        print(f"{'category':<20}{'servers':>8}{'refused':>9}{'flagged':>9}{'correct':>9}{'failed':>8}")
        total: Counter = Counter()
        for category, c in table.items():
            total.update(c)
            failed = sum(v for k, v in c.items() if k not in ("flagged", "refused", "correct"))
            print(f"{category:<20}{sum(c.values()):>8}{c['refused']:>9}{c['flagged']:>9}{c['correct']:>9}{failed:>8}")
        failed = sum(v for k, v in total.items() if k not in ("flagged", "refused", "correct"))
        print(f"{'all':<20}{sum(total.values()):>8}{total['refused']:>9}{total['flagged']:>9}{total['correct']:>9}"
              f"{failed:>8}")
    assert not failures, "\n".join(failures)
    assert elapsed < 30


def test_the_issues_overflow_is_that_servers_row_and_the_cli_goes_on(hostile, capsys):
    """A usage of 1e308 ended the whole watch ('internal error: OverflowError'), the other servers with it."""
    srv, _, _ = hostile
    srv.pages["/overflow/metrics"] = (200, {}, page("vllm").replace(b"} 0.25", b"} 1e308"))
    code = kvscope_main.main(["watch", srv.base + "/overflow/metrics", srv.base + "/good/metrics", "--count", "2",
                              "--interval", "0.1", "--model", "llama-3-8b"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert len(lines) == 4 and not out.err
    assert "KV n/a" in lines[0] and "ABSURD (left out): kv_cache_usage_perc 1e+308 is not a fraction" in lines[0]
    assert "KV 25.0%, 4,000 of 16,000 tokens" in lines[1]
    code = kvscope_main.main(["watch", srv.base + "/overflow/metrics", "--count", "1", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["kv_usage"] is None and "1e+308" in row["absurd"]


def test_a_bug_met_by_one_server_is_that_servers_row(hostile, monkeypatch):
    """Whatever our own code fails on for one page is that server's reading (status error, one line): the net
    under every range check. (read_page is made to fail for one URL: no page known today does.)"""
    srv, _, _ = hostile
    real = scrape.read_page

    def fails_for_one(url, page):
        if "/boom/" in url:
            raise ZeroDivisionError("a bug")
        return real(url, page)

    monkeypatch.setattr(scrape, "read_page", fails_for_one)
    srv.pages["/boom/metrics"] = (200, {}, page("vllm"))
    last = watch([srv.base + "/boom/metrics", srv.base + "/good/metrics"], count=1, timeout=2.0, emit=lambda r: None)
    assert [r.status for r in last] == [ERROR, OK]
    assert last[0].problem == "internal error on this server's page: ZeroDivisionError: a bug"
    assert render_reading(last[0]).endswith("ERROR: internal error on this server's page: ZeroDivisionError: a bug")


def test_the_servers_tab_shows_hostile_rows_escaped_and_flagged(qtbot, hostile):
    """The real Servers tab: one row per server, the absurd one flagged and not plotted, no control character in
    any cell, the good one exact."""
    from kvscope.ui.servers import ServersTab

    srv, other_port, _ = hostile
    evil = "\x1b]0;pwned\x07\u202e"
    srv.pages["/evil/metrics"] = (200, {}, page("vllm").replace(b'model_name="m"', f'model_name="{evil}"'.encode())
                                  .replace(b"} 0.25", b"} NaN"))
    srv.pages["/away/metrics"] = (302, {"Location": f"http://127.0.0.1:{other_port}/metrics"}, b"")
    tab = ServersTab()
    qtbot.addWidget(tab)
    urls = [srv.base + "/evil/metrics", srv.base + "/away/metrics", srv.base + "/good/metrics"]
    assert tab.watch(urls, None, interval_s=0.2, timeout_s=1.0)  # no model: the note names the server's
    qtbot.waitUntil(lambda: len(tab.latest) == 3, timeout=20_000)
    tab.stop()
    texts = [[tab.table.item(row, col).text() for col in range(tab.table.columnCount())] for row in range(3)]
    assert not any(c in cell for row in texts for cell in row for c in CONTROL)
    evil_row, away_row, good_row = texts
    assert evil_row[3] == "n/a" and "\\x1b]0;pwned\\x07\\u202e" in evil_row[-1]
    assert evil_row[-1].startswith("absurd figures left out: kv_cache_usage_perc nan is not a fraction")
    assert away_row[2] == HTTP_ERROR and "refused" in away_row[-1]
    assert good_row[2] == OK and good_row[3] == "25.0%" and good_row[-1] == "model 'm': give --model for bytes"
    assert not srv.other_hits
    assert all(math.isnan(y) for y in tab._history[urls[0]][1])  # nothing plotted for the absurd one
