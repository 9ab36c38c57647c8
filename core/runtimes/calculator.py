"""The Calculator tab as a model: its inputs in, the rows and figures it shows out; plain Python, no Qt.

``kvscope.ui.calculator`` only renders a ``CalcFigures`` and turns slider moves into ``CalcInputs``. The numbers are
the command line's: each runtime's rules (``RuntimeInfo.calculator``, e.g. ``kvscope.core.runtimes.transformers.calc``,
``kvscope.core.runtimes.llamacpp.calc``) compute them with the functions ``python main.py calc`` prints, and
``tests/test_calculator_model.py`` checks them against calc's own output over presets, contexts, runtimes and
GPU layouts. Which runtimes the tab offers, and which rows and inputs each has, is the registry's answer
(``kvscope.core.runtimes.calculators``): nothing here names a runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvscope.core import runtimes
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.spec import ModelSpec
from kvscope.core.prediction.parallel import Parallelism

#: Element types the Weights slider offers; the KV dtype slider's (None: as the weights).
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float8", "int8", "int4")
KV_DTYPES = (None, "float32", "bfloat16", "float16", "float8", "int8", "int4", "int2")
#: The context slider reaches at least 128K, beyond a shorter model's trained maximum (flagged).
MIN_CONTEXT_CEILING = 128 * 1024
SLIDER_STEPS = 1000
CHART_POINTS = 72
#: (tensor parallel, pipeline parallel) layouts the GPUs box offers.
GPU_LAYOUTS = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2))
#: The inputs a runtime's rules may read (``CalcRules.inputs``); the others are greyed in the tab.
INPUTS = ("batch", "weight_dtype", "kv_dtype", "attention", "gpus")
TIMES = " \u00d7 "


def gpus_text(tp: int, pp: int) -> str:
    """'1 GPU', '4 GPUs (TP 4)', '4 GPUs (TP 2 x PP 2)': the GPUs box's entries."""
    if tp * pp == 1:
        return "1 GPU"
    parts = ([f"TP {tp}"] if tp > 1 else []) + ([f"PP {pp}"] if pp > 1 else [])
    return f"{tp * pp} GPUs ({TIMES.join(parts)})"


def context_ceiling(spec: ModelSpec) -> int:
    """The context slider's end (tokens): the model's trained maximum, at least ``MIN_CONTEXT_CEILING``."""
    return max(spec.max_position_embeddings, MIN_CONTEXT_CEILING)


def context_stops(spec: ModelSpec) -> list[int]:
    """The powers of two up to the ceiling: where the slider's arrow keys stop (tokens)."""
    return [2 ** k for k in range(int(math.log2(context_ceiling(spec))) + 1)]


def context_values(spec: ModelSpec) -> list[int]:
    """Every context the slider offers (tokens): ``SLIDER_STEPS`` steps on a log scale, and every stop."""
    ceiling = context_ceiling(spec)
    steps = {int(round(2 ** (math.log2(ceiling) * i / SLIDER_STEPS))) for i in range(SLIDER_STEPS + 1)}
    return sorted(steps | set(context_stops(spec)))


@dataclass(frozen=True)
class CalcInputs:
    """What the tab's inputs say. Bytes are integers; ``attention`` and ``cache`` are keys ("gqa:8", "q8_0")."""

    context: int
    runtime: str = runtimes.DEFAULT
    batch: int = 1
    weight_dtype: str | None = "bfloat16"
    kv_dtype: str | None = None
    attention: str | None = None  # None: as the model is built
    cache: str = ""  # "": the runtime's default
    memory: int | None = None  # the GPU memory to fit into, per GPU (None: not given)
    tensor: int = 1
    pipeline: int = 1

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(tensor=self.tensor, pipeline=self.pipeline)

    def with_(self, **changes: Any) -> "CalcInputs":
        return replace(self, **changes)


@dataclass(frozen=True)
class CalcRow:
    """One line of the numbers: ``key`` (weights, kv, activations, total, per_token), its name as shown
    ("Total per GPU"), the bytes (None: not predicted) and what it means (the tooltip)."""

    key: str
    name: str
    bytes: int | None
    tip: str = ""


@dataclass(frozen=True)
class CalcFigures:
    """Everything the tab shows for one set of inputs (the chart's curve aside: ``Calculator.chart``)."""

    inputs: CalcInputs
    settings: RunSettings
    rows: tuple[CalcRow, ...]
    total: int  # what must fit on the (busiest) GPU
    fit: int | None  # the largest context that fits in ``inputs.memory`` (None: no memory given, or nothing fits)
    fit_limit: int  # the search's end: a fit there is shown as "N+"
    formula: str
    gpus: int = 1  # more than 1: the sizes are the busiest GPU's share, per-token and formula are totals
    trained: int = 0  # the model's trained context (tokens)
    label: str = ""  # the model's name (from a file: the view escapes it)

    def bytes(self, key: str) -> int | None:
        """The bytes of row ``key`` (None: no such row, or not predicted)."""
        return next((r.bytes for r in self.rows if r.key == key), None)

    @property
    def memory(self) -> int | None:
        return self.inputs.memory

    # The figures the tab's tests and the stage checks read (bytes; unknown: 0 here, "not predicted" on screen).
    @property
    def context(self) -> int:
        return self.inputs.context

    @property
    def weights(self) -> int:
        return int(self.bytes("weights") or 0)

    @property
    def kv(self) -> int:
        return int(self.bytes("kv") or 0)

    @property
    def activations(self) -> int:
        return int(self.bytes("activations") or 0)

    @property
    def max_fit(self) -> int | None:
        return self.fit

    @property
    def fits_now(self) -> bool | None:
        """Whether the total fits in the memory given (None: none given)."""
        return None if self.memory is None else self.total <= self.memory

    @property
    def fit_capped(self) -> bool:
        """The search stopped at its end: more than ``fit`` tokens may fit ("N+")."""
        return self.fit is not None and self.fit >= self.fit_limit

    @property
    def beyond_trained(self) -> bool:
        return bool(self.trained) and self.inputs.context > self.trained

    @property
    def per_gpu(self) -> bool:
        return self.gpus > 1


@dataclass(frozen=True)
class Chart:
    """The stacked chart: contexts (tokens) and, at each, the bytes of weights, KV and activations."""

    contexts: tuple[int, ...]
    weights: tuple[int, ...]
    kv: tuple[int, ...]
    activations: tuple[int, ...]


class CalcRules(Protocol):
    """A runtime's answers for the calculator (``RuntimeInfo.calculator``); no ML import, no Qt."""

    #: The Runtime list's entry ("llama.cpp (allocated at load)") and its tooltip line.
    label: str
    tip: str
    #: Which of ``INPUTS`` it reads; the tab greys the others, with ``unused_note`` in their tooltips.
    inputs: frozenset[str]
    unused_note: str
    default_cache: str

    def caches(self, spec: ModelSpec | None) -> list[str]:
        """The Cache list's entries for ``spec``."""

    def settings(self, spec: ModelSpec, inputs: CalcInputs) -> RunSettings:
        """The run settings the inputs describe (SettingsError: a combination the model refuses)."""

    def figures(self, spec: ModelSpec, inputs: CalcInputs, fit: tuple[int | None, int]) -> CalcFigures:
        """The rows, total and formula at ``inputs.context``; ``fit`` is ``self.fit``'s answer."""

    def fit(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int | None, int]:
        """(the largest context that fits in ``inputs.memory`` or None, the search's end), as calc searches."""

    def stack(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int, int, int]:
        """(weights, KV, activations) bytes at ``inputs.context``, for the chart (unknown: 0)."""


def rules_for(runtime: str | None) -> CalcRules:
    """The calculator's rules of ``runtime`` (SettingsError: unknown; ValueError: it has none)."""
    rules = runtimes.get(runtime).hook("calculator")
    if rules is None:
        raise ValueError(f"the calculator does not offer {runtime!r}")
    return rules


def offered() -> list[tuple[str, CalcRules]]:
    """(runtime name, rules) for every runtime the calculator offers, in the registry's order."""
    return list(runtimes.calculators().items())


@dataclass
class Calculator:
    """The model: ``figures(spec, inputs)`` and ``chart(spec, inputs)``; the largest context that fits is searched
    once per inputs other than the context (dragging the context slider stays well under a frame)."""

    _fits: dict[tuple, tuple[int | None, int]] = field(default_factory=dict)

    def figures(self, spec: ModelSpec, inputs: CalcInputs) -> CalcFigures:
        """What the tab shows for ``inputs`` (SpecError, SettingsError: a message for the user, one line)."""
        rules = rules_for(inputs.runtime)
        inputs = self.normalised(rules, inputs)
        return rules.figures(spec, inputs, self.fit(spec, inputs))

    def fit(self, spec: ModelSpec, inputs: CalcInputs) -> tuple[int | None, int]:
        """(largest context that fits or None, the search's end), memoised on everything but the context."""
        rules = rules_for(inputs.runtime)
        inputs = self.normalised(rules, inputs)
        key = (spec, inputs.with_(context=0))
        if key not in self._fits:
            if len(self._fits) > 64:
                self._fits.clear()
            self._fits[key] = rules.fit(spec, inputs) if inputs.memory else (None, 0)
        return self._fits[key]

    def chart(self, spec: ModelSpec, inputs: CalcInputs, points: int = CHART_POINTS) -> Chart:
        """The stacked bytes over the last 10 doublings below the slider's end (where memory moves), log-spaced."""
        rules = rules_for(inputs.runtime)
        inputs = self.normalised(rules, inputs)
        ceiling = context_ceiling(spec)
        start = chart_start(spec)
        ratio = (ceiling / start) ** (1 / max(points - 1, 1))
        xs = sorted({int(round(start * ratio ** i)) for i in range(points - 1)} | {ceiling})
        stacks = [rules.stack(spec, inputs.with_(context=n)) for n in xs]
        return Chart(tuple(xs), *(tuple(s[i] for s in stacks) for i in range(3)))

    @staticmethod
    def normalised(rules: CalcRules, inputs: CalcInputs) -> CalcInputs:
        """The inputs as the rules read them: the default cache where none is named; inputs it does not read
        back to their defaults (so the memo and the chart do not change with a greyed slider)."""
        defaults = CalcInputs(context=inputs.context)
        changes: dict[str, Any] = {"cache": inputs.cache or rules.default_cache}
        for name in ("batch", "weight_dtype", "kv_dtype", "attention"):
            if name not in rules.inputs:
                changes[name] = getattr(defaults, name)
        if "gpus" not in rules.inputs:
            changes.update(tensor=1, pipeline=1)
        return inputs.with_(**changes)


def chart_start(spec: ModelSpec) -> int:
    """The chart's first context: 10 doublings below the slider's end."""
    return max(1, context_ceiling(spec) >> 10)
