"""``kvscope --self-test``: prove that this build (source checkout or packaged app) really works.

It goes the real way through: a Qt application on the offscreen platform, the generation engine
in its own process (a child of this executable, as the window runs it), the embedded demo model built from ``assets/`` (so the bundle's data files are
found), a prefill and 8 decoded tokens on the CPU, for every decoded token the observed KV bytes
compared with the predicted ones, and a pyqtgraph plot of them rendered offscreen. Then each runtime that brings
a part of its own (its registry ``self_test``: the embedded model's GGUF, a few tokens, whose allocation must
equal the prediction) runs it where it is installed (the desktop bundle ships them); where it is not, the
line says that part was skipped. One line on stdout says what passed; on any failure one
line says why and the exit status is 1. No display, GPU or network is needed.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import kvscope.core.model.spec
from kvscope.core import runtimes
from kvscope.core.base.errors import INTERNAL, KVScopeError
from kvscope.core.base.sample import PHASE_DECODE
from kvscope.core.model.request import RunRequest
from kvscope.core.runtimes import missing

#: Tokens the self-test decodes; each one must have observed KV bytes == predicted KV bytes.
SELF_TEST_TOKENS = 8
#: Loading includes building the embedded model on first use (a few seconds); generous for slow CI.
SELF_TEST_TIMEOUT_S = 120.0


class SelfTestFailed(KVScopeError):
    """The self-test found something wrong; the message is the one line the user sees."""

    category = INTERNAL


def self_test(timeout_s: float = SELF_TEST_TIMEOUT_S, tokens: int = SELF_TEST_TOKENS) -> int:
    """Load the embedded model, decode ``tokens`` tokens offscreen on the CPU, check the KV bytes.

    Prints one line ("self-test OK: ..." or "self-test FAILED: ...") and returns the exit status:
    0 when every decoded token's observed KV bytes equal the predicted ones, else 1.
    """
    # A crash in native code (a broken bundle, a mismatched Qt) should still say where it happened.
    if sys.stderr is not None and not faulthandler.is_enabled():  # None in a Windows GUI build
        faulthandler.enable()
    # Must precede the QApplication: the offscreen platform needs no display server.
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    # The embedded model is built locally; nothing here may wait on the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    try:
        line = _run(timeout_s, tokens)
    except SelfTestFailed as exc:
        print(f"self-test FAILED: {exc}", flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - a broken build must say what broke, not crash
        print(f"self-test FAILED: {type(exc).__name__}: {_one_line(str(exc))}", flush=True)
        return 1
    print(f"self-test OK: {line} ({time.monotonic() - started:.1f} s)", flush=True)
    return 0


def _one_line(message: str) -> str:
    """Long library errors (numpy's ImportError is a page) as one line: their first and last lines."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ... {lines[-1]}"


def _render_plot(values: list[int]) -> tuple[int, int]:
    """Plot the KV bytes with pyqtgraph and export the plot as an image in memory; the image's size.

    The window's plotting stack (pyqtgraph, its QtOpenGL and QtSvg imports, the exporters the File
    menu uses): a bundle that lacks a piece fails here, not in front of an audience.
    """
    import pyqtgraph as pg
    import pyqtgraph.exporters
    from PySide6.QtSvg import QSvgGenerator  # noqa: F401 - SVG export needs QtSvg in the bundle

    plot = pg.PlotWidget()
    plot.resize(320, 200)
    plot.plot(list(range(len(values))), values)
    image = pyqtgraph.exporters.ImageExporter(plot.getPlotItem()).export(toBytes=True)
    plot.close()
    if image is None or image.isNull() or image.width() == 0:
        raise SelfTestFailed("pyqtgraph could not render a plot offscreen")
    return image.width(), image.height()


def runtime_missing(name: str) -> str | None:
    """Why the runtime ``name`` cannot run here (a package not installed), else None. Never imports it (the window's
    process must not): the runtime registry's answer (its light half not importable: said as the reason)."""
    try:
        return missing(name)
    except ImportError as exc:
        return f"its light half does not import ({exc})"


def _run(timeout_s: float, tokens: int) -> str:
    from PySide6.QtWidgets import QApplication

    assets = kvscope.core.model.spec.ASSETS  # looked up now: where this process finds assets/
    if not assets.is_dir():
        # In a bundle this means the spec did not place assets/ next to core/.
        raise SelfTestFailed(f"assets folder not found at {assets}")
    app = QApplication.instance() or QApplication(sys.argv[:1])
    line = _run_transformers(app, RunRequest(source="embedded", max_new_tokens=tokens, device="cpu"), timeout_s)
    return "; ".join([line, *_runtime_parts(app, timeout_s)])


def _runtime_parts(app, timeout_s: float) -> list[str]:
    """Each other runtime's own part (its registry ``self_test``: a short run the window's way and the check of its
    decoded samples), skipped, and said so, where the runtime is not installed."""
    parts = []
    for name in runtimes.names():
        hook = runtimes.get(name).hook("self_test")
        if hook is None:
            continue
        why = runtime_missing(name)
        if why:
            parts.append(f"{name} skipped: {why}")
            continue
        request, check = hook()
        decoded, _controller, where = _generate(app, request, timeout_s, request.max_new_tokens, name)
        try:
            parts.append(f"{check(decoded)} {where}")
        except ValueError as exc:
            raise SelfTestFailed(str(exc)) from None
    return parts


def _generate(app, request, timeout_s: float, tokens: int, what: str) -> tuple[list, object, str]:
    """Run ``request`` the window's way (the engine process, a child of this executable, unless
    KVSCOPE_ENGINE=thread) until it ends; its decoded samples, the controller and where it ran."""
    from PySide6.QtCore import QEvent, QEventLoop, QTimer

    from kvscope.workers.engine_link import HostedGenerationController, controller_class  # Qt: after the display check

    controller = controller_class()()
    samples: list = []
    errors: list[str] = []
    loop = QEventLoop()
    timer = QTimer()
    timer.setSingleShot(True)
    timed_out: list[bool] = []

    def on_error(message: str) -> None:
        errors.append(message)

    def on_timeout() -> None:
        timed_out.append(True)
        loop.quit()

    def on_samples(batch: list) -> None:
        samples.extend(batch)

    controller.samples.connect(on_samples)
    controller.errored.connect(on_error)
    controller.finished.connect(loop.quit)
    timer.timeout.connect(on_timeout)
    timer.start(int(timeout_s * 1000))
    controller.start(request)
    loop.exec()
    timer.stop()
    if timed_out:
        controller.stop(timeout_s=5.0)
        raise SelfTestFailed(f"{what}: no result within {timeout_s:.0f} s ({len(samples)} samples so far)")
    controller.stop(timeout_s=5.0)  # the run has finished; this only joins its thread
    app.processEvents()  # deliver the last queued sample batch
    # Let the worker's and thread's deleteLater run now, while everything they refer to is alive.
    app.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    where = "in this process"
    if isinstance(controller, HostedGenerationController):
        where = f"in the engine process (pid {controller.host.pid})"
        controller.host.shutdown()
    if errors:
        prefix = "the run failed" if what == runtimes.DEFAULT else f"the {what} run failed"
        raise SelfTestFailed(f"{prefix}: {errors[0]}")
    decoded = [s for s in samples if s.phase == PHASE_DECODE]
    if len(decoded) < tokens:
        raise SelfTestFailed(f"{what}: expected {tokens} decoded tokens, got {len(decoded)}")
    return decoded, controller, where


def _run_transformers(app, request, timeout_s: float) -> str:
    """The embedded model in torch: observed KV bytes == predicted at every decoded token, and a plot."""
    decoded, controller, where = _generate(app, request, timeout_s, request.max_new_tokens, "transformers")
    for sample in decoded:
        if sample.kv_bytes_reserved is None or sample.kv_bytes_predicted is None:
            raise SelfTestFailed(f"token {sample.token}: KV bytes not available "
                                 f"(observed {sample.kv_bytes_reserved}, predicted {sample.kv_bytes_predicted})")
        if sample.kv_bytes_reserved != sample.kv_bytes_predicted:
            raise SelfTestFailed(f"token {sample.token}: KV observed {sample.kv_bytes_reserved:,} B "
                                 f"!= predicted {sample.kv_bytes_predicted:,} B")
    width, height = _render_plot([s.kv_bytes_reserved for s in decoded])
    last = decoded[-1]
    info = controller.info
    model = info.label if info is not None else "embedded"
    return (f"{len(decoded)} tokens, KV {last.kv_bytes_reserved:,} B observed == predicted, "
            f"model {model} on {last.device} ({last.dtype}, {last.attention}, {last.cache} cache) {where}, "
            f"Qt platform {app.platformName()}, plot {width}x{height}")
