"""One forward pass being replayed: its shapes in bytes, the machine it runs on, its heap and what it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvscope.core.model.spec import ModelSpec, dtype_bytes
from kvscope.core.prediction.replay.heap import FP32, Heap


def config_value(spec: ModelSpec, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the model's config sets (not None), else ``default``."""
    for name in names:
        value = spec.config.get(name)
        if value is not None:
            return value
    return default


def rotary_dims(spec: ModelSpec, head_dim: int) -> int:
    """Dims of each head rotary turns (even): all of them, or the config's partial rotary factor's share."""
    rope_parameters = spec.config.get("rope_parameters")
    factor = config_value(spec, "partial_rotary_factor", "rotary_pct") or (
        rope_parameters.get("partial_rotary_factor") if isinstance(rope_parameters, dict) else None)
    rotary = int(head_dim * float(factor or 1.0))
    return rotary - rotary % 2


@dataclass
class Pass:
    """The pass's sizes (``b`` sequences of ``s`` new tokens attending ``kv`` keys, ``past`` of them cached before),
    its dtypes' bytes (``dt`` the model's, ``kv_dt`` the cache's), the model's widths, the machine (``device``,
    ``threads``, ``matmul_scratch``), the heap, and the tensors the base model holds across its layers."""

    spec: ModelSpec
    b: int
    s: int
    past: int
    dt: Any
    kv_dt: Any
    heads: int
    kvh: int
    hd: int
    layers: int
    eager: bool
    window: int | None  # the sliding window, where some layer slides
    masks: int  # eager's causal masks: one, or a full and a sliding one
    device: str = "cpu"
    threads: int = 1
    matmul_scratch: Callable[..., int] | None = None
    #: A sink cache's (sinks, window) on every layer (``SinkWindowLayer``), None: a dynamic cache's layers.
    sink: tuple[int, int] | None = None
    #: An h2o cache's (budget, window) on every layer (``HeavyHitterLayer``), None: not one.
    h2o: tuple[int, int] | None = None
    heap: Heap = field(default_factory=Heap)
    embeddings: int = 0
    mask: int = 0
    sdpa_mask: int = 0
    cos_sin: int = 0
    kept: list[int] = field(default_factory=list)  # tensors a layer's locals keep alive until it returns

    def __post_init__(self) -> None:
        spec = self.spec
        self.H, self.V, self.I = spec.hidden_size, spec.vocab_size, spec.intermediate_size
        self.kv = self.past + self.s  # keys each new token attends (a decode step: s = 1)
        self.rotary = rotary_dims(spec, self.hd)
        self.A = self.b * self.s * self.H * self.dt  # one hidden-state tensor
        self.A32 = self.b * self.s * self.H * FP32
        self.row32 = self.b * self.s * FP32  # one fp32 scalar per token (RMSNorm's variance)
        self.Q = self.b * self.heads * self.s * self.hd * self.dt
        self.K = self.b * self.kvh * self.s * self.hd * self.dt
        self.Kc = self.b * self.kvh * self.kv * self.hd * self.kv_dt  # the cache's new tensor of one layer's keys
        self.Kc_old = self.b * self.kvh * self.past * self.hd * self.kv_dt  # the one it replaces (held before)

    def cfg(self, *names: str, default: Any = None) -> Any:
        """The model's config value (``config_value``)."""
        return config_value(self.spec, *names, default=default)

    def mm(self, out: int, m: int, k: int, n: int, batch: int = 1, transposed: bool = True) -> int:
        """A matmul's output (left allocated), and the scratch the library takes and gives back inside the call."""
        o = self.heap.alloc(out)
        if self.matmul_scratch is not None and self.dt != FP32:
            self.heap.free(self.heap.alloc(self.matmul_scratch(batch, m, k, n, transposed)))
        return o


def new_pass(spec: ModelSpec, eff: ModelSpec, batch: int, dtype: str, kv_dt: Any, kernel: str, prompt_tokens: int,
             past_tokens: int, **machine: Any) -> Pass:
    """The pass of ``prompt_tokens`` new tokens on ``past_tokens`` cached, for ``spec`` as ``eff`` (its effective
    spec under the run's settings) runs it; ``machine``: ``device``, ``threads``, ``matmul_scratch``."""
    return Pass(spec=spec, b=batch, s=prompt_tokens, past=past_tokens, dt=dtype_bytes(dtype), kv_dt=kv_dt,
                heads=eff.num_query_heads, kvh=eff.num_kv_heads, hd=eff.head_dim, layers=eff.num_layers,
                eager=kernel == "eager", window=eff.sliding_window if eff.num_sliding_layers else None,
                masks=2 if eff.num_sliding_layers and eff.num_full_layers else 1, **machine)
