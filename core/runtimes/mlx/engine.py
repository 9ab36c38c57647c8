"""MLX as a live engine: a model in mlx-lm, fed the way ``mlx_lm.generate_step`` feeds it, one ``Sample`` per token.

What the figures mean on an MLX run:

- ``kv_bytes_reserved``: ``sum(c.nbytes for c in cache)`` over mlx-lm's cache objects (their K/V arrays, or the
  quantized caches' codes, scales and biases): what the arrays hold, zeros of the step included.
- ``kv_bytes_predicted``: ``kvscope.core.runtimes.mlx.predict``'s ModelTrack for the same history of updates, from the
  model's config and mlx-lm's rules alone (never from the arrays).
- ``kv_bytes_held``: the slots that hold tokens (the rest of the arrays is the prepaid 256-token step).
- ``allocator_allocated`` / ``allocator_peak``: ``mx.get_active_memory()`` / ``mx.get_peak_memory()``;
  ``allocator_reserved``: active plus ``mx.get_cache_memory()`` (freed buffers MLX keeps for reuse), as torch's
  reserved is allocated plus its cached blocks. The peak is reset before each pass (``mx.reset_peak_memory``), so
  each Sample's peak is that pass's.

Switches between two tokens: ``cache`` (kv, rotating:MAX[:KEEP], quantized:BITS[:GROUP]) converts the cache
objects (``KVCache.to_quantized`` as mlx-lm does for ``--kv-bits``; a rotating cache filled with the tokens it
would keep; a quantized one dequantized back), ``attention`` (mha, gqa:N, mqa) regroups the K/V projections and
the cached heads as ``kvscope.core.runtimes.transformers.convert.regroup_heads`` does in torch. What MLX cannot do is refused with the reason.

This module imports mlx and mlx_lm: only the engine's side (a run) imports it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from kvscope.core.base.errors import GenerationError
from kvscope.core.base.safe_text import safe_text
from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from kvscope.core.model.attention import SettingsError, native_attention
from kvscope.core.model.hf_config import read_config_json, spec_from_config
from kvscope.core.model.request import ModelInfo
from kvscope.core.model.spec import ModelSpec, SpecError, declared_max_positions
from kvscope.core.runtimes.mlx.convert import (  # noqa: F401 - layer_nbytes and regroup: their old home
    cache_nbytes, layer_nbytes, regroup, switch_attention, switch_cache)
from kvscope.core.runtimes.mlx.predict import (KV, PREFILL_STEP, QUANTIZED, ROTATING, MlxCache, ModelTrack, layer_cache,
                                               layers_of, parse_cache, prefill_peak, prompt_chunks, quantize_problem)

RUNTIME = "mlx"
#: The sampler: mlx-lm's own (``make_sampler``), top-k 40 at temperature 0.8, seeded.
TOP_K = 40
TEMPERATURE = 0.8
#: The kernel every MLX attention runs.
KERNEL = "mx.fast.scaled_dot_product_attention"
#: The caches the window offers (the C key cycles through them); ``offered_caches`` fits them to the model.
OFFERED = ("kv", "rotating:256:4", "quantized:8:64", "quantized:4:64")


class MlxRunError(SettingsError):
    """An MLX run failed for a reason written for the user."""


def check_prompt_fits(n_tokens: int, spec: ModelSpec) -> None:
    """Refuse, before the prefill, a prompt the model has no positions for (mlx-lm runs it whatever its length), as
    ``kvscope.core.runtimes.transformers.runtime.check_prompt_fits`` does, and one that fills every position (no token
    could follow: the run would end after 0 tokens). Only where the config names its maximum: the 2,048 a spec
    assumes otherwise is no reason to refuse."""
    limit = declared_max_positions(spec)
    if limit is None or n_tokens < limit:
        return
    if n_tokens > limit:
        raise GenerationError(f"the prompt is {n_tokens:,} tokens, more than {spec.label}'s maximum of {limit:,} "
                              "(max_position_embeddings); shorten it or use a model with a longer context")
    raise GenerationError(f"the prompt is {n_tokens:,} tokens, every one of {spec.label}'s {limit:,} positions "
                          "(max_position_embeddings): none is left for a token; shorten it or use a model with a "
                          "longer context")


def _itemsize(dtype: Any) -> int:
    return int(dtype.size)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("mlx.core.", "")


def model_dtype(model: Any) -> Any:
    """The dtype the model computes in: its quantized layers' scales, else its first floating parameter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    for name, p in params:
        if name.endswith(".scales"):
            return p.dtype
    for _, p in params:
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def _float_dtype(itemsize: int) -> Any:
    import mlx.core as mx

    return {4: mx.float32, 2: mx.float16}.get(int(itemsize), mx.float32)


def quantized_refusal(layers: Any, cache: MlxCache, dtype: Any = None) -> str | None:
    """What mlx-lm itself says to ``cache`` on these layers (None: it takes them): for each distinct layer shape, a
    ``QuantizedKVCache(group_size, bits)`` fed one token of zeros and mlx-lm's attention over it
    (``quantized_scaled_dot_product_attention``), evaluated. The reason is MLX's own message, on one line.

    ``parse_cache`` has already refused what would never reach this far (bits and groups ``mx.quantize`` refuses:
    a group of 0 is SIGFPE inside MLX, not an exception)."""
    if cache.kind != QUANTIZED:
        return None
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    for heads, k_dim, v_dim, itemsize in sorted({(l.heads, l.k_dim, l.v_dim, l.itemsize) for l in layers}):
        dt = dtype if dtype is not None else _float_dtype(itemsize)
        c = QuantizedKVCache(group_size=int(cache.group_size), bits=int(cache.bits))
        try:
            keys, values = c.update_and_fetch(mx.zeros((1, heads, 1, k_dim), dt), mx.zeros((1, heads, 1, v_dim), dt))
            out = scaled_dot_product_attention(mx.zeros((1, heads, 1, k_dim), dt), keys, values, cache=c, scale=1.0,
                                               mask=None)
            mx.eval(out, c.state[:2])
        except (ValueError, RuntimeError) as exc:
            said = " ".join(str(exc).split()) or type(exc).__name__
            return (f"mlx-lm's QuantizedKVCache(group_size={cache.group_size}, bits={cache.bits}) refuses this model's "
                    f"K/V ({heads} heads, head dims {k_dim}/{v_dim}): {said[:300]}")
    return None


def cache_used_bytes(cache: list[Any]) -> int:
    """Bytes of the slots that hold tokens: each layer's arrays scaled by the share of their slots in use."""
    total = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is None:
            continue
        slots = keys[0].shape[2] if isinstance(keys, (tuple, list)) else keys.shape[2]
        if slots:
            total += c.nbytes * min(int(c.offset), slots) // slots
    return total


def cache_refusal(layers: Any, cache: MlxCache, dtype: Any = None) -> str | None:
    """Why this cache cannot run on these layers, in one line (None: it can): mlx-lm's own word first (its message,
    ``quantized_refusal``), with the predictor's rule (``quantize_problem``, which agrees with it) and what to try."""
    said, rule = quantized_refusal(layers, cache, dtype), quantize_problem(layers, cache)
    if said and rule:
        return f"{said} ({rule})"
    return said or rule


def nonfinite_arrays(mx: Any, named: list[tuple[str, Any]]) -> str | None:
    """What is wrong when a model's floating-point MLX arrays hold NaN or infinity (None when none does), in the
    transformers loader's words: one sum per array, and only a non-finite one counted element by element."""
    for name, array in named:
        if not mx.issubdtype(array.dtype, mx.floating) or array.size == 0 or mx.isfinite(array.sum()).item():
            continue
        nan, inf = int(mx.isnan(array).sum().item()), int(mx.isinf(array).sum().item())
        if not nan and not inf:
            continue
        kind, count = ("NaN", nan) if nan else ("infinity", inf)
        what = (f"is all {kind} ({count:,} of {array.size:,} values)" if count == array.size
                else f"holds {kind} in {count:,} of {array.size:,} values")
        return f"hold {kind}: {name} {what}"
    return None


class MlxEngine:
    """One model in mlx-lm with one cache per layer, generating for one sequence; ``step`` returns a Sample per
    token. The same shape as ``kvscope.core.runtimes.llamacpp.engine.LlamaCppEngine``: ``prefill``, ``step``, ``apply``,
    ``close``, ``model_info``."""

    def __init__(self, folder: str | Path, cache: MlxCache | str = "kv", seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter, prefill_step: int = PREFILL_STEP,
                 label: str | None = None) -> None:
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler
        from mlx_lm.utils import load_model, load_tokenizer

        self.mx = mx
        self.folder = Path(folder)
        self.clock = clock
        self.t0 = clock()
        self.prefill_step = int(prefill_step)
        try:  # this process, for the RSS every sample carries
            import psutil

            self._process = psutil.Process()
        except Exception:  # noqa: BLE001
            self._process = None
        try:
            config = read_config_json(self.folder / "config.json")
            self.spec: ModelSpec = spec_from_config(config, label or self.folder.name)
        except SpecError as exc:
            raise MlxRunError(str(exc)) from None
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        try:
            self.model, self.config = load_model(self.folder)
            self.tokenizer = load_tokenizer(self.folder, eos_token_ids=self.config.get("eos_token_id"))
        except (ValueError, FileNotFoundError, KeyError, ImportError) as exc:
            # ImportError: a name mlx-lm imports from the folder's files (tokenizer_config.json's chat_template_type /
            # tool_parser_type, trusted with --trust-remote-code: kvscope.core.runtimes.mlx.load) that it lacks.
            said = " ".join(str(exc).split()) or type(exc).__name__
            raise MlxRunError(f"mlx-lm cannot load {self.folder.name}: {safe_text(said, limit=300)}") from None
        from mlx.utils import tree_flatten

        problem = nonfinite_arrays(mx, tree_flatten(self.model.parameters()))
        if problem:  # as the transformers loader says it (kvscope.core.runtimes.transformers.loading.nonfinite_weights)
            raise MlxRunError(f"{self.folder.name}: the model's weights {problem}; every token would come out of NaN "
                              "logits - the file is corrupt, or was saved from a diverged run")
        self.weights = int(sum(p.nbytes for _, p in tree_flatten(self.model.parameters())))
        self.load_active = mx.get_active_memory() - before
        self.dtype = model_dtype(self.model)
        self.itemsize = _itemsize(self.dtype)
        self.quantized_weights = any(n.endswith(".scales") for n, _ in tree_flatten(self.model.parameters()))
        self.native = native_attention(self.spec)
        self.attention = self.native.key
        self.spec_now = self.spec
        self.layers = layers_of(self.spec, self.itemsize)
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        # The caches mlx-lm gives this model (its make_cache: a RotatingKVCache for each sliding-window layer).
        # Only a model whose layers all take a plain KVCache is switched to other caches here.
        self.own_caches = not all(type(c) is KVCache for c in make_prompt_cache(self.model))
        self.cache_setting = parse_cache(cache) if isinstance(cache, str) else cache
        self._check_cache(self.cache_setting)
        self.cache = self._new_cache(self.cache_setting)
        self.track = ModelTrack(self.layers, self.cache_setting)
        self.predictable = self._predictable()
        self.tokens: list[int] = []
        self.generated = 0
        self.tokens_per_s: float | None = None
        self._logits = None
        mx.random.seed(int(seed) % (1 << 32))
        self.sampler = make_sampler(temp=TEMPERATURE, top_k=TOP_K)
        self.detok = self.tokenizer.detokenizer
        self.pass_peak: int | None = None

    # ------------------------------------------------------------------------------------ caches

    def _check_cache(self, cache: MlxCache) -> None:
        if self.own_caches and cache.kind != KV:
            raise MlxRunError(f"{self.spec.label} builds its own caches (mlx-lm's make_cache); KV Scope runs it with "
                              f"those, not {cache.key}")
        problem = cache_refusal(self.layers, cache, self.dtype)
        if problem:
            raise MlxRunError(problem)

    def _new_cache(self, cache: MlxCache) -> list[Any]:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

        if cache.kind == KV:
            return make_prompt_cache(self.model)  # what mlx-lm's generate_step makes
        out = []
        for layer in self.layers:
            c = layer_cache(layer, cache)
            if c.kind == ROTATING:
                out.append(RotatingKVCache(max_size=int(c.max_size), keep=c.keep))
            elif c.kind == QUANTIZED:
                out.append(QuantizedKVCache(group_size=int(c.group_size), bits=int(c.bits)))
            else:
                out.append(KVCache())
        return out

    def _predictable(self) -> bool:
        """Whether the predictor's layer kinds are the classes the model's caches really are."""
        if len(self.cache) != len(self.layers):
            return False
        for c, t in zip(self.cache, self.track.tracks):
            if type(c).__name__ != t.cache.class_name:
                return False
            if t.cache.kind == ROTATING and (c.max_size, c.keep) != (t.cache.max_size, t.cache.keep):
                return False
        return True

    @property
    def cache_key(self) -> str:
        return self.cache_setting.key

    # ------------------------------------------------------------------------------------ generation

    def close(self) -> None:
        self.cache = []
        self.model = None
        self._logits = None
        try:
            self.mx.clear_cache()
        except Exception:  # noqa: BLE001
            pass

    def _forward(self, ids: list[int]) -> Any:
        mx = self.mx
        logits = self.model(mx.array(ids)[None], cache=self.cache)
        return logits[:, -1, :]

    def prefill(self, prompt: str) -> Sample:
        """The prompt as ``generate_step`` feeds it: all but the last token in chunks of ``prefill_step``, then the
        last token alone (its logits give the first token). The Sample's peak is the whole prefill's."""
        mx = self.mx
        ids = list(self.tokenizer.encode(prompt))
        if not ids:
            raise MlxRunError("the prompt is empty: give at least one token of text")
        check_prompt_fits(len(ids), self.spec)  # mlx-lm itself never checks: a 99k-token prompt prefilled for minutes
        mx.reset_peak_memory()
        base = int(mx.get_active_memory())
        fresh = self.track.offset == 0 and self.cache_setting.kind == KV and self.predictable
        t = self.clock()
        at = 0
        for n in prompt_chunks(len(ids), self.prefill_step):
            chunk = ids[at:at + n]
            at += n
            logits = self._forward(chunk)
            self.track.feed(n)
            if at < len(ids):
                mx.eval([c.state for c in self.cache])
        mx.eval(logits)
        self._prefill_s = self.clock() - t
        self._logits = logits
        self.tokens = ids
        self.pass_peak = mx.get_peak_memory()
        # The prefill's peak beyond what was active before it, measured and predicted (a fresh KVCache only:
        # prefill_peak counts the KVCache's steps).
        predicted = (prefill_peak(self.layers, self.spec_now.hidden_size, self.spec_now.num_query_heads, len(ids),
                                  self.prefill_step) if fresh else None)
        return self._sample(PHASE_PREFILL, prompt, peak_bytes_observed=int(self.pass_peak) - base,
                            peak_bytes_predicted=predicted)

    def step(self) -> Sample:
        """Sample the next token from the last logits with mlx-lm's sampler, feed it, measure."""
        mx = self.mx
        logprobs = self._logits - mx.logsumexp(self._logits, keepdims=True)
        token = int(self.sampler(logprobs).item())
        mx.reset_peak_memory()
        t = self.clock()
        self._logits = self._forward([token])
        self.track.feed(1)
        mx.eval(self._logits, [c.state for c in self.cache])
        dt = self.clock() - t
        self.pass_peak = mx.get_peak_memory()
        self.tokens.append(token)
        self.generated += 1
        if dt > 0:
            rate = 1.0 / dt
            self.tokens_per_s = rate if self.tokens_per_s is None else 0.8 * self.tokens_per_s + 0.2 * rate
        self.detok.add_token(token)
        text = self.detok.last_segment
        return self._sample(PHASE_DECODE, text)

    def full(self) -> bool:
        return len(self.tokens) >= self.spec.max_position_embeddings

    # ------------------------------------------------------------------------------------ samples

    def kv_predicted(self) -> int | None:
        return self.track.nbytes if self.predictable else None

    def _sample(self, phase: str, text: str, event: str | None = None, **fields: Any) -> Sample:
        mx = self.mx
        rss = None
        try:
            rss = int(self._process.memory_info().rss) if self._process is not None else None
        except Exception:  # noqa: BLE001 - not available is None, never 0
            pass
        observed = cache_nbytes(self.cache)
        predicted = self.kv_predicted()
        weights_predicted = None if self.quantized_weights else self.spec_now.num_parameters * self.itemsize
        active = int(mx.get_active_memory())
        total = (weights_predicted + predicted) if weights_predicted is not None and predicted is not None else None
        return Sample(
            token=self.generated, phase=phase, time_s=self.clock() - self.t0, text=text,
            attention=self.attention, attn_impl="mlx-sdpa", cache=self.cache_key, kernel=KERNEL,
            device=self.device, dtype=_dtype_name(self.dtype),
            kv_bytes_reserved=observed, kv_bytes_held=cache_used_bytes(self.cache), kv_bytes_storage=observed,
            weights_bytes=self.weights,
            allocator_allocated=active, allocator_reserved=active + int(mx.get_cache_memory()),
            allocator_peak=self.pass_peak if self.pass_peak is not None else int(mx.get_peak_memory()),
            process_rss=rss, kv_bytes_predicted=predicted, weights_predicted=weights_predicted,
            total_predicted=total, tokens_per_s=self.tokens_per_s if phase == PHASE_DECODE else None, event=event,
            context_tokens=len(self.tokens), runtime=RUNTIME, **fields)

    def event(self, kind: str, text: str, **fields: Any) -> Sample:
        return self._sample(PHASE_EVENT, text, event=kind, **fields)

    @property
    def device(self) -> str:
        d = self.mx.default_device()
        return "gpu" if "gpu" in str(d).lower() else "cpu"

    def describe_cache(self) -> str:
        kinds = sorted({t.cache.describe() for t in self.track.tracks})
        return f"{', '.join(kinds)} x {len(self.cache)} layers"

    # ------------------------------------------------------------------------------------ switches

    def _settings_now(self) -> dict[str, str]:
        return {"attention": self.attention, "attn-impl": "mlx-sdpa", "cache": self.cache_key}

    def switch_fields(self, key: str, value: Any) -> dict[str, Any]:
        k = str(key).strip().lower().replace("_", "-")
        k = "attn-impl" if k in ("attn", "impl", "flash") else k
        return {"switch_key": k, "switch_before": self._settings_now().get(k), "switch_after": str(value).strip().lower()}

    def apply(self, key: str, value: Any) -> Sample:
        """A switch between two tokens: an event Sample (``switch``, ``refused`` or ``note``). A refused switch
        leaves the model and the caches as they were."""
        fields = self.switch_fields(key, value)
        k = fields["switch_key"]
        try:
            if k == "cache":
                return switch_cache(self, parse_cache(str(value)), fields)
            if k == "attention":
                return switch_attention(self, str(value), fields)
            if k == "attn-impl":
                raise SettingsError(f"MLX runs every attention with {KERNEL}: there is no other kernel to pick")
            raise SettingsError(f"{k} is not a setting an MLX run switches (cache, attention)")
        except SettingsError as exc:
            return self.event("refused", f"{k}={value} refused: {exc}", **fields)

    # ------------------------------------------------------------------------------------ the window

    def offered_caches(self) -> tuple[str, ...]:
        """The cache choices that fit this model (a group size that divides its head dim)."""
        out = []
        for key in OFFERED:
            c = parse_cache(key)
            if c.kind == QUANTIZED and quantize_problem(self.layers, c):
                c = MlxCache(QUANTIZED, bits=c.bits, group_size=32)
                if quantize_problem(self.layers, c):
                    continue
            if self.own_caches and c.kind != KV:
                continue
            out.append(c.key)
        if self.cache_key not in out:
            out.insert(0, self.cache_key)
        return tuple(dict.fromkeys(out))

    def model_info(self, source: str = "") -> ModelInfo:
        total = None
        try:
            import psutil

            total = int(psutil.virtual_memory().total)
        except Exception:  # noqa: BLE001
            pass
        heads = self.spec.num_query_heads
        choices = [self.native.key] + [k for k in ("mha", f"gqa:{heads // 2}" if heads % 2 == 0 and heads > 2 else "",
                                                   "mqa") if k]
        return ModelInfo(label=f"{self.spec.label} (MLX)", source=source or str(self.folder), device=self.device,
                         device_name="MLX on the CPU" if self.device == "cpu" else "MLX on the GPU (Metal)",
                         dtype=_dtype_name(self.dtype), spec=self.spec, total_memory=total,
                         attention_choices=tuple(dict.fromkeys(choices)),
                         cache_choices=tuple((c, None) for c in self.offered_caches()),
                         attn_impl_choices=("mlx-sdpa",), max_context=self.spec.max_position_embeddings,
                         runtime=RUNTIME)
