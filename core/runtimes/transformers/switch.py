"""A live switch of the transformers engine, all or nothing: the plan checked, the model and the cache converted
together and tried on one forward pass, everything undone on any failure.

The rules are the light half's (``switches.plan``: the same the window greys its keys with); here only what the
loaded model itself shows is checked besides (a class transformers runs with eager attention only, K/V projections
that cannot be regrouped, a quantized backend that cannot run in this process). The conversions are
``conversions.py``'s, the undo log ``transaction.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from typing import TYPE_CHECKING, Any

import torch

from kvscope.core.base.sample import PHASE_EVENT, Sample
from kvscope.core.model.attention import MLA, AttentionMode, SettingsError
from kvscope.core.model.caches import CacheStrategy, Quantized
from kvscope.core.model.settings import RunSettings, effective_spec, parse_attn_impl
from kvscope.core.runtimes.transformers import conversions, switches
from kvscope.core.runtimes.transformers.refusal import refuse
from kvscope.core.runtimes.transformers.state import FIELDS

if TYPE_CHECKING:
    from kvscope.core.runtimes.transformers.engine import Engine


@functools.lru_cache(maxsize=None)
def backend_problem(backend: str) -> str | None:
    """Why a quantized-cache backend cannot run in this process (None when it can), found by
    quantizing one small tensor the way transformers' cache layer does. optimum-quanto builds a
    C++ extension on first use, which fails where no compiler or torch headers exist (the desktop
    bundle): better a clear refusal at the switch than an error halfway through a forward pass."""
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    try:
        layer = (QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer)(nbits=4)
        probe = torch.zeros(1, 1, 4, 64)
        layer.update(probe, probe)  # the first update quantizes
    except ImportError:
        return f"it is not installed (pip install {'optimum-quanto' if backend == 'quanto' else 'hqq'})"
    except Exception as exc:  # noqa: BLE001 - extension build errors come as RuntimeError, OSError...
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


def state_of(engine: "Engine") -> switches.SwitchState:
    """The engine's settings as the light half judges a switch from them."""
    s = engine.settings
    return switches.SwitchState(attention=engine.mode, attn_impl=s.attn_impl, cache=s.cache, device=engine.device,
                                tokens=engine.seq_len if engine.cache is not None else 0,
                                cache_tokens=engine.cache_base_tokens, max_context=engine.max_context(),
                                ahead=engine.tokens_ahead(), dtype=s.kv_dtype or s.weight_dtype)


def plan(engine: "Engine", key: str, value: Any) -> switches.SwitchPlan:
    """``switches.plan`` from the engine's state (SettingsError: the key or the value does not parse)."""
    return switches.plan(engine.spec, state_of(engine), key, value)


def check_target(engine: "Engine", mode: AttentionMode, impl: str, strategy: CacheStrategy,
                 name: str | None = None) -> None:
    """Refuse, before anything changes, a combination of attention mode, kernel and cache this model cannot run
    (SettingsError with the reason): the plan's rules (``switches.refusal``), then what the loaded model shows.
    What this does not foresee, the transaction catches: it tries the new state on one forward pass and undoes
    everything if that fails. ``name``: the axis switched (None: the starting settings)."""
    now = state_of(engine)
    target = dataclasses.replace(now, attention=mode, attn_impl=impl, cache=strategy)
    why = switches.refusal(engine.spec, now, target, name or "")
    if why:
        raise SettingsError(why)
    check_model(engine, mode, impl)
    check_backend(strategy)


def check_model(engine: "Engine", mode: AttentionMode, impl: str) -> None:
    """What only the loaded model shows: a class transformers runs with eager attention only, K/V projections that
    cannot be regrouped (fused, shared, wider than the hidden state), a quantized backend that cannot run here."""
    from kvscope.core.runtimes.transformers import (
        convert)  # transformers, a 9 s import: not when serve() imports this module

    if impl != "eager" and not getattr(engine.base_model, "_supports_sdpa", True):
        raise SettingsError(f"transformers runs {type(engine.base_model).__name__} with eager attention only "
                            f"(it refuses sdpa for it, e.g. sdpa cannot softcap scores): {impl} is not available")
    eff = effective_spec(engine.spec, engine.settings.with_(attention=mode))
    if not isinstance(mode, MLA) and eff.num_kv_heads != engine.spec.num_kv_heads:
        convert.kv_heads_of(engine.base_model)  # SettingsError with the reason: fused QKV, MLA, MHA-only
        # ... or projections shared by several layers, or wider than the hidden state (the prediction's premise).
        convert.check_kv_projections(engine.base_model, engine.spec.num_kv_layers, engine.spec.hidden_size)
        from kvscope.core.runtimes.transformers import merge

        why = merge.head_change_problem(engine.base_model)  # a norm over all K/V heads at once (OLMo 2: issue 34)
        if why:
            raise SettingsError(why)


def check_backend(strategy: CacheStrategy) -> None:
    """A quanto / hqq cache whose backend cannot run in this process: refused with why."""
    if isinstance(strategy, Quantized) and strategy.backend in ("quanto", "hqq"):
        problem = backend_problem(strategy.backend)
        if problem:
            raise SettingsError(f"the {strategy.backend} cache backend cannot run here: {problem}; "
                                "quantized:fp8 (and quantized:hqq:4 where installed) need nothing extra")


def checked(engine: "Engine", key: str, value: Any) -> switches.SwitchPlan:
    """The plan of ``key=value`` with everything checked that can be before a change (SettingsError: refused)."""
    p = plan(engine, key, value)
    if p.no_change:
        return p
    if p.refusal:
        raise SettingsError(p.refusal)
    check_model(engine, p.target.attention, p.target.attn_impl)
    check_backend(p.target.cache)
    return p


def apply(engine: "Engine", key: str, value: Any) -> Sample:
    """``Engine.apply``: switch a setting between two tokens, all or nothing; the event Sample."""
    from kvscope.core.runtimes.transformers.transaction import (
        Snapshot)  # transformers, a 9 s import: not when serve() imports this module

    t = engine.clock()
    p = plan(engine, key, value)
    fields = p.fields()
    label, was, wanted = p.key, p.before, p.after
    if p.no_change:
        return engine._sample(PHASE_EVENT, f"{label}: {was} (no change: already {wanted})", event="note",
                              step_s=engine.clock() - t, **fields)
    engine._tokens_rerun = None
    engine._peak_fields = {}  # a re-run of this switch measures its own
    engine.progress(f"switching {label} to {wanted}\u2026")
    checked(engine, key, value)
    snapshot = Snapshot([engine.base_model, engine.model], engine.cache, engine.state, FIELDS)
    kernel_before = engine.kernel
    try:
        with torch.inference_mode():
            detail = conversions.convert_to(engine, p.name, getattr(p.target, p.name), p.eager_for)
            engine._trial_step()
            if p.name == "attn_impl":
                detail = f"kernel {engine.kernel}"  # as measured on the trial pass
                if engine.kernel == kernel_before:  # F on the CPU: nothing to see, and why (issue 37)
                    why = ("on the CPU sdpa picks PyTorch's flash kernel itself" if engine.kernel == "sdpa-flash-cpu"
                           else "PyTorch picks the kernel per call")
                    detail += f": the kernel that already ran ({why}), so neither the memory nor the speed moves"
    except Exception as exc:  # noqa: BLE001 - every failure is undone and reported as a refusal
        snapshot.restore()
        del snapshot
        gc.collect()
        refuse(exc)
    del snapshot
    gc.collect()
    now = engine._settings_now()[p.name]
    text = f"{label}: {was} -> {now} ({detail})"
    return engine._sample(PHASE_EVENT, text, event="switch", step_s=engine.clock() - t,
                          **(fields | {"switch_after": now, "tokens_rerun": engine._tokens_rerun}), **engine._take_peak())


def start(engine: "Engine", settings: RunSettings) -> None:
    """The run's starting settings applied to the model before the prefill, checked as a whole (attention x cache x
    device x architecture) first; a kernel the model or the cache cannot run with is eager instead, in a note."""
    # Apply the requested starting settings to the model before the prefill, checked as a whole
    # (attention x cache x device x architecture) first.
    target = settings.attention or engine.mode
    impl = parse_attn_impl(settings.attn_impl)
    if impl != "eager" and not getattr(engine.base_model, "_supports_sdpa", True):
        engine.notes.append(f"attn-impl {impl} is not available for {type(engine.base_model).__name__} (transformers "
                            "runs it with eager attention only): using eager")
        settings = settings.with_(attn_impl="eager")
        impl = "eager"
    if settings.cache.needs_attention_weights and impl != "eager":
        engine.notes.append(f"the {settings.cache.key} cache scores tokens by the attention they receive, which only "
                            f"eager attention returns: using attn-impl eager, not {impl}")
        settings = settings.with_(attn_impl="eager")
        impl = "eager"
    check_target(engine, target, impl, settings.cache)
    if target.key != engine.mode.key:
        conversions.set_attention(engine, target, live=False)
    engine.settings = engine.settings.with_(attention=engine.mode, cache=settings.cache)
    conversions.set_attn_impl(engine, settings.attn_impl)
