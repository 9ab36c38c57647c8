"""The calculator's rules for llama.cpp: what it allocates at load, as ``python main.py calc --runtime llama.cpp``.

The KV cache is the whole context's, padded to 256 cells (``kvscope.core.prediction.llamacpp.plan``); the compute buffer is what
llama.cpp reserves (``kvscope.core.prediction.llamacpp_compute``); a GGUF model's weights are its tensors on the GPU. The largest
context that fits is calc's own search (``largest_context_on_gpu`` up to ``MAX_CONTEXT``). One sequence, the
file's weights, the model's own attention: the batch, dtype, attention and GPU inputs do not apply.

``calc_text`` is ``python main.py calc --runtime llama.cpp``: the replay's figures, and where llama.cpp is installed
and the model a local GGUF, llama.cpp's own dry run (``kvscope.core.runtimes.llamacpp.dryrun``) beside each of them,
with its source (the replay, the dry run, both and equal, or a disagreement that shows both).
"""

from __future__ import annotations

from typing import Any

from kvscope.core.model.settings import RunSettings
from kvscope.core.model.spec import ModelSpec
from kvscope.core.prediction.llamacpp import (CACHE_TYPES, MAX_CONTEXT, formula_llamacpp, max_context_llamacpp,
                                              predict_llamacpp)
from kvscope.core.runtimes.calculator import CalcFigures, CalcInputs, CalcRow

TIPS = {
    "weights": "The weights llama.cpp puts on the GPU: a GGUF's tensors (the token embedding stays in host memory), "
               "else the parameters at 2 bytes (an F16 GGUF).",
    "kv": "What llama.cpp allocates for the KV cache when the model loads: the whole context, padded to 256 cells.",
    "activations": "llama.cpp's compute buffer (sched_reserve: the largest of its reserved graphs through its "
                   "allocator), exact for the CPU backend; CUDA and Metal follow other kernels, not checked yet",
    "total": "weights + KV + compute buffer on the GPU (the output buffer is host memory).",
    "per_token": "KV bytes per cell: one cell in each cache per token.",
}


class LlamaCppCalc:
    """``kvscope.core.runtimes.calculator.CalcRules`` for llama.cpp (the KV cache allocated at load)."""

    label = "llama.cpp (allocated at load)"
    tip = ("llama.cpp (LM Studio, Ollama): the whole context's KV cache is allocated when the model loads, padded "
           "to 256 cells; a .gguf model gives its exact weights.")
    inputs: frozenset[str] = frozenset()
    unused_note = "(llama.cpp: not used; one sequence, the file's weights, the model's own attention)"
    default_cache = "f16"

    def caches(self, spec: ModelSpec | None) -> list[str]:
        """llama.cpp's cache types (the same for K and V)."""
        return list(CACHE_TYPES)

    def settings(self, spec: ModelSpec, inputs: CalcInputs) -> RunSettings:
        return RunSettings(weight_dtype=inputs.weight_dtype)

    def fit(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int | None, int]:
        return max_context_llamacpp(spec, inputs.memory, inputs.cache or self.default_cache, MAX_CONTEXT), MAX_CONTEXT

    def figures(self, spec: ModelSpec, inputs: CalcInputs, fit: tuple[int | None, int]) -> CalcFigures:
        cache = inputs.cache or self.default_cache
        p = predict_llamacpp(spec, inputs.context, cache)
        b = p.breakdown
        rows = (CalcRow("weights", "Weights", b.weights, TIPS["weights"]),
                CalcRow("kv", "KV cache", b.kv_cache, TIPS["kv"]),
                CalcRow("activations", "Compute buffer", b.activations, TIPS["activations"]),
                CalcRow("total", "Total", p.total, TIPS["total"]),
                CalcRow("per_token", "KV per token", p.kv_bytes_per_token, TIPS["per_token"]))
        return CalcFigures(inputs, self.settings(spec, inputs), rows, p.total, fit[0], fit[1],
                           formula_llamacpp(spec, inputs.context, cache), 1, spec.max_position_embeddings, spec.label)

    def stack(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int, int, int]:
        b = predict_llamacpp(spec, inputs.context, inputs.cache or self.default_cache).breakdown
        return b.weights or 0, b.kv_cache or 0, b.activations or 0


RULES = LlamaCppCalc()


# --------------------------------------------------------------------------------------------------------------
# calc --runtime llama.cpp: KV Scope's replay beside llama.cpp's own dry run, each figure with where it came from

#: The figure's source, as calc says it.
BOTH = "both, equal"
REPLAY = "replay"
DRY = "dry run"
DISAGREE = "disagree"


def host_isa() -> str:
    """This machine's CPU as ggml-cpu's repack picks by it (``kvscope.core.prediction.llamacpp.REPACK_TYPES``):
    /proc/cpuinfo's flags on Linux, the machine's type elsewhere (an Apple chip: NEON with dot products)."""
    import platform

    machine = platform.machine().lower()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for raw in f.read(1 << 20).decode("ascii", "replace").splitlines():
                key, _, value = raw.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "none"
    if machine in ("arm64", "aarch64"):
        if "i8mm" in flags:
            return "neon-i8mm"
        return "neon-dotprod" if ("asimddp" in flags or platform.system() == "Darwin") else "none"
    return "none"


def _source(replay: int | None, dry: int | None, close: bool | None = None) -> str:
    if replay is None and dry is None:
        return "n/a"
    if dry is None:
        return REPLAY
    if replay is None:
        return DRY
    return BOTH if (replay == dry if close is None else close) else DISAGREE


def _figure(replay: int | None, dry: int | None, why: str = "", close: bool | None = None,
            dry_text: str | None = None) -> dict:
    return {"replay": replay, "dry_run": dry, "source": _source(replay, dry, close), "why": why,
            **({"dry_run_logged": dry_text} if dry_text else {})}


def compare(result, dry, isa: str) -> list[dict]:
    """Per context: every figure (KV, compute, output, each model buffer type, the total) from KV Scope's replay
    (``result``: a ``kvscope.core.prediction.llamacpp.LlamaCppCalc``) and llama.cpp's dry run (``dry``: a
    ``kvscope.core.runtimes.llamacpp.dryrun.DryRun`` or None), each with its source."""
    from kvscope.core.model.gguf import read_gguf
    from kvscope.core.prediction.llamacpp import cpu_model_buffers
    from kvscope.core.runtimes.llamacpp.dryrun import MIB

    cpu = cpu_model_buffers(read_gguf(result.source), isa) if result.gguf else None
    out = []
    for i, (c, p) in enumerate(zip(result.contexts, result.plans)):
        d = dry.contexts[i] if dry is not None else None
        if d is not None and d.error:
            d = None
        figures: dict[str, dict] = {}
        compute_why = "" if p.compute_bytes is not None else (p.compute.why_not if p.compute else "not replayed")
        figures["kv_cache"] = _figure(p.kv_bytes, d.kv_bytes if d else None)
        figures["compute_buffer"] = _figure(p.compute_bytes, d.compute_bytes if d else None, compute_why)
        dry_out = None
        if d is not None and d.output_mib is not None:
            # the log's MiB, to 2 decimals: the replay's bytes agree when they round to it
            close = p.output_bytes is not None and abs(p.output_bytes / MIB - d.output_mib) <= 0.005 + 1e-9
            dry_out = p.output_bytes if close else round(d.output_mib * MIB)
            figures["output_buffer"] = _figure(p.output_bytes, dry_out, "the dry run's figure is its log's (0.01 MiB)",
                                               close=close, dry_text=f"{d.output_mib:.2f} MiB")
        else:
            figures["output_buffer"] = _figure(p.output_bytes, None)
        replay_model = cpu.by_type(mmap=False) if cpu is not None else {}
        dry_model = d.model if d is not None else {}
        for name in sorted(set(replay_model) | set(dry_model), key=lambda n: (n != "CPU", n)):
            figures[f"model {name}"] = _figure(replay_model.get(name), dry_model.get(name),
                                               "" if name in replay_model else "not replayed (a GPU build's buffer)")
        if cpu is not None:
            figures["model CPU_Mapped"] = _figure(
                cpu.mapped, None, "with mmap (llama.cpp's default) the CPU buffer is the file's range of its tensors: "
                                  "a dry run cannot map the file (no_alloc with mmap aborts)")

        def total(side: str) -> int | None:
            parts = [figures["kv_cache"][side], figures["compute_buffer"][side], figures["output_buffer"][side]]
            model = [v[side] for k, v in figures.items() if k.startswith("model ") and k != "model CPU_Mapped"]
            if not model or any(x is None for x in parts + model):
                return None
            return sum(parts) + sum(model)

        t_replay, t_dry = total("replay"), total("dry_run")
        figures["total"] = _figure(t_replay, t_dry, "every buffer as a load without mmap allocates them"
                                   + (f"; the replay has no {', '.join(LABELS.get(k, k) for k, v in figures.items() if v['replay'] is None and v['dry_run'] is not None)}"
                                      if t_replay is None and t_dry is not None else ""))
        if cpu is not None:
            best = t_dry if t_dry is not None else t_replay
            if best is not None:
                mapped = best - figures["model CPU"]["dry_run" if t_dry is not None else "replay"] + cpu.mapped
                figures["total with mmap"] = {
                    "replay": None if t_replay is None else t_replay - cpu.cpu + cpu.mapped,
                    "dry_run": None, "value": mapped,
                    "source": figures["total"]["source"] + "; CPU_Mapped: the replay's",
                    "why": "the total as llama.cpp loads by default: CPU_Mapped in place of CPU"}
        out.append({"context": c, "figures": figures})
    return out


LABELS = {"kv_cache": "KV cache", "compute_buffer": "compute buffer", "output_buffer": "output buffer"}


def _cell(n: int | None) -> str:
    from kvscope.core.prediction.table import bytes_cell

    return bytes_cell(n) if n is not None else "n/a"


def render_sources(comparison: list[dict], dry_note: str) -> list[str]:
    """The table of every figure, replay beside dry run, with its source; a disagreement says both figures."""
    from kvscope.core.prediction.table import aligned

    lines = ["Where each figure comes from: KV Scope's replay, llama.cpp's dry run (" + dry_note + "), or both, equal:"]
    table = [("context", "figure", "KV Scope's replay", "llama.cpp's dry run", "source")]
    notes: list[str] = []
    for row in comparison:
        first = True
        for name, f in row["figures"].items():
            if "value" in f:  # the total with mmap: the compared total with the replay's mapped range
                dry = _cell(f["value"])
            else:
                dry = f.get("dry_run_logged") or _cell(f["dry_run"])
            source = f["source"]
            if source == DISAGREE:
                diff = (f["dry_run"] or 0) - (f["replay"] or 0)
                source = f"DISAGREE (dry run {diff:+,} B)"
            table.append((f"{row['context']:,}" if first else "", LABELS.get(name, name), _cell(f["replay"]),
                           dry if (f["dry_run"] is not None or "value" in f) else "-", source))
            first = False
            if f.get("why") and f["why"] not in notes:
                notes.append(f["why"])
    lines += aligned(table)
    lines += [f"  ({n})" for n in notes]
    return lines


def calc_text(args: Any, spec: Any, contexts: list[int], gpu_memory: int | None) -> str:
    """``calc --runtime llama.cpp``: what llama.cpp allocates at load for each context (KV, compute and output
    buffers, the model's), with ``--gpu-memory`` the fit as llama.cpp's ``--fit`` decides it, and where llama.cpp
    is installed and the model is a local GGUF, llama.cpp's own dry run beside every figure (``--no-dry-run``: not)."""
    import json
    from pathlib import Path

    from kvscope.core.base.errors import one_line
    from kvscope.core.model.gguf import is_gguf_source
    from kvscope.core.prediction.llamacpp import calculate_llamacpp, render_llamacpp_json, render_llamacpp_table
    from kvscope.core.prediction.table import bytes_cell
    from kvscope.core.runtimes.llamacpp import dryrun
    from kvscope.core.runtimes.llamacpp.cli import options_from_args

    result = calculate_llamacpp(args.model, spec, contexts, lambda n: options_from_args(args, n), gpu_memory,
                                fit_target=max(0, args.fit_target) << 20)
    dry, why_not = None, ""
    local = result.gguf and is_gguf_source(args.model) and Path(args.model).is_file()
    if getattr(args, "no_dry_run", False):
        why_not = "off (--no-dry-run)"
    elif not local:
        why_not = "not asked: the model is not a local .gguf file"
    elif dryrun.available():
        why_not = "not available: " + dryrun.available()
    else:
        try:
            dry = dryrun.dry_run(args.model, [options_from_args(args, n) for n in contexts])
        except dryrun.DryRunError as exc:
            if "llama.cpp could not load it" in str(exc):  # issue 38: figures for a file llama.cpp refuses at load
                from kvscope.core.model.spec import SpecError
                raise SpecError(f"{one_line(exc)} (llama.cpp refuses this file at load: no figure for it)") from None
            why_not = "failed: " + one_line(exc)
    isa = host_isa()
    comparison = compare(result, dry, isa)
    totals = {}
    for row in comparison:
        t = row["figures"]["total"]
        if t["replay"] is None and t["dry_run"] is not None:
            totals[row["context"]] = f"{bytes_cell(t['dry_run'])} (dry run)"
    if args.json:
        out = json.loads(render_llamacpp_json(result))
        out["dry_run"] = dry.to_json() if dry is not None else {"why_not": why_not}
        out["replay_cpu_features"] = isa
        for r, row in zip(out["rows"], comparison):
            t = row["figures"]["total"]
            r["figures"] = row["figures"]
            if r["total_bytes"] is None and t["dry_run"] is not None:
                r["total_bytes"] = t["dry_run"]
            r["total_source"] = t["source"] if r["total_bytes"] is not None else "n/a"
        return json.dumps(out)
    text = render_llamacpp_table(result, totals)
    if not result.gguf:
        return text
    note = ("no_alloc: llama.cpp sizes every buffer and allocates none; loaded without mmap" if dry is not None
            else why_not)
    if dry is None:
        return text + f"\nllama.cpp's dry run: {note}; every figure above is KV Scope's replay."
    extra = render_sources(comparison, note)
    return text + "\n\n" + "\n".join(extra) + f"\n(the replay's CPU_REPACK follows this CPU: {isa})"
