"""``calc --runtime mlx``: the bytes of mlx-lm's caches per context, from the predictor alone (no MLX import).

The numbers are ``kvscope.core.runtimes.mlx.predict``'s, the same the live MLX engine puts in every Sample: a context of
n tokens is a prompt of ``prompt_tokens`` fed the way ``mlx_lm.generate_step`` feeds it, then one token at a time.
A KVCache's or QuantizedKVCache's capacity depends on n alone (``ceil(n / 256) * 256`` slots); a rotating cache's
also on the prompt (a prompt longer than the window is concatenated whole before it is trimmed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.model.spec import ModelSpec, dtype_bytes, human_bytes
from kvscope.core.prediction.table import aligned, bytes_cell
from kvscope.core.model.attention import SettingsError
from kvscope.core.runtimes.mlx.predict import (DEFAULT_GROUP_SIZE, KV, QUANTIZED, ROTATING, STEP, MlxCache, history,
                                               layer_cache, layers_of, parse_cache, quantize_problem, quantized_cache,
                                               slot_bytes)

MLX_LM_VERSION = "mlx-lm 0.32.2"
#: The caches a table shows when --cache names none for MLX.
DEFAULT_CACHES = ("kv", "quantized:8", "quantized:4")


@dataclass(frozen=True)
class MlxCalc:
    """Per context, per cache: the bytes of the caches' arrays and of the slots that hold tokens."""

    model: str
    caches: tuple[MlxCache, ...]
    contexts: tuple[int, ...]
    prompt_tokens: int
    kv: tuple[tuple[int | None, ...], ...]  # [context][cache]: bytes of the arrays (None: refused for this model)
    refused: tuple[str | None, ...]  # per cache: why it does not fit this model
    weights: int | None
    per_slot: tuple[int, ...]  # per cache: bytes of one token slot over every layer
    trained: int

    def rows(self) -> list[dict[str, Any]]:
        return [{"context": n, "weights_bytes": self.weights,
                 "kv": {c.key: kv for c, kv in zip(self.caches, row)}} for n, row in zip(self.contexts, self.kv)]


def weights_of(spec: ModelSpec) -> int | None:
    """The weights' bytes in mlx-lm: parameters times the dtype's bytes; None for an ``mlx_lm.convert``-quantized
    model (its config's ``quantization``: codes, scales and biases per layer, not predicted here)."""
    if isinstance(spec.config.get("quantization"), dict):
        return None
    return int(spec.num_parameters * dtype_bytes(spec.dtype))


def pick_caches(spelled: str | None, layers) -> tuple[MlxCache, ...]:
    """The caches named on the command line (comma-separated), or the defaults; a quantized default whose group
    does not divide the head dim takes groups of 32 instead."""
    if spelled and spelled.strip().lower() not in ("dynamic", ""):
        return tuple(parse_cache(s) for s in spelled.split(",") if s.strip())
    out = []
    for s in DEFAULT_CACHES:
        c = parse_cache(s)
        if c.kind == QUANTIZED and quantize_problem(layers, c):
            c = MlxCache(QUANTIZED, bits=c.bits, group_size=32)
        out.append(c)
    return tuple(out)


def calculate_mlx(spec: ModelSpec, contexts: list[int], caches: str | None = None, prompt_tokens: int = 1) -> MlxCalc:
    """Every cache's bytes at every context (a context shorter than the prompt is the prompt alone)."""
    layers = layers_of(spec)
    picked = pick_caches(caches, layers)
    refused = tuple(quantize_problem(layers, c) for c in picked)
    prompt = max(1, int(prompt_tokens))
    rows = []
    for n in contexts:
        p = min(prompt, n)
        rows.append(tuple(None if why else history(layers, c, p, n - p).nbytes for c, why in zip(picked, refused)))
    per_slot = tuple(sum(slot_bytes(l, layer_cache(l, c)) for l in layers) for c in picked)
    return MlxCalc(spec.label, picked, tuple(contexts), prompt, tuple(rows), refused, weights_of(spec), per_slot,
                   spec.max_position_embeddings)


def _short(c: MlxCache) -> str:
    if c.kind == ROTATING:
        return f"RotatingKVCache {c.max_size:,} keep {c.keep}"
    if c.kind == QUANTIZED:
        return f"QuantizedKVCache {c.bits}-bit g{c.group_size}"
    return "KVCache"


def render_mlx_json(r: MlxCalc) -> str:
    return json.dumps({"model": r.model, "runtime": "mlx", "mlx_lm_version": MLX_LM_VERSION, "step": STEP,
                       "prompt_tokens": r.prompt_tokens, "caches": [c.key for c in r.caches],
                       "refused": {c.key: why for c, why in zip(r.caches, r.refused) if why},
                       "bytes_per_token_slot": {c.key: b for c, b in zip(r.caches, r.per_slot)},
                       "rows": r.rows()})


def render_mlx_table(r: MlxCalc) -> str:
    lines = [f"{safe_text(r.model, limit=NAME_LIMIT)}: MLX runtime ({MLX_LM_VERSION}), KV of mlx-lm's caches",
             f"a context of n tokens: a {r.prompt_tokens:,}-token prompt fed as generate_step feeds it, then one token "
             "at a time", ""]
    header = ("context",) + tuple(_short(c) for c in r.caches) + ("weights",)
    table = [header]
    for n, row in zip(r.contexts, r.kv):
        mark = "*" if r.trained and n > r.trained else ""
        table.append((f"{n:,}{mark}",) + tuple("refused" if b is None else bytes_cell(b) for b in row)
                     + (bytes_cell(r.weights) if r.weights is not None else "n/a",))
    lines += aligned(table)
    lines.append("")
    if any(n > r.trained for n in r.contexts if r.trained):
        lines += [f"* beyond the model's trained context of {r.trained:,} tokens", ""]
    for c, per, why in zip(r.caches, r.per_slot, r.refused):
        if why:
            lines.append(f"{c.key}: refused: {why}")
        elif c.kind == KV:
            lines.append(f"{c.key}: {per:,} B per token slot, allocated {STEP} slots at a time "
                         f"({human_bytes(per * STEP)} per step): ceil(n / {STEP}) x {STEP} slots")
        elif c.kind == ROTATING:
            lines.append(f"{c.key}: {per:,} B per slot, grows {STEP} slots at a time up to {c.max_size:,} slots "
                         f"({human_bytes(per * int(c.max_size))}), then overwrites all but the first {c.keep}")
        else:
            lines.append(f"{c.key}: {per:,} B per slot ({c.bits}-bit codes + a scale and a bias per {c.group_size} "
                         f"values), the KVCache's {STEP}-slot steps")
    if r.weights is None:
        lines.append("weights: n/a (an mlx_lm.convert-quantized model: its codes, scales and biases are not predicted)")
    lines.append("other caches: --max-kv-size N (RotatingKVCache, keep 4; it also depends on --prompt-tokens), "
                 "--kv-bits B [--kv-group-size G] (QuantizedKVCache)")
    return "\n".join(lines)


def calc_text(args: Any, spec: ModelSpec, contexts: list[int], gpu_memory: int | None = None) -> str:
    """``calc --runtime mlx``: mlx-lm's caches for each context, from its own flags (``--max-kv-size``,
    ``--kv-bits``, ``--kv-group-size``, ``--prompt-tokens``; ``--cache`` is transformers')."""
    if args.kv_group_size is not None and args.kv_bits is None:
        raise SettingsError("--kv-group-size is the quantized cache's: give --kv-bits too")
    quantized = []
    if args.kv_bits is not None:  # a group of 0 is refused, never taken for the default (MLX dies of SIGFPE on it)
        group = int(args.kv_group_size) if args.kv_group_size is not None else DEFAULT_GROUP_SIZE
        quantized = [quantized_cache(int(args.kv_bits), group, f"--kv-bits {args.kv_bits} --kv-group-size {group}").key]
    spelled = ["kv"] + ([f"rotating:{args.max_kv_size}"] if args.max_kv_size is not None else []) + quantized
    result = calculate_mlx(spec, contexts, ",".join(spelled) if len(spelled) > 1 else None, args.prompt_tokens)
    return render_mlx_json(result) if args.json else render_mlx_table(result)
