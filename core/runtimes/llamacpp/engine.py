"""llama.cpp as a live engine: a GGUF generated token by token in the real llama.cpp, one ``Sample`` per token.

The same stream as the transformers engine: load, prefill, decode, switches and refusals as events; the one
run loop (``kvscope.core.live.run``) drives it through ``kvscope.core.runtimes.llamacpp.runtime``, which keeps it in a child process (an
abort in llama.cpp ends that process, not the app). The KV figures:

- ``kv_bytes_reserved``: what llama.cpp reserved for its KV cache when the context was created, taken from the
  allocation itself: the cells, streams and layers its log reports (``llama_kv_cache: size = ...``) times the
  bytes of one cell in each cache, read from llama.cpp's own state of a one-token sequence
  (``LlamaCppContext.measure_cell_bytes``).
  It is flat from the first token: the whole context is paid for at load (the prepayment).
- ``kv_bytes_predicted``: ``kvscope.core.prediction.llamacpp.plan(...).kv_bytes``, the predictor's answer for the same options.
- ``kv_bytes_held``: the bytes of the cells that hold tokens so far (``llama_memory_seq_pos_max`` + 1 cells
  times the measured bytes per cell, a window cache capped at its window), so the plot shows what the reserved
  buffer is actually filled with.

- ``activations_observed``: the compute buffer llama.cpp reserved for the context, exact bytes from its own
  ``llama_get_memory_breakdown`` (``kvscope.core.runtimes.llamacpp.observe``), read once per context; ``activations_predicted``:
  ``kvscope.core.prediction.llamacpp_compute``'s replay of the same reservation (``plan(...).compute_bytes``).

Switches: the attention layout is fixed when llama.cpp loads the model, so ``attention`` is refused with that
reason and the run goes on. The kernel (``attn-impl=fa-on`` / ``fa-off``: ``-fa``), the cache type and the context
size take a reload: the context is freed and created again with the new options, the tokens so far are decoded
again (``tokens_rerun``), and the switch event carries the new allocation and compute buffer.

This module imports neither torch nor Qt; llama-cpp-python is imported when a run starts.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from kvscope.core.model.attention import SettingsError, native_attention
from kvscope.core.model.gguf import is_gguf_source, read_gguf
from kvscope.core.model.gguf_write import embedded_gguf
from kvscope.core.model.spec import human_bytes
from kvscope.core.prediction.llamacpp import LlamaCppOptions, LlamaCppPlan, cells_held, plan
from kvscope.core.runtimes.llamacpp.live import LlamaCppContext, Sampler
from kvscope.core.runtimes.llamacpp.observe import memory_breakdown
from kvscope.core.runtimes.llamacpp.switches import LLAMACPP_ATTENTION_KEYS, parse_llamacpp_switch_value

RUNTIME = "llama.cpp"
#: The sampler's top-k, as the transformers engine's (kvscope.core.runtimes.transformers.engine.TOP_K).
TOP_K = 40
#: The reason an attention switch is refused.
FIXED_LAYOUT = "llama.cpp fixes the attention layout when the model loads"
#: The kernel keys (``attn-impl`` and its short names): a flash-attention switch, ``-fa`` on a reloaded context.
KERNEL_KEYS = ("attn-impl", "attn", "impl", "flash")
#: What a kernel switch's value means for ``-fa`` (the window's Kernel combo shows fa-on / fa-off; the F key and
#: the other runtimes' names say flash or not).
FLASH_VALUES = {"fa-on": "on", "on": "on", "flash": "on", "flash_attention_2": "on", "enabled": "on",
                "fa-off": "off", "off": "off", "eager": "off", "sdpa": "off", "disabled": "off",
                "fa-auto": "auto", "auto": "auto"}
#: The cache types the window offers to reload with (the C key cycles through them).
OFFERED_CACHE_TYPES = ("f16", "q8_0", "q4_0", "f32")
#: A reload prepared off the token path decodes the tokens so far in calls of this many (a newer press cancels it
#: between two), then catches up on the tokens generated meanwhile, at most this many per token of the run.
PREPARE_CHUNK = 256
CATCH_UP_TOKENS = 16


class LlamaCppRunError(SettingsError):
    """A llama.cpp run failed for a reason written for the user (a ``KVScopeError``, category ``refused``)."""


def resolve_model(source: str, progress: Callable[[str], None] | None = None) -> Path:
    """The GGUF a llama.cpp run loads: ``embedded`` is the embedded demo model converted (``embedded_gguf``);
    anything else must be a .gguf file."""
    if source in ("", "embedded"):
        return embedded_gguf(progress)
    path = Path(source).expanduser()
    if not is_gguf_source(str(path)) or not path.is_file():
        what = "does not exist" if not path.exists() else "is not a GGUF file"
        raise SettingsError(f"--runtime llama.cpp runs a .gguf file; {source} {what} (convert a transformers model "
                            "with llama.cpp's convert_hf_to_gguf.py, or leave --model out for the embedded model)")
    return path


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What llama.cpp allocated for the KV cache of one context, from its log and a measured cell."""

    caches: tuple[Any, ...]  # kvscope.core.runtimes.llamacpp.live.LoggedCache, in the log's order (full, then window)
    bytes_per_cell: tuple[int, ...]  # per cache: K + V of one cell over its layers
    windows: tuple[int, ...]  # per cache: the window it keeps (0: every token)

    @property
    def reserved(self) -> int:
        return sum(c.cells * c.streams * b for c, b in zip(self.caches, self.bytes_per_cell))

    def used(self, cells: int) -> int:
        """Bytes of the cells that hold ``cells`` tokens of one sequence (a window cache keeps at most its window
        plus the token being decoded, and never more than its cells)."""
        return sum(b * cells_held(cells, w, c.cells) for c, b, w in zip(self.caches, self.bytes_per_cell, self.windows))


def allocation_of(ctx: Any, n_swa: int) -> Allocation:
    """The allocation of a loaded ``LlamaCppContext``: its logged caches and the bytes of one cell, measured.

    The bytes of one cell in each cache are read from llama.cpp's own state of a one-token sequence
    (``LlamaCppContext.measure_cell_bytes``: every layer's K and V row size as llama.cpp writes it). Leaves the
    context's memory empty."""
    caches = tuple(ctx.caches)
    if not caches:
        raise LlamaCppRunError(f"llama.cpp logged no KV cache for {ctx.path.name} (a model without a KV cache, "
                               "or a llama.cpp whose log KV Scope does not read)")
    per_cell = ctx.measure_cell_bytes()
    windows = tuple(n_swa if i > 0 and n_swa else 0 for i in range(len(caches)))
    return Allocation(caches, per_cell, windows)


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,} B ({human_bytes(n)})"


def observed_compute_bytes(ctx: Any) -> int | None:
    """The compute buffer llama.cpp reserved for a loaded ``LlamaCppContext``, exact bytes: its own
    ``llama_get_memory_breakdown`` (``kvscope.core.runtimes.llamacpp.observe``), summed over the buffer types. Read once per context
    (each call leaves a few hundred bytes of the returned map unfreed). None where this libllama does not export
    it or the map cannot be read: unknown, never a guess from the log's rounded MiB."""
    try:
        rows = memory_breakdown(ctx.ctx)
    except Exception:  # noqa: BLE001 - a map laid out otherwise: unknown
        return None
    return sum(r[2] for r in rows) if rows else None


class LlamaCppEngine:
    """One GGUF in llama.cpp with one context, generating for sequence 0; ``step`` returns a Sample per token."""

    def __init__(self, path: str | Path, options: LlamaCppOptions, seed: int = 0, n_threads: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = Path(path)
        try:  # this process, for the RSS every sample carries (one handle, not one per token)
            import psutil

            self._process = psutil.Process()
        except Exception:  # noqa: BLE001 - not available: the samples say None
            self._process = None
        self.gguf = read_gguf(self.path)
        self.spec = self.gguf.spec()
        self.options = options
        self.plan: LlamaCppPlan = plan(self.gguf, options)  # SettingsError: llama.cpp would refuse it too
        self.n_threads = n_threads or max(1, (os.cpu_count() or 2) - 1)
        self.clock = clock
        self.t0 = clock()
        self.tokens: list[int] = []  # every token decoded so far (prompt + generated)
        self.generated = 0
        self.tokens_per_s: float | None = None
        self.ctx = None
        self.sampler = Sampler(TOP_K, seed)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.attention = native_attention(self.spec).key
        self._job: dict[str, Any] | None = None  # a reload prepared off the token path (apply_live)
        self._held: list[tuple[str, Any]] = []  # presses on another axis, waiting for it
        self._live = False
        self._load(options)

    # ------------------------------------------------------------------------------------ the context

    def _load(self, options: LlamaCppOptions) -> None:
        self._adopt(*self._open(options))

    def _open(self, options: LlamaCppOptions) -> tuple[Any, LlamaCppOptions, Any]:
        """A new context with ``options`` (and its allocation as llama.cpp logged it), not yet the engine's."""
        ctx = LlamaCppContext(self.path, options, n_threads=self.n_threads)
        try:
            allocation = allocation_of(ctx, self.gguf.n_swa)
        except BaseException:
            ctx.close()
            raise
        return ctx, options, allocation

    def _adopt(self, ctx: Any, options: LlamaCppOptions, allocation: Any) -> None:
        self.ctx, self.options, self.allocation = ctx, options, allocation
        self.weights = ctx.weights_bytes()
        self.flash = self._logged_flash(ctx.log, options)
        self.compute_observed = observed_compute_bytes(ctx)
        self.device = "cuda" if any("cuda" in name.lower() for name, _ in ctx.buffers) else "cpu"
        import re

        logged = re.search(r"file type\s*=\s*(?:\(guessed\)\s*)?(\S+)", ctx.log)  # print_info: file type = F16
        self.dtype = (logged[1] if logged else self.gguf.file_type or "gguf").lower()

    @staticmethod
    def _logged_flash(log: str, options: LlamaCppOptions) -> str:
        """'on' or 'off' as llama.cpp resolved ``-fa`` (its log: "Flash Attention enabled", "flash_attn = enabled"
        or "flash_attn = auto -> enabled"); the option as given where the log does not say."""
        import re

        resolved = re.findall(r"Flash Attention (enabled|disabled)|flash_attn\s*=\s*(?:\w+\s*->\s*)?(enabled|disabled)",
                              log)
        if resolved:
            return "on" if "enabled" in resolved[-1] else "off"
        return options.flash_attn

    def close(self) -> None:
        self._cancel_reload()
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        self.sampler.close()

    @property
    def cells(self) -> int:
        """Cells of one sequence in the full cache: the most tokens this context holds."""
        return min(c.cells for c in self.allocation.caches[:1])

    @property
    def cache_key(self) -> str:
        o = self.options
        return o.type_k if o.type_k == o.type_v else f"{o.type_k}/{o.type_v}"

    @property
    def attn_impl(self) -> str:
        return f"fa-{self.flash}"

    # ------------------------------------------------------------------------------------ generation

    def prefill(self, prompt: str) -> Sample:
        ids = self.ctx.tokenize(prompt)
        if not ids:
            raise LlamaCppRunError("the prompt is empty: give at least one token of text")
        if len(ids) >= self.cells:
            raise LlamaCppRunError(f"the prompt is {len(ids):,} tokens, more than this context's {self.cells:,} cells; "
                                   "give a larger --context")
        t = self.clock()
        self.ctx.decode_all(ids, 0)
        self._prefill_s = self.clock() - t
        self.tokens = list(ids)
        return self._sample(PHASE_PREFILL, prompt)

    def full(self) -> bool:
        return len(self.tokens) >= self.cells

    def step(self) -> Sample:
        """Sample the next token from llama.cpp's logits, decode it, and measure."""
        token = self.sampler.sample(self.ctx)
        t = self.clock()
        self.ctx.decode([token], len(self.tokens))
        dt = self.clock() - t
        self.tokens.append(token)
        self.generated += 1
        if dt > 0:
            rate = 1.0 / dt
            self.tokens_per_s = rate if self.tokens_per_s is None else 0.8 * self.tokens_per_s + 0.2 * rate
        text = self._decoder.decode(self.ctx.piece(token))
        return self._sample(PHASE_DECODE, text)

    # ------------------------------------------------------------------------------------ samples

    def _sample(self, phase: str, text: str, event: str | None = None, **fields: Any) -> Sample:
        used = self.allocation.used(self.ctx.used_cells()) if self.ctx is not None and self.tokens else 0
        rss = None
        try:
            rss = int(self._process.memory_info().rss) if self._process is not None else None
        except Exception:  # noqa: BLE001 - not available is None, never 0
            pass
        weights_predicted = self.plan.weights
        return Sample(
            token=self.generated, phase=phase, time_s=self.clock() - self.t0, text=text,
            attention=self.attention, attn_impl=self.attn_impl, cache=self.cache_key, kernel=f"llama.cpp {self.device}",
            device=self.device, dtype=self.dtype,
            kv_bytes_held=used, kv_bytes_reserved=self.allocation.reserved, kv_bytes_storage=self.allocation.reserved,
            weights_bytes=self.weights, process_rss=rss,
            kv_bytes_predicted=self.plan.kv_bytes, weights_predicted=weights_predicted,
            activations_observed=self.compute_observed, activations_predicted=self.plan.compute_bytes,
            # every buffer llama.cpp allocates for the context: model, KV, compute and output (a part the plan cannot
            # predict is left out of the sum, not guessed)
            total_predicted=(weights_predicted + self.plan.kv_bytes + (self.plan.compute_bytes or 0)
                             + (self.plan.output_bytes or 0)) if weights_predicted is not None else None,
            tokens_per_s=self.tokens_per_s if phase == PHASE_DECODE else None, event=event,
            context_tokens=len(self.tokens), runtime=RUNTIME, **fields)

    def event(self, kind: str, text: str, **fields: Any) -> Sample:
        return self._sample(PHASE_EVENT, text, event=kind, **fields)

    def describe_allocation(self) -> str:
        a = self.allocation
        parts = [f"{c.cells:,} cells x {c.streams} x {c.layers} layers x {b:,} B per cell"
                 for c, b in zip(a.caches, a.bytes_per_cell)]
        return f"{' + '.join(parts)} = {a.reserved:,} B ({human_bytes(a.reserved)})"

    # ------------------------------------------------------------------------------------ switches

    def _settings_now(self) -> dict[str, str]:
        o = self.options
        return {"attention": self.attention, "attn-impl": self.attn_impl, "cache": self.cache_key,
                "cache-type": self.cache_key, "cache-type-k": o.type_k, "cache-type-v": o.type_v,
                "context": str(o.n_ctx)}

    def switch_fields(self, key: str, value: Any) -> dict[str, Any]:
        k = str(key).strip().lower().replace("_", "-")
        k = "attn-impl" if k in ("attn", "impl", "flash") else k
        return {"switch_key": k, "switch_before": self._settings_now().get(k), "switch_after": str(value).strip().lower()}

    def apply(self, key: str, value: Any) -> Sample:
        """A switch between two tokens: an event Sample (``switch``, ``refused`` or ``note``)."""
        fields = self.switch_fields(key, value)
        k = fields["switch_key"]
        if k in KERNEL_KEYS:
            return self._flash_switch(str(value), fields)
        if k in LLAMACPP_ATTENTION_KEYS:
            return self.event("refused", f"{k}={value} refused: {FIXED_LAYOUT} (this file's is {self.attention}, "
                                         f"-fa {self.flash}); load another GGUF to change it", **fields)
        try:
            k, parsed = parse_llamacpp_switch_value(k, str(value))
            wanted = self._options_for(k, parsed)
        except SettingsError as exc:
            return self.event("refused", f"{k}={value} refused: {exc}", **fields)
        if wanted == self.options:
            return self.event("note", f"{k} is already {fields['switch_before']}: nothing to reload", **fields)
        try:
            new_plan = plan(self.gguf, wanted)
        except SettingsError as exc:
            return self.event("refused", f"{k}={value} refused: {exc}", **fields)
        if len(self.tokens) >= new_plan.n_ctx_seq:
            return self.event("refused", f"{k}={value} refused: the {len(self.tokens):,} tokens so far do not fit in "
                                         f"{new_plan.n_ctx_seq:,} cells", **fields)
        return self._reload(wanted, new_plan, k, fields)

    def _flash_switch(self, value: str, fields: dict[str, Any]) -> Sample:
        """``attn-impl=fa-on`` / ``fa-off`` (``-fa``): the context created again with the other setting, the tokens
        decoded again; the compute buffer is what moves (flash attention never materialises the n_kv x n_tokens
        scores), the KV only where a quantized V needs flash attention."""
        wanted_fa = FLASH_VALUES.get(value.strip().lower())
        if wanted_fa is None:
            return self.event("refused", f"attn-impl={value} refused: llama.cpp's kernel setting is -fa: use fa-on, "
                                         "fa-off or fa-auto", **fields)
        if wanted_fa == self.options.flash_attn or (wanted_fa != "auto" and wanted_fa == self.flash):
            return self.event("note", f"attn-impl is already {self.attn_impl}: nothing to reload", **fields)
        wanted = dataclasses.replace(self.options, flash_attn=wanted_fa)
        try:
            new_plan = plan(self.gguf, wanted)
        except SettingsError as exc:
            return self.event("refused", f"attn-impl={value} refused: {exc}", **fields)
        return self._reload(wanted, new_plan, "attn-impl", fields)

    def _options_for(self, key: str, value: Any) -> LlamaCppOptions:
        o = self.options
        if key in ("cache", "cache-type"):
            return dataclasses.replace(o, type_k=value, type_v=value)
        if key == "cache-type-k":
            return dataclasses.replace(o, type_k=value)
        if key == "cache-type-v":
            return dataclasses.replace(o, type_v=value)
        return dataclasses.replace(o, n_ctx=int(value))

    # ---- a reload prepared off the token path (issue 37, item 2: F and C stood a SmolLM2-135M run still 6-12 s,
    # nearly all of it decoding the tokens so far again)

    def apply_live(self, key: str, value: Any) -> list[Sample]:
        """A switch pressed during the run: one that reloads the context loads the new one and decodes the tokens
        so far into it on a thread of this process while this context keeps generating (llama.cpp runs two
        contexts at once; ctypes lets go of the GIL in each call), and applies at a later token (``advance``).
        A press on the axis of one being prepared replaces it (back to what runs: a note); a press on another axis
        waits for it. Returns the events to emit now (a refusal, a note)."""
        job = self._job
        if job is not None:
            if self.switch_fields(key, value)["switch_key"] != job["key"]:
                self._held.append((key, value))
                return []
            self._cancel_reload()
        self._live = True
        try:
            answer = self.apply(key, value)
        finally:
            self._live = False
        return [] if answer is None else [answer]

    def advance(self) -> list[Sample]:
        """Between two tokens: the prepared reload's event once the new context holds every token (then it is the
        engine's context, and the old one is freed), else nothing."""
        job = self._job
        if job is None or not job["done"].is_set():
            return []
        if job["error"] is not None:
            self._job = None
            if job["ctx"] is not None:
                job["ctx"].close()
            exc = job["error"]
            return [self.event("refused", f"{job['key']}={job['fields']['switch_after']} refused: {exc}",
                               **job["fields"])]
        ctx, at = job["ctx"], job["at"]
        behind = self.tokens[at:]
        if behind:  # the tokens generated meanwhile, a few per token of the run
            chunk = behind[:CATCH_UP_TOKENS]
            ctx.decode_all(chunk, at)
            job["at"] = at + len(chunk)
            job["caught_up"] += len(chunk)
            if job["at"] < len(self.tokens):
                return []
        self._job = None
        old, before_bytes, compute_before = self.ctx, self.allocation.reserved, self.compute_observed
        self._adopt(ctx, job["options"], job["allocation"])
        self.plan = job["plan"]
        old.close()
        took = self.clock() - job["started"]
        out = [self._reloaded(job["key"], job["fields"], before_bytes, compute_before, took,
                              f"; prepared off the token path, {job['caught_up']:,} tokens generated meanwhile caught up")]
        held, self._held = self._held, []
        for key, value in held:  # the presses that waited for it
            out += self.apply_live(key, value)
        return out

    def preparing(self) -> str | None:
        """What the reload under way does, for the status line (None when none is)."""
        job = self._job
        if job is None:
            return None
        if not job["done"].is_set():
            return (f"preparing {job['key']} {job['fields']['switch_after']}: llama.cpp loads a second context and "
                    f"decodes the {job['at']:,} tokens so far into it\u2026 {self.clock() - job['started']:.0f} s; the "
                    "run goes on meanwhile")
        return (f"preparing {job['key']} {job['fields']['switch_after']}: catching up "
                f"{max(len(self.tokens) - job['at'], 0):,} tokens generated meanwhile\u2026")

    def _cancel_reload(self) -> None:
        job, self._job = getattr(self, "_job", None), None
        if job is not None:
            job["cancel"].set()
            job["thread"].join(60)
            if job["ctx"] is not None:
                job["ctx"].close()

    def _begin_reload(self, wanted: LlamaCppOptions, new_plan: LlamaCppPlan, key: str, fields: dict[str, Any]) -> None:
        job: dict[str, Any] = {"key": key, "fields": fields, "options": wanted, "plan": new_plan, "ctx": None,
                               "allocation": None, "error": None, "done": threading.Event(),
                               "cancel": threading.Event(), "at": len(self.tokens), "caught_up": 0,
                               "started": self.clock()}
        tokens = list(self.tokens)

        def prepare() -> None:
            try:
                ctx, _, allocation = self._open(wanted)
                job["ctx"], job["allocation"] = ctx, allocation
                for start in range(0, len(tokens), PREPARE_CHUNK):
                    if job["cancel"].is_set():
                        return
                    ctx.decode_all(tokens[start:start + PREPARE_CHUNK], start)
            except BaseException as exc:  # noqa: BLE001 - a refusal at the token it is noticed, never a dead thread
                job["error"] = exc
            finally:
                job["done"].set()

        job["thread"] = threading.Thread(target=prepare, name="kvscope-llamacpp-reload", daemon=True)
        self._job = job
        job["thread"].start()

    def _reloaded(self, key: str, fields: dict[str, Any], before_bytes: int, compute_before: Any, took: float,
                  how: str = "") -> Sample:
        after = self.allocation.reserved
        fields["switch_after"] = self._settings_now().get(key, fields["switch_after"])
        return self.event("switch", f"{key}: {fields['switch_before']} -> {fields['switch_after']}: llama.cpp reloaded "
                                    f"the context; KV reserved {human_bytes(before_bytes)} -> {human_bytes(after)} "
                                    f"({self.describe_allocation()}); compute buffer {_bytes(compute_before)} -> "
                                    f"{_bytes(self.compute_observed)} (predicted {_bytes(self.plan.compute_bytes)}); "
                                    f"re-ran {len(self.tokens)} tokens in {took:.2f} s{how}",
                          tokens_rerun=len(self.tokens), **fields)

    def _reload(self, wanted: LlamaCppOptions, new_plan: LlamaCppPlan, key: str, fields: dict[str, Any]) -> Sample | None:
        if getattr(self, "_live", False) and self.tokens:
            self._begin_reload(wanted, new_plan, key, fields)
            return None
        before_bytes, old_options, old_plan = self.allocation.reserved, self.options, self.plan
        compute_before = self.compute_observed
        self.ctx.close()
        self.ctx = None
        t = self.clock()
        try:
            self._load(wanted)
            self.plan = new_plan
            self.ctx.decode_all(self.tokens, 0)
        except SettingsError as exc:
            if self.ctx is not None:
                self.ctx.close()
            self._load(old_options)  # back to what ran, with the same tokens
            self.plan = old_plan
            self.ctx.decode_all(self.tokens, 0)
            return self.event("refused", f"{key}={fields['switch_after']} refused: {exc}", **fields)
        return self._reloaded(key, fields, before_bytes, compute_before, self.clock() - t)

