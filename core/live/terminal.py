"""`python main.py run`: the terminal view — a live table of observed vs predicted memory per token."""

from __future__ import annotations

import signal
import sys
from typing import TextIO

from kvscope.core import runtimes
from kvscope.core.base.errors import is_user_error
from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.base.streams import StreamError, require_stdout
from kvscope.core.live.run import run_generation
from kvscope.core.model.request import ModelInfo, RunHooks, RunRequest
from kvscope.core.model.spec import human_bytes
from kvscope.core.records.outputs import display_path

COLUMNS = ("token", "phase", "KV observed", "KV predicted", "match", "allocator", "device used", "RSS", "tok/s")
#: Added with --quality-probe: the run's next token against the model as loaded (teacher-forced, whatever was switched).
QUALITY_COLUMNS = ("top-1", "KL (nats)")
#: A runtime that reserves its KV cache at load (reserves_at_load): what it reserved, and what the tokens hold of it.
RESERVED_COLUMNS = ("token", "phase", "KV reserved", "KV predicted", "match", "KV used", "RSS", "tok/s")


def _fmt(n: int | None) -> str:
    return "n/a" if n is None else human_bytes(n)


class TerminalView:
    """Prints one row per token and one line per event, then a summary."""

    def __init__(self, out: TextIO | None = None, every: int = 1, quality: bool = False,
                 runtime: str | None = None) -> None:
        # Looked up per call, not bound at import: sys.stdout may be replaced (pytest, an embedding app).
        self.out = out if out is not None else sys.stdout
        self.every = max(1, every)
        self.samples = 0
        self.mismatches = 0
        self.first: Sample | None = None
        self.last: Sample | None = None
        self.events: list[Sample] = []
        self.max_abs_error = 0
        self.quality = quality
        self.runtime = runtime or runtimes.DEFAULT
        #: The runtime's cache is set aside at load (its registry entry says): the reserved/used columns.
        self.reserves = runtimes.get(self.runtime).reserves_at_load
        self.quality_rows: list[tuple[int, float]] = []  # (top-1 agrees, KL) per decoded token

    def loaded(self, info: ModelInfo) -> None:
        spec = info.spec
        print(f"{safe_text(info.label, limit=NAME_LIMIT)} — {spec.num_layers} layers, {spec.num_query_heads} query heads, "
              f"{spec.num_kv_heads} KV heads, head_dim {spec.head_dim}, {spec.num_parameters:,} parameters",
              file=self.out)
        print(f"device {info.device_name} ({info.device}), dtype {info.dtype}, memory {_fmt(info.total_memory)}",
              file=self.out)
        columns = RESERVED_COLUMNS if self.reserves else COLUMNS + (QUALITY_COLUMNS if self.quality else ())
        print("  ".join(f"{c:>13}" for c in columns), file=self.out, flush=True)

    def emit(self, s: Sample) -> None:
        if s.phase == PHASE_EVENT:
            self.events.append(s)
            print(f"  -- [{s.event}] token {s.token}: {safe_text(s.text)}", file=self.out, flush=True)
            return
        self.samples += 1
        self.first = self.first or s
        self.last = s
        match = s.kv_bytes_reserved == s.kv_bytes_predicted
        if not match:
            self.mismatches += 1
            if s.kv_bytes_reserved is not None and s.kv_bytes_predicted is not None:
                self.max_abs_error = max(self.max_abs_error, abs(s.kv_bytes_reserved - s.kv_bytes_predicted))
        if s.quality_top1 is not None and s.quality_kl is not None and s.phase == "decode":
            self.quality_rows.append((s.quality_top1, s.quality_kl))
        if s.token % self.every and s.phase != "prefill":
            return
        row = (str(s.token), s.phase, f"{s.kv_bytes_reserved:,}" if s.kv_bytes_reserved is not None else "n/a",
               f"{s.kv_bytes_predicted:,}" if s.kv_bytes_predicted is not None else "n/a", "yes" if match else "NO",
               _fmt(s.allocator_allocated), _fmt(s.device_used), _fmt(s.process_rss),
               f"{s.tokens_per_s:.1f}" if s.tokens_per_s else "-")
        if self.reserves:
            row = row[:5] + (f"{s.kv_bytes_held:,}" if s.kv_bytes_held is not None else "n/a",) + row[7:]
        if self.quality:
            row += (("same" if s.quality_top1 else "differs") if s.quality_top1 is not None else "-",
                    f"{s.quality_kl:.4f}" if s.quality_kl is not None else "-")
        print("  ".join(f"{c:>13}" for c in row), file=self.out, flush=True)

    def summary(self) -> None:
        last = self.last
        if last is None:
            return
        print("", file=self.out)
        print(f"generated {last.token} tokens ({last.context_tokens} in context); attention {last.attention}, "
              f"attn-impl {last.attn_impl} ({last.kernel}), cache {last.cache}", file=self.out)
        print(f"KV cache: observed {_fmt(last.kv_bytes_reserved)} ({last.kv_bytes_reserved:,} B), predicted "
              f"{_fmt(last.kv_bytes_predicted)}; observed == predicted at {self.samples - self.mismatches} of "
              f"{self.samples} samples" + (f" (largest gap {self.max_abs_error:,} B)" if self.mismatches else ""),
              file=self.out)
        if self.reserves and last.kv_bytes_held is not None and last.kv_bytes_reserved is not None:
            print(f"{self.runtime} reserved {last.kv_bytes_reserved:,} B at load; the cells that hold the "
                  f"{last.context_tokens} tokens use {last.kv_bytes_held:,} B ({_fmt(last.kv_bytes_held)}), "
                  f"{100 * last.kv_bytes_held / max(1, last.kv_bytes_reserved or 1):.1f}% of it", file=self.out)
        print(f"weights {_fmt(last.weights_bytes)}; predicted total {_fmt(last.total_predicted)}; "
              f"process RSS {_fmt(last.process_rss)}; switches {sum(1 for e in self.events if e.event == 'switch')}",
              file=self.out, flush=True)
        if self.quality_rows:
            agree = sum(a for a, _ in self.quality_rows)
            kls = [k for _, k in self.quality_rows]
            print(f"quality probe (against the model as loaded, teacher-forced): top-1 the same at {agree} of {len(kls)} tokens "
                  f"({100 * agree / len(kls):.1f}%); KL mean {sum(kls) / len(kls):.4f}, max {max(kls):.4f} nats",
                  file=self.out, flush=True)


def _stream_failure(exc: StreamError, request: RunRequest, view: TerminalView) -> str:
    """The one line for a table that could not be written: where, why, and what became of the recording."""
    if view.samples == 0 and not view.events:
        return f"{exc}; the run stopped before its first token"
    where = f"the run stopped at token {view.last.token if view.last is not None else 0}"
    if request.record_path:  # run_generation wrote the samples, and this failure as an error event, before the table
        where += f"; the recording {display_path(request.record_path)} keeps every token up to there"
    return f"{exc}; {where}"


#: Signals that stop a terminal run cleanly: Ctrl+C, and SIGTERM (``kill``, a service manager, a
#: container stopping), which used to end the process at once (exit -15, no stop event, no summary).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))


def run_terminal(request: RunRequest, out: TextIO | None = None, observers: tuple = ()) -> int:
    """Run a generation with the live table.

    Ctrl+C or SIGTERM stops cleanly: the run ends between two tokens with a stop event (in the
    recording too), the summary is printed and the exit status is 0, as for a finished run. A
    second signal of the same kind gets its default behaviour (KeyboardInterrupt; termination).
    """
    if out is None:  # `>&-`: refused before anything loads (the table would go nowhere)
        require_stdout("run prints its table there (>/dev/null discards it)")
    view = TerminalView(out, quality=request.quality_probe, runtime=request.runtime)
    emit = view.emit
    if observers:  # e.g. the metrics exporter (kvscope.core.live.metrics): each gets every Sample after the table
        def emit(s: Sample) -> None:
            view.emit(s)
            for observe in observers:
                observe(s)
    stopping = {"flag": False}

    def on_signal(signum, frame):  # first signal: stop between tokens; a second one: default behaviour
        stopping["flag"] = True
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    try:
        run_generation(request, RunHooks(emit=emit, loaded=view.loaded,
                                         progress=lambda t: print(safe_text(t), file=sys.stderr, flush=True),
                                         should_stop=lambda: stopping["flag"]))
    except StreamError as exc:  # the table's stream is full or failing: no summary there; the recording is kept
        raise StreamError(_stream_failure(exc, request, view)) from None
    except Exception as exc:  # a user's error (a budget, a deleted recording, a runtime's child aborting): after the summary
        if is_user_error(exc):
            try:
                view.summary()
            except StreamError:  # the summary could not be printed either: the run's own error is the one said
                pass
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    view.summary()
    if request.record_path:
        print(f"recorded to {display_path(request.record_path)}", file=view.out)
    return 0
