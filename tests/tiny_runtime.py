"""A tiny runtime written in the tests: the proof that a runtime is one module and one registry entry.

Its "model" is the embedded model's config (``kvscope.core.model.sources.load_spec``: no weights, no torch) and its cache a fake
that allocates in fixed chunks of N tokens, as a paged cache does: ``kv_bytes_reserved`` is the whole chunks,
``kv_bytes_held`` the tokens in them. Its switch is the chunk size (``cache=chunk:N``: the cache is
allocated again and keeps its tokens); an attention switch is refused, as one kind of answer. Pure Python.

``register_tiny()`` adds it through ``kvscope.core.runtimes.register`` (the public function) and returns its entry;
``kvscope.core.runtimes.unregister(NAME)`` removes it. Nothing else in the project names it.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Callable

from kvscope.core import runtimes
from kvscope.core.base.sample import PHASE_DECODE, PHASE_EVENT, PHASE_PREFILL, Sample
from kvscope.core.model.attention import SettingsError, native_attention
from kvscope.core.model.request import ModelInfo, RunRequest
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import ModelSpec

NAME = "tiny-chunks"
CHUNK = 16  # tokens per chunk at the start
ELEMENT_BYTES = 2  # fp16 K and V


def parse_switch(key: str, value: str) -> tuple[str, Any]:
    """``cache=chunk:N`` (1 <= N <= 4096); ``attention=...`` is taken here and refused by the run."""
    k = key.strip().lower()
    if k == "cache":
        match = re.fullmatch(r"chunk:([0-9]{1,4})", value.strip().lower())
        if not match or not 1 <= int(match[1]) <= 4096:
            raise SettingsError(f"cache={value!r}: the tiny runtime's cache is chunk:N, N from 1 to 4096 tokens")
        return k, int(match[1])
    if k == "attention":
        return k, value.strip().lower()
    raise SettingsError(f"unknown setting {key!r} for a {NAME} run; use cache=chunk:N")


class ChunkedCache:
    """A fake KV cache that allocates ``chunk`` tokens at a time: ``bytes_per_token`` per token held."""

    def __init__(self, chunk: int, bytes_per_token: int) -> None:
        self.chunk, self.bytes_per_token, self.tokens, self.chunks = chunk, bytes_per_token, 0, 0

    def append(self, n: int) -> None:
        self.tokens += n
        self.chunks = max(self.chunks, math.ceil(self.tokens / self.chunk))  # a new chunk only when one is full

    @property
    def held(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def reserved(self) -> int:
        return self.chunks * self.chunk * self.bytes_per_token


class TinyRuntime:
    """A ``kvscope.core.runtimes.base.Runtime`` over a ChunkedCache."""

    name = NAME

    def __init__(self, request: RunRequest, progress: Callable[[str], None]) -> None:
        self.request, self.progress = request, progress
        self.spec: ModelSpec | None = None
        self.generated = 0
        self.cache: ChunkedCache | None = None
        self.t0 = time.perf_counter()

    def load(self) -> None:
        self.spec = load_spec(self.request.source)
        s = self.spec
        self.per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * ELEMENT_BYTES
        self.cache = ChunkedCache(CHUNK, self.per_token)
        self.attention = native_attention(s).key

    def model_info(self) -> ModelInfo:
        return ModelInfo(label=f"{self.spec.label} ({NAME})", source=self.request.source, device="cpu",
                         device_name="a Python list", dtype="float16", spec=self.spec, total_memory=None,
                         attention_choices=(self.attention,), cache_choices=(("chunk:16", None), ("chunk:64", None)),
                         attn_impl_choices=("python",), max_context=self.spec.max_position_embeddings, runtime=NAME)

    def settings(self, request: RunRequest) -> dict[str, Any]:
        return {"runtime": NAME, "attention": self.attention, "attn_impl": "python", "cache": self._cache_key,
                "max_context": self.spec.max_position_embeddings, "max_new_tokens": request.max_new_tokens,
                "source": request.source, "switches": [list(s) for s in request.switches]}

    @property
    def _cache_key(self) -> str:
        return f"chunk:{self.cache.chunk}"

    def _sample(self, phase: str, text: str, event: str | None = None, **fields: Any) -> Sample:
        c = self.cache
        return Sample(token=self.generated, phase=phase, time_s=time.perf_counter() - self.t0, text=text,
                      attention=self.attention, attn_impl="python", cache=self._cache_key, kernel="python",
                      device="cpu", dtype="float16", kv_bytes_held=c.held, kv_bytes_reserved=c.reserved,
                      kv_bytes_storage=c.reserved, weights_bytes=0, kv_bytes_predicted=self.plan(c.tokens),
                      weights_predicted=0, total_predicted=self.plan(c.tokens), context_tokens=c.tokens,
                      tokens_per_s=1000.0 if phase == PHASE_DECODE else None, event=event, runtime=NAME, **fields)

    def start_events(self, request: RunRequest) -> list[Sample]:
        return [self.event("load", f"loaded {self.spec.label} into a fake cache of {CHUNK}-token chunks")]

    def prefill(self, request: RunRequest) -> list[Sample]:
        self.cache.append(max(1, len(request.prompt.split())))
        return [self._sample(PHASE_PREFILL, request.prompt)]

    def step(self) -> Sample:
        self.cache.append(1)
        self.generated += 1
        return self._sample(PHASE_DECODE, f" t{self.generated}")

    def apply(self, key: str, value: str) -> Sample:
        k = key.strip().lower()
        fields = {"switch_key": k, "switch_before": self._cache_key if k == "cache" else self.attention,
                  "switch_after": str(value)}
        try:
            k, parsed = parse_switch(k, str(value))
        except SettingsError as exc:
            return self.event("refused", f"{key}={value} refused: {exc}", **fields)
        if k == "attention":
            return self.event("refused", f"attention={value} refused: the tiny runtime has one layout", **fields)
        if parsed == self.cache.chunk:
            return self.event("note", f"cache is already chunk:{parsed}: nothing to do", **fields)
        before = self.cache.reserved
        tokens = self.cache.tokens
        self.cache = ChunkedCache(parsed, self.per_token)
        self.cache.append(tokens)
        return self.event("switch", f"cache: chunk:{fields['switch_before'].split(':')[1]} -> chunk:{parsed}: reserved "
                                    f"{before:,} -> {self.cache.reserved:,} B", **fields)

    def event(self, kind: str, text: str, **fields: Any) -> Sample:
        return self._sample(PHASE_EVENT, text, event=kind, **fields)

    def room(self) -> str | None:
        return None

    def plan(self, tokens: int) -> int | None:
        return math.ceil(tokens / self.cache.chunk) * self.cache.chunk * self.per_token

    def budget_need(self, ahead: int) -> int | None:
        return None

    def out_of_memory(self, exc: BaseException, where: str) -> str | None:
        return None

    def error_context(self) -> str:
        return f"(at token {self.generated}; {NAME}, cache {self._cache_key})"

    def close(self) -> None:
        self.cache = None if self.cache is None else self.cache


def open_tiny(request: RunRequest, progress: Callable[[str], None]) -> TinyRuntime:
    return TinyRuntime(request, progress)


def register_tiny() -> runtimes.RuntimeInfo:
    """The one registry entry: through the public function, at run time."""
    return runtimes.register(runtimes.RuntimeInfo(
        name=NAME, open=open_tiny, label="a fake cache in chunks (tests)", parse_switch=parse_switch,
        reserves_at_load=True))
