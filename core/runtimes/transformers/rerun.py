"""A switch that re-runs the tokens so far, prepared off the token path (issue 25, item 1).

Switching to MLA, leaving a sliding window or a token-selecting cache that dropped tokens, or moving to h2o
runs every token so far through the new model into a fresh cache: one batched pass, a prefill, whose time
grows with the run (2.5 s at 2,000 tokens for the embedded model on one CPU core). Done between two tokens,
the run stood still that long. Here:

1. ``begin`` (on the token thread, milliseconds) checks the whole target as ``Engine.apply`` does, then
   converts a *shadow* of the engine: the same fields, with structural copies of its models that share
   every weight tensor (conversions assign new tensors, they never write into one, so the running model
   is untouched) and a fresh cache. A switch that needs no re-run is applied at once, as before.
2. A background thread runs the one batched pass over the N tokens so far on the shadow (forward hooks on
   the decoder layers count progress and can cancel it). The run goes on under the current settings.
3. ``advance`` (on the token thread, between two tokens) catches the shadow up on the tokens generated
   meanwhile, a few per token, each as the decode step the engine would have run after a switch at
   token N; then the trial pass, and the shadow's state becomes the engine's: the switch applies at
   the next token.

The cache after the switch is byte for byte what ``Engine.apply`` at token N followed by the same decode
steps leaves (``cache_base_tokens`` = N, so the predictor's quantized residual and windows agree).
Engine side only (imports torch).
"""

from __future__ import annotations

import copy
import gc
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.runtimes.transformers import conversions, predicted, switch
from kvscope.core.runtimes.transformers.refusal import refuse

if TYPE_CHECKING:
    from kvscope.core.runtimes.transformers.engine import Engine

#: Catch-up decode steps run between two of the run's tokens: at least this many (so the shadow gains on
#: the run), more while under CATCH_UP_S. A quarter of a second per token of the run: the tokens slow while the
#: shadow catches up, none stops for long (at 0.05 s a re-run under h2o at 4,700 tokens fell 2,057 tokens behind
#: and took minutes to apply: each catch-up step there costs a run step, so the shadow gained 1 token per token).
CATCH_UP_MIN = 2
CATCH_UP_S = 0.25
#: Where a cache holds every token (dynamic or static, no sliding layer, no state beside K/V), the tokens generated
#: meanwhile go through the new model together, up to this many between two of the run's tokens: the same bytes
#: as one by one (the values equal to rounding), in the time of a few steps.
CATCH_UP_CHUNK = 64
#: The background thread, its pass done, catches the shadow up on the tokens generated meanwhile until this few are
#: left; the token thread does the rest between two tokens. It did them all there: on SmolLM2-135M at 1,000 tokens,
#: C to static stood the run still 2-4.5 s (16 tokens through a 4,096-slot static cache in one gap, issue 37).
CATCH_UP_LEFT = 2
#: It stops sooner when this many rounds in a row bring it no closer (the token thread then catches up the rest).
CATCH_UP_IDLE = 4
#: The status line is refreshed at most this often while the pass runs.
PROGRESS_EVERY_S = 0.25
#: A switch that needs no re-run but converts a cache of at least this many bytes (a cache moved into a static,
#: quantized or offloaded one, K/V heads regrouped or requantized, a window cut) is converted off the token path
#: too: on SmolLM2-135M at 1,000 tokens (46 MiB of fp32 K/V) C stood the run still 2.8-3.8 s and key 1 under hqq
#: 7.0 s (issue 37, item 2). Below it a conversion takes milliseconds and applies at once, as always.
PREPARE_BYTES = 8 << 20


class _Cancelled(Exception):
    """Raised by a layer hook inside the background pass when a newer press replaced this switch."""


@dataclass
class PreparedSwitch:
    """A switch whose re-run is under way: the shadow engine, its thread, and how far it has come."""

    key: str
    value: Any
    axis: str  # attention / attn-impl / cache
    wanted: str  # the target, in its canonical spelling
    fields: dict[str, Any]  # switch_key / switch_before / switch_after
    shadow: Any  # an Engine
    tokens: int  # N: the tokens the batched pass runs
    layers: int
    started: float
    what: str  # "attention mla", for the status line
    detail: str  # what the conversion did, for the event
    thread: threading.Thread | None = None
    layers_done: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    said: float = 0.0
    caught_up: int = 0
    #: (name, parsed, eager_for): the conversion itself runs on the background thread too (a switch with no
    #: re-run whose cache is large: ``PREPARE_BYTES``), from a frozen copy of the live cache.
    convert: tuple[str, Any, str | None] | None = None
    #: The trial pass ran on the background thread (its profiled forward: 1.6 s of the 1.9 s a switch stood the
    #: run still on SmolLM2-135M, parsing kineto's events), at token N; the catch-up steps follow it.
    trialled: bool = False
    #: The running engine, whose newest tokens the background thread catches up on (``_catch_up_behind``).
    live: Any = None

    @property
    def fraction(self) -> float:
        """How much of the batched pass is done, 0..1 (by decoder layers)."""
        return 1.0 if self.done.is_set() else min(self.layers_done / max(self.layers, 1), 0.99)

    def cancel(self, join_s: float = 30.0) -> None:
        """Stop the background pass at its next layer and wait for the thread (the shadow is dropped)."""
        self.cancel_flag.set()
        if self.thread is not None:
            self.thread.join(join_s)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the children of its longest ``ModuleList`` (``model.model.layers``)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def shadow_models(models: list[nn.Module | None]) -> list[nn.Module | None]:
    """Structural copies of ``models`` (modules, configs, attributes) that share every parameter, buffer and
    tensor attribute with the originals: no weight is copied. Modules shared between the models (a Llama's
    sliding-window twin holds the Llama's own layers) stay shared between the copies."""
    memo: dict[int, Any] = {}
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for tensor in table.values():
                    if tensor is not None:
                        memo[id(tensor)] = tensor
            for value in vars(module).values():
                if isinstance(value, torch.Tensor):
                    memo[id(value)] = value
    return list(copy.deepcopy(tuple(models), memo))


def can_prepare(engine: "Engine") -> str | None:
    """Why a switch of this engine cannot be prepared off the token path (None when it can): SDPA's flash
    kernel is chosen by a process-wide flag that the background pass would impose on the run's own tokens,
    and an offloaded cache moves layers on CUDA streams of the run."""
    if engine.kernel == "sdpa-flash" or engine.settings.attn_impl == "flash":
        return "sdpa's flash kernel is selected process-wide"
    if engine.settings.cache.name == "offloaded":
        return "an offloaded cache streams layers on the run's own CUDA streams"
    if engine.ids is None or not engine.seq_len or engine.cache is None:
        return "nothing to re-run yet"
    return None


def may_rerun(engine: "Engine", name: str, parsed: Any) -> bool:
    """Whether switch ``name=parsed`` may re-run the tokens so far, judged from the settings alone: the plan's answer
    (``switches.plan``; the engine's own conversions decide: this only spares the others a shadow: a switch judged
    False applies at once, as it always did, and one judged True that turns out not to re-run does too)."""
    from kvscope.core.runtimes.transformers import switch

    return switch.plan(engine, {"attn_impl": "attn-impl"}.get(name, name), parsed).reruns


def frozen_cache(cache: Any) -> Any:
    """A copy of ``cache`` that the run's next tokens do not reach: the cache object and each layer copied, sharing
    their tensors (a token's update assigns new tensors to the live layers, never into these), except the few a
    layer updates in place (a static layer's count, a full static sliding buffer: cloned, as the transaction's
    undo log does). Conversions read it and assign into the copies, so the live cache is never touched."""
    from kvscope.core.runtimes.transformers.transaction import CacheSnapshot

    frozen = copy.copy(cache)
    layers = []
    for layer in getattr(cache, "layers", None) or []:
        twin = copy.copy(layer)
        vars(twin).update(CacheSnapshot._layer_fields(layer))
        layers.append(twin)
    if hasattr(cache, "layers"):
        frozen.layers = layers
    return frozen


def worth_preparing(engine: "Engine", name: str, parsed: Any) -> bool:
    """Whether a switch that needs no re-run should still be converted off the token path: a cache or attention
    switch of a cache of at least ``PREPARE_BYTES``, and an aligned merge of heads at any size (a kernel switch
    converts nothing; a token-selecting cache's layers evict in place and stay on the token path)."""
    if name not in ("cache", "attention") or engine.cache is None or not engine.seq_len:
        return False
    from kvscope.core.model.caches import Dynamic, TokenSelecting

    if isinstance(engine.settings.cache, TokenSelecting) or (name == "cache" and isinstance(parsed, TokenSelecting)):
        return False
    if name == "attention" and conversions.merging(engine, parsed):
        return True  # the aligned merge fits every layer's maps on the tokens so far: seconds on a real model
    from kvscope.core.prediction.predict import kv_bytes

    try:  # the tokens' K/V as a dynamic cache holds them: what a quantized cache dequantizes to convert
        dense = kv_bytes(engine.spec, predicted.prediction_settings(engine).with_(cache=Dynamic()), engine.seq_len)
    except Exception:  # noqa: BLE001 - a prediction that cannot be made: the switch as it always was
        return False
    return dense >= PREPARE_BYTES


def begin(engine: "Engine", key: str, value: Any) -> "Sample | PreparedSwitch":
    """Start switch ``key=value``: the event Sample when it applies at once (no re-run needed, no change, or one
    that cannot be prepared off the token path), else a PreparedSwitch whose pass runs in the background.
    Raises SettingsError (the refusal) with nothing changed, as ``Engine.apply``."""
    from kvscope.core.runtimes.transformers.transaction import CacheSnapshot

    asked = switch.plan(engine, key, value)
    name, parsed, fields = asked.name, getattr(asked.target, asked.name), asked.fields()
    label, wanted = asked.key, asked.after
    if asked.no_change or can_prepare(engine) is not None:
        return engine.apply(key, value)  # "no change"; the old way
    rerun = may_rerun(engine, name, parsed)
    if not rerun and not worth_preparing(engine, name, parsed):
        return engine.apply(key, value)  # a switch with no re-run and a small cache: at once, as always
    eager_for = switch.checked(engine, key, value).eager_for
    try:
        shadow = copy.copy(engine)
        shadow.state = engine.state.copy()  # the value the shadow converts and hands back (advance)
        shadow.base_model, shadow.model = shadow_models([engine.base_model, engine.model])
    except Exception:  # noqa: BLE001 - a model that cannot be copied structurally: the switch the old way
        return engine.apply(key, value)
    shadow._defer_rerun = True
    shadow._rerun_why = None
    shadow.state.tokens_rerun = None
    shadow._peak_fields = {}
    shadow.progress = lambda text: None
    if not rerun:
        # The conversion itself off the token path, from a copy of the cache the run's tokens do not reach.
        shadow.cache = frozen_cache(engine.cache)
        engine.progress(f"preparing {label} {wanted} off the token path ({shadow.seq_len:,} tokens' cache)\u2026 the "
                        "run goes on meanwhile")
        return _start(engine, shadow, key, value, fields, "", convert=(name, parsed, eager_for))
    live_cache = CacheSnapshot(engine.cache)  # conversions before a re-run may rewrite the live cache in place
    try:
        with torch.inference_mode():
            detail = conversions.convert_to(shadow, name, parsed, eager_for)
    except Exception as exc:  # noqa: BLE001 - the running engine is untouched; its cache fields put back
        live_cache.restore()
        del shadow
        gc.collect()
        refuse(exc)
    live_cache.restore()
    if shadow._rerun_why is None or can_prepare(shadow) is not None:
        del shadow  # nothing to run in the background: the switch as it always was, at this token
        gc.collect()
        return engine.apply(key, value)
    engine.progress(f"re-running {shadow.seq_len:,} tokens ({shadow._rerun_why}) for {label} {wanted} in one pass, "
                    "off the token path\u2026 0%; the run goes on meanwhile")
    return _start(engine, shadow, key, value, fields, detail)


def _start(engine: "Engine", shadow: Any, key: str, value: Any, fields: dict[str, Any], detail: str,
           convert: tuple[str, Any, str | None] | None = None) -> PreparedSwitch:
    """The PreparedSwitch of ``shadow`` at the engine's token, its background thread started: the batched pass, and
    first the conversion itself where ``convert`` says which."""
    label, wanted = fields["switch_key"], fields["switch_after"]
    prep = PreparedSwitch(key=key, value=value, axis=label, wanted=wanted, fields=fields, shadow=shadow,
                          tokens=shadow.seq_len, layers=len(decoder_layers(shadow.model)), started=engine.clock(),
                          what=f"{label} {wanted}", detail=detail, convert=convert, live=engine)
    prep.thread = threading.Thread(target=_fill, args=(prep,), name="kvscope-prepare" if convert else "kvscope-rerun",
                                   daemon=True)
    prep.thread.start()
    return prep


def _fill(prep: PreparedSwitch) -> None:
    """The background thread: the one batched pass over the shadow's tokens into its fresh cache."""
    shadow = prep.shadow
    handles = []

    def before(module: nn.Module, args: Any) -> None:
        if prep.cancel_flag.is_set():
            raise _Cancelled()

    def after(module: nn.Module, args: Any, output: Any) -> None:
        prep.layers_done += 1

    try:
        if prep.convert is not None:  # the conversion first (a switch with no re-run: usually nothing follows)
            with torch.inference_mode():
                prep.detail = conversions.convert_to(shadow, *prep.convert)
            if shadow._rerun_why is None:
                prep.layers_done = prep.layers
                with torch.inference_mode():
                    shadow._trial_step()
                prep.trialled = True
                _catch_up_behind(prep)
                return
            prep.detail += " (prepared off the token path)"
        for layer in decoder_layers(shadow.model):
            handles.append(layer.register_forward_pre_hook(before))
            handles.append(layer.register_forward_hook(after))
        with torch.inference_mode(), shadow._forward_context():
            out = shadow._measured_forward()
        shadow.state.next_logits = out.logits[:, -1, :].float()
        shadow.cache = out.cache if getattr(out, "cache", None) is not None else shadow.cache
        for handle in handles:
            handle.remove()
        handles.clear()
        with torch.inference_mode():
            shadow._trial_step()
        prep.trialled = True
        _catch_up_behind(prep)
    except BaseException as exc:  # noqa: BLE001 - the token thread reports it (a refusal), never a dead thread
        prep.error = exc
    finally:
        for handle in handles:
            handle.remove()
        prep.done.set()


def _catch_up_behind(prep: PreparedSwitch) -> None:
    """On the background thread, after the pass and the trial: the tokens the run generated meanwhile through the
    shadow, as ``advance`` runs them (a chunk where the cache holds every token, else one by one), until
    ``CATCH_UP_LEFT`` are left for the token thread. The run's tokens are read, never written."""
    shadow, live = prep.shadow, prep.live
    if live is None:
        return
    chunk = CATCH_UP_CHUNK if _holds_every_token(shadow) else 1
    least, idle = None, 0
    with torch.inference_mode():
        while not prep.cancel_flag.is_set():
            ids = live.ids  # the run's tokens now (the token thread replaces the tensor, never writes into it)
            end = (ids.shape[1] if ids is not None else 0) - CATCH_UP_LEFT
            at = shadow.seq_len
            if end <= at:
                return
            # No closer for a few rounds (the run makes a token per step as fast as the shadow takes one, a cache
            # caught up one by one on two busy cores): the token thread finishes it, as before, the run waiting.
            idle = idle + 1 if least is not None and end - at >= least else 0
            least = end - at if least is None else min(least, end - at)
            if idle >= CATCH_UP_IDLE:
                return
            token = ids[:, at:min(at + chunk, end)]
            with shadow._forward_context():
                out = shadow.model(input_ids=token, cache=shadow.cache, use_cache=True, logits_to_keep=1)
            shadow.ids = torch.cat([shadow.ids, token], dim=1)
            shadow.state.next_logits = out.logits[:, -1, :].float()
            prep.caught_up += int(token.shape[1])


def _holds_every_token(shadow: "Engine") -> bool:
    """Whether the shadow's cache keeps every token as it comes, whatever the update's length (dynamic or static
    layers, full attention, no state beside K/V): then a catch-up of several tokens at once holds what as many
    single steps hold. Quantized (residual flushes), sink / h2o (eviction per update) and windows: one by one."""
    from kvscope.core.model.settings import effective_spec

    if shadow.settings.cache.name not in ("dynamic", "static"):
        return False
    eff = effective_spec(shadow.spec, shadow.settings)
    return not eff.num_sliding_layers and not eff.layer_states and eff.num_full_layers == eff.num_layers


def advance(engine: "Engine", prep: PreparedSwitch) -> Sample | None:
    """Between two tokens: None while the switch is being prepared (the status line says how far), else the
    switch's event Sample once the shadow has caught up and passed its trial step; the engine then runs the
    new settings. Raises SettingsError (the refusal, nothing changed) if the pass or the trial failed."""
    shadow = prep.shadow
    now = engine.clock()
    if not prep.done.is_set():
        if now - prep.said >= PROGRESS_EVERY_S:
            prep.said = now
            if prep.convert is not None and shadow._rerun_why is None:
                engine.progress(f"preparing {prep.what}: converting the cache of {prep.tokens:,} tokens off the "
                                f"token path\u2026 {now - prep.started:.0f} s; the run goes on meanwhile")
            else:
                engine.progress(f"preparing {prep.what}: re-running {prep.tokens:,} tokens\u2026 "
                                f"{prep.fraction:.0%}; the run goes on meanwhile")
        return None
    if prep.error is not None:
        error, prep.error = prep.error, None
        prep.shadow = None
        refuse(error)
    deadline = now + CATCH_UP_S
    steps = 0
    chunk = CATCH_UP_CHUNK if _holds_every_token(shadow) else 1
    with torch.inference_mode():
        while shadow.seq_len < engine.seq_len and (steps < CATCH_UP_MIN or engine.clock() < deadline):
            at = shadow.seq_len
            token = engine.ids[:, at:at + chunk]
            with shadow._forward_context():
                out = shadow.model(input_ids=token, cache=shadow.cache, use_cache=True, logits_to_keep=1)
            shadow.ids = torch.cat([shadow.ids, token], dim=1)
            shadow.state.next_logits = out.logits[:, -1, :].float()
            steps += int(token.shape[1])
    prep.caught_up += steps
    behind = engine.seq_len - shadow.seq_len
    if behind > 0:
        if engine.clock() - prep.said >= PROGRESS_EVERY_S:
            prep.said = engine.clock()
            engine.progress(f"preparing {prep.what}: catching up {behind:,} tokens generated meanwhile\u2026 "
                            "the run goes on meanwhile")
        return None
    try:
        if not prep.trialled:
            with torch.inference_mode():
                shadow._trial_step()
    except Exception as exc:  # noqa: BLE001 - the running engine was never touched
        prep.shadow = None
        refuse(exc)
    engine.state = shadow.state  # the shadow's state, handed back whole
    peak = shadow._take_peak()
    prep.shadow = None
    gc.collect()
    now_setting = engine._settings_now()[prep.axis.replace("-", "_")]
    detail = prep.detail
    if prep.convert is not None and engine.state.tokens_rerun is None:
        detail += "; converted off the token path" + (f", {prep.caught_up:,} tokens generated meanwhile caught up"
                                                      if prep.caught_up else "")
    elif prep.caught_up:
        detail += f"; {prep.caught_up:,} tokens generated meanwhile caught up"
        engine.state.tokens_rerun = prep.tokens + prep.caught_up
    text = f"{prep.axis}: {prep.fields['switch_before']} -> {now_setting} ({detail})"
    return engine._sample(PHASE_EVENT, text, event="switch", step_s=engine.clock() - prep.started,
                          **(prep.fields | {"switch_after": now_setting, "tokens_rerun": engine.state.tokens_rerun}),
                          **peak)


def wait(engine: "Engine", prep: PreparedSwitch, timeout_s: float = 600.0) -> Sample:
    """Finish ``prep`` at once (a test, or the end of a run): wait for the pass, catch up, apply."""
    prep.done.wait(timeout_s)
    while True:
        sample = advance(engine, prep)
        if sample is not None:
            return sample
        time.sleep(0)
