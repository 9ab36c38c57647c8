"""The MLX runtime's light half: its options, its command-line flags, its Source list entry, the request the window's
form makes and its switches, checked without importing MLX (the command line and the window's process use them;
``kvscope.core.runtimes``' registry points here)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from kvscope.core.model.attention import SettingsError, parse_attention
from kvscope.core.model.request import RunForm, RunRequest
from kvscope.core.model.spec import SpecError
from kvscope.core.runtimes.base import SourceEntry
from kvscope.core.runtimes.mlx.predict import (DEFAULT_GROUP_SIZE, PREFILL_STEP, QUANTIZED, MlxCache, parse_cache,
                                               quantized_cache)

NAME = "mlx"
_MAX_COUNT = 2**31 - 1
#: The switch keys an MLX run takes.
KEYS = ("cache", "attention", "attn-impl")


@dataclass(frozen=True)
class MlxOptions:
    """How an MLX run builds its cache, spelled as mlx-lm's generate flags: ``--max-kv-size`` (a RotatingKVCache
    keeping the first 4 tokens, as ``make_prompt_cache`` does), ``--kv-bits`` / ``--kv-group-size`` (a
    QuantizedKVCache from the first token: ``--quantized-kv-start 0``), and ``--prefill-step-size``."""

    cache: str = "kv"
    prefill_step_size: int = PREFILL_STEP

    @property
    def mlx_cache(self) -> MlxCache:
        return parse_cache(self.cache)


def mlx_missing() -> str | None:
    """None when mlx and mlx-lm are installed, else why not; finds them without importing them."""
    try:
        found = all(importlib.util.find_spec(m) is not None for m in ("mlx", "mlx_lm"))
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return ("MLX is not installed: pip install -e '.[mlx]' (mlx-lm 0.32.2 with mlx[cpu] 0.32.4 on Linux, mlx 0.32.4 "
            "on macOS)")


def parse_switch(key: str, value: str) -> tuple[str, Any]:
    """A switch ``key=value`` for an MLX run, checked: ``cache`` (kv, rotating:MAX[:KEEP], quantized:BITS[:GROUP]),
    ``attention`` (mha, gqa:N, mqa). SettingsError, one line, for anything else."""
    k = str(key).strip().lower().replace("_", "-")
    v = str(value).strip().lower()
    if k == "cache":
        return k, parse_cache(v).key
    if k == "attention":
        mode = parse_attention(v)
        if mode.name not in ("mha", "gqa", "mqa"):
            raise SettingsError(f"attention={v}: an MLX run regroups K/V heads (mha, gqa:N, mqa); {mode.name} needs "
                                "another model")
        return k, mode.key
    if k in ("attn-impl", "attn", "impl", "flash"):
        raise SettingsError("MLX runs every attention with mx.fast.scaled_dot_product_attention: no kernel to switch")
    raise SettingsError(f"--switch {k}={v}: an MLX run switches cache (kv, rotating:MAX[:KEEP], quantized:BITS[:GROUP]) "
                        "or attention (mha, gqa:N, mqa)")


def add_flags(parser: Any, command: str) -> dict[str, tuple[float, float, str]]:
    """MLX's cache options, spelled as mlx-lm's generate flags (``--runtime mlx``); ``calc`` takes the prompt's
    tokens, ``run`` the prompt's chunk. Returns the whole-number flags' ranges (--kv-bits and --kv-group-size are
    checked by mlx-lm's own rule, ``quantized_cache``)."""
    g = parser.add_argument_group("--runtime mlx (mlx-lm's flags)")
    g.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="a RotatingKVCache of N tokens keeping the first 4 (default: a KVCache in 256-token steps)")
    g.add_argument("--kv-bits", type=int, default=None, help="a QuantizedKVCache of 8, 4 or 2 bits")
    g.add_argument("--kv-group-size", type=int, default=None, help="the quantized cache's group: 32, 64 or 128 (default 64)")
    ranges = {"max_kv_size": (2, 1 << 24, "tokens of MLX's rotating cache")}
    if command == "calc":
        g.add_argument("--prompt-tokens", type=int, default=1, metavar="N",
                       help="the prompt's tokens before the decode (a rotating cache depends on it; default 1)")
        ranges["prompt_tokens"] = (1, _MAX_COUNT, "tokens of the prompt")
    else:
        g.add_argument("--prefill-step-size", type=int, default=None, metavar="N",
                       help="the prompt's chunk (default 2048, mlx-lm's)")
        ranges["prefill_step_size"] = (1, _MAX_COUNT, "tokens of each prompt chunk")
    return ranges


def source_entries() -> tuple[SourceEntry, ...]:
    """The Source list's "MLX (mlx-lm)": the embedded model in MLX; installed MLX folders run in MLX too."""
    return (SourceEntry(key="mlx", label="MLX (mlx-lm)", tooltip="MLX: the embedded model in mlx-lm (an installed "
                        "MLX folder: Installed model).", installed_kinds=("mlx",),
                        kind_labels=(("mlx", "MLX model folder"),)),)


def form_request(form: RunForm) -> RunRequest:
    """An MLX run of the form's model: the cache from the Cache combo where it names an MLX cache (else a KVCache:
    a transformers or llama.cpp cache shown from the run before)."""
    cache = form.cache
    try:
        cache = parse_cache(cache).key if cache and cache != "dynamic" else "kv"
    except (SpecError, SettingsError):
        cache = "kv"
    return RunRequest(**form.common(), runtime=NAME, options={NAME: MlxOptions(cache=cache)})


def options_from_args(args: Any) -> MlxOptions:
    """MlxOptions from ``--max-kv-size``, ``--kv-bits``, ``--kv-group-size`` and ``--prefill-step-size``."""
    max_kv = getattr(args, "max_kv_size", None)
    bits = getattr(args, "kv_bits", None)
    group = getattr(args, "kv_group_size", None)
    step = getattr(args, "prefill_step_size", None) or PREFILL_STEP
    if max_kv is not None and bits is not None:
        raise SettingsError("--max-kv-size with --kv-bits: mlx-lm does not quantize a RotatingKVCache "
                            "('RotatingKVCache Quantization NYI')")
    if group is not None and bits is None:
        raise SettingsError("--kv-group-size is the quantized cache's: give --kv-bits too")
    if not 1 <= int(step) <= 1 << 20:
        raise SettingsError("--prefill-step-size: give 1 to 1,048,576 tokens")
    if max_kv is not None:
        cache = parse_cache(f"rotating:{int(max_kv)}").key
    elif bits is not None:
        g = int(group) if group is not None else DEFAULT_GROUP_SIZE
        cache = quantized_cache(int(bits), g, f"--kv-bits {int(bits)} --kv-group-size {g}").key
    else:
        cache = "kv"
    return MlxOptions(cache=cache, prefill_step_size=int(step))


def cli_options(args: Any) -> MlxOptions:
    """The options of ``run --runtime mlx``'s own flags (mlx-lm's spellings); the transformers-only
    flags are refused with what to give instead."""
    if str(getattr(args, "cache", "dynamic") or "dynamic").strip().lower() != "dynamic":
        raise SettingsError("--runtime mlx builds mlx-lm's caches: --max-kv-size N (rotating), --kv-bits B "
                            "[--kv-group-size G] (quantized), not --cache")
    if getattr(args, "attention", None):
        raise SettingsError("--runtime mlx loads the model as it is built; regroup its heads with "
                            "--switch 0:attention=mqa (or gqa:N)")
    if str(getattr(args, "attn_impl", "sdpa") or "sdpa").strip().lower() != "sdpa":
        raise SettingsError("--runtime mlx runs mx.fast.scaled_dot_product_attention: leave --attn-impl out")
    if getattr(args, "context", None) is not None:
        raise SettingsError("--context is llama.cpp's -c; an MLX cache grows in 256-token steps "
                            "(--max-kv-size N caps it)")
    if getattr(args, "batch", 1) not in (1, None):
        raise SettingsError("--runtime mlx generates one sequence (--batch 1)")
    device = str(getattr(args, "device", "auto") or "auto").strip().lower()
    if device not in ("auto", "cpu", "gpu", "mps"):
        raise SettingsError(f"--device {device}: MLX runs on cpu or gpu (Metal on a Mac); leave --device out for "
                            "MLX's default")
    return options_from_args(args)


def check_options(options: MlxOptions) -> MlxCache:
    """The cache the options name (SettingsError if not one)."""
    cache = options.mlx_cache
    if cache.kind == QUANTIZED and cache.bits is None:
        raise SettingsError("a quantized cache needs its bits")
    return cache
