"""The calculator's model (``kvscope.core.runtimes.calculator``), without Qt: its figures are what ``python main.py calc`` prints.

A seeded matrix of presets x contexts x runtimes x GPU layouts x caches: each case runs the real command line
(``main.main(["calc", ...])``) and reads its table back, then asks the model; the rows, the largest context that
fits and KV per token must be calc's own numbers, and with several GPUs the sizes the busiest GPU's.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from kvscope import main
from kvscope.core.model.attention import SettingsError
from kvscope.core.model.sources import load_spec
from kvscope.core.model.spec import preset_names
from kvscope.core.runtimes.calculator import GPU_LAYOUTS, CalcInputs, Calculator, context_values, offered, rules_for

GIB = 1 << 30
CELL = re.compile(r"([\d,]+) B \(")


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    code = main.main(["calc", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def _row_cells(text: str, context: int) -> list[list[int]]:
    """The byte cells of the table rows of ``context`` (a multi-GPU table: one row per stage, the first named)."""
    rows, inside = [], False
    for line in text.splitlines():
        head = line.strip().split("  ")[0].rstrip("*")
        if head == f"{context:,}":
            inside = True
        elif inside and not line.startswith(" " * 7):
            break
        if inside:
            cells = [int(c.replace(",", "")) for c in CELL.findall(line)]
            if not cells:
                break
            rows.append(cells)
    return rows


def _cases() -> list[tuple]:
    rng = random.Random(26)
    presets = sorted(preset_names())
    models = ["llama-3-8b", "embedded"] + rng.sample([p for p in presets if p not in ("llama-3-8b", "embedded")], 4)
    cases = []
    for model in models:
        for name, _rules in offered():
            layouts = GPU_LAYOUTS if "gpus" in rules_for(name).inputs else GPU_LAYOUTS[:1]
            caches = rules_for(name).caches(None)
            for layout in rng.sample(list(layouts), min(3, len(layouts))):
                context = rng.choice((1, 1000, 4096, 32768, 131072, 500_000))
                memory = rng.choice((8, 24, 80))
                cache = rng.choice([c for c in caches if c in ("dynamic", "static", "f16", "q8_0", "q4_0")])
                cases.append((model, name, layout, context, memory, cache))
    return cases


CASES = _cases()


@pytest.mark.parametrize("model,runtime,layout,context,memory,cache", CASES,
                         ids=[f"{m}-{r}-tp{l[0]}pp{l[1]}-{c}-{g}G-{k}" for m, r, l, c, g, k in CASES])
def test_the_model_shows_what_calc_prints(capsys, model, runtime, layout, context, memory, cache):
    spec = load_spec(model)
    inputs = CalcInputs(context=context, runtime=runtime, weight_dtype="bfloat16", attention=None, cache=cache,
                        memory=memory * GIB, tensor=layout[0], pipeline=layout[1])
    argv = ["--model", model, "--context", str(context), "--dtype", "bfloat16", "--gpu-memory", f"{memory}GiB",
            "--runtime", runtime]
    if "gpus" in rules_for(runtime).inputs:
        argv += ["--cache", cache, "--tensor-parallel", str(layout[0]), "--pipeline-parallel", str(layout[1])]
    else:
        argv += ["--cache-type-k", cache, "--cache-type-v", cache]
    code, text = _cli(capsys, argv)
    calculator = Calculator()
    if code != 0:  # calc refuses (a TP that does not divide the heads): the model refuses too, with its line
        with pytest.raises(SettingsError) as refused:
            calculator.figures(spec, inputs)
        assert str(refused.value).split(" (")[0] in text
        return
    f = calculator.figures(spec, inputs)
    rows = _row_cells(text, context)
    assert rows, text
    if "gpus" in rules_for(runtime).inputs:
        shown = [f.bytes("kv"), f.bytes("weights"), f.bytes("activations"), f.total]
        assert shown == max(rows, key=lambda cells: cells[3]), (rows, f.rows)  # the busiest GPU's share
        per_token = int(re.search(r"KV per token: .* = ([\d,]+) B per token", text).group(1).replace(",", ""))
        assert f.bytes("per_token") == per_token
        assert f.per_gpu == (layout != (1, 1))
        assert all(r.name.endswith(" per GPU") for r in f.rows[:4]) == f.per_gpu
        assert f.rows[-1].name.endswith("(all GPUs)") == f.per_gpu
        fits = re.search(r"Largest context that fits in .*: ([\d,]+) tokens", text)
    else:
        (kv, compute, output, weights, total), = rows
        assert (f.bytes("kv"), f.bytes("activations"), f.bytes("weights")) == (kv, compute, weights)
        assert f.total == total - output  # the output buffer is host memory: calc's total counts it, the GPU's not
        fits = re.search(r"Largest context whose GPU .* fit in .*: ([\d,]+) tokens", text)
    if fits is None:
        assert f.fit is None and ("Does not fit" in text), text
    else:
        assert f.fit == int(fits.group(1).replace(",", ""))
        assert not f.fit_capped  # calc's own search: never stopped at the slider's end
    assert f.fits_now == (f.total <= memory * GIB)
    assert f.beyond_trained == (context > spec.max_position_embeddings)


def test_the_search_for_what_fits_is_memoised_on_all_but_the_context():
    spec = load_spec("llama-3-8b")
    calculator = Calculator()
    one = calculator.figures(spec, CalcInputs(context=1024, memory=24 * GIB))
    two = calculator.figures(spec, CalcInputs(context=65536, memory=24 * GIB))
    assert one.fit == two.fit and len(calculator._fits) == 1
    calculator.figures(spec, CalcInputs(context=1024, memory=24 * GIB, batch=2))
    assert len(calculator._fits) == 2


def test_context_values_reach_the_model_or_128k_with_every_power_of_two():
    for name in ("embedded", "llama-3-8b", "qwen2.5-7b"):
        spec = load_spec(name)
        values = context_values(spec)
        assert values[-1] == max(spec.max_position_embeddings, 128 * 1024)
        assert all(2 ** k in values for k in range(values[-1].bit_length()))
        assert values == sorted(set(values)) and values[0] == 1


def test_the_chart_climbs_with_the_context():
    spec = load_spec("llama-3-8b")
    chart = Calculator().chart(spec, CalcInputs(context=4096))
    assert chart.contexts[-1] == 128 * 1024 and len(chart.contexts) <= 72
    assert list(chart.kv) == sorted(chart.kv) and chart.kv[-1] > chart.kv[0]


def test_the_model_imports_no_qt():
    code = ("import sys, kvscope.core.runtimes.calculator, kvscope.core.runtimes.transformers.calc, kvscope.core.runtimes.llamacpp.calc; "
            "from kvscope.core.runtimes.calculator import offered; offered(); "
            "bad = [m for m in ('PySide6', 'pyqtgraph', 'torch', 'llama_cpp') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
