"""How the window's form (``kvscope.core.model.request.RunForm``) becomes a transformers run's request: the light
half, no torch (the window's process calls it through ``kvscope.core.runtimes.form_request``)."""

from __future__ import annotations

from kvscope.core.model.attention import SettingsError, parse_attention
from kvscope.core.model.caches import parse_cache
from kvscope.core.model.request import RunForm, RunRequest
from kvscope.core.model.settings import ATTN_IMPLS, RunSettings, parse_attn_impl
from kvscope.core.model.spec import SpecError


def _cache(key: str):
    """The Cache combo's key as a transformers cache; another runtime's key (a llama.cpp KV type shown after its
    run) is the dynamic cache, as a transformers run starts."""
    try:
        return parse_cache(key or "dynamic")
    except (SettingsError, SpecError, ValueError):
        return parse_cache("dynamic")


def form_request(form: RunForm) -> RunRequest:
    """A transformers run of the form's model: its attention, kernel, cache, max context, budget and probe."""
    settings = RunSettings(
        attention=parse_attention(form.attention) if form.attention else None,
        cache=_cache(form.cache),
        attn_impl=parse_attn_impl(form.attn_impl if form.attn_impl in ATTN_IMPLS else "sdpa"),
        max_context=form.max_context or None,
    )
    return RunRequest(**form.common(), device=form.device, dtype=form.dtype, settings=settings,
                      memory_budget=form.memory_budget, quality_probe=form.quality_probe)
