"""The calculator tab: what a context costs for any model, from the predictor alone (no weights).

A view of ``kvscope.core.runtimes.calculator`` (the model, no Qt): the form (``kvscope.ui.calc_form``) says what the
inputs are as a ``CalcInputs``, the model answers with a ``CalcFigures`` (the rows, the total, what fits, the
formula) and a ``Chart``, and the results (``kvscope.ui.calc_results``) and the chart (``kvscope.ui.calc_chart``)
render them. Which runtimes it offers, which inputs each reads and which rows it shows are the registry's answers
(``kvscope.core.runtimes.calculators``). Specs load in the background (``kvscope.workers.spec_loader``); the models on
this machine come from the shared scan (``kvscope.workers.installed_models``).
"""

from __future__ import annotations

from PySide6.QtCore import QSettings, Signal
from PySide6.QtWidgets import QHBoxLayout, QVBoxLayout, QWidget

from kvscope.core.model.settings import RunSettings
from kvscope.core.model.spec import ModelSpec, SpecError
from kvscope.core.prediction.parallel import Parallelism
from kvscope.core.runtimes.calculator import GPU_LAYOUTS, CalcFigures, CalcInputs, Calculator, rules_for  # noqa: F401
from kvscope.ui.calc_chart import CalcChart
from kvscope.ui.calc_form import INSTALLED_ROLE, MEMORY_CHOICES, CalcForm  # noqa: F401 - the names tests know
from kvscope.ui.calc_results import ROW_KEYS, CalcResults  # noqa: F401
from kvscope.ui.theme import Theme, theme as make_theme
from kvscope.workers.installed_models import InstalledModels
from kvscope.workers.spec_loader import SpecLoader


class CalculatorTab(QWidget):
    """Preset / config / hub id in, sliders for the settings, a stacked chart and the numbers out."""

    updated = Signal(object)  # CalcFigures
    spec_loaded = Signal(object)  # ModelSpec
    warmed = Signal()

    def __init__(self, theme: Theme | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.theme = theme or make_theme("dark")
        self.model = Calculator()
        self.state: CalcFigures | None = None
        self._chart_key = None
        self.loader = SpecLoader(self)
        self.loader.loaded.connect(self._spec_arrived)
        self.loader.failed.connect(self._spec_failed)
        self.loader.warmed.connect(self.warmed)
        self.form = CalcForm()
        self.form.source_chosen.connect(self.load_model)
        self.form.changed.connect(self._inputs_changed)
        self.results = CalcResults()
        self.chart = CalcChart()
        f, r = self.form, self.results
        # The widgets the window, the tests and the scripts reach for by name.
        self.model_combo, self.model_status, self.runtime_combo = f.model_combo, f.model_status, f.runtime_combo
        self.context, self.batch, self.dtype, self.kv_dtype, self.attention = (f.context, f.batch, f.dtype, f.kv_dtype,
                                                                               f.attention)
        self.cache_combo, self.memory_combo, self.gpus_combo = f.cache_combo, f.memory_combo, f.gpus_combo
        self.headline, self.fits_label, self.formula_label = r.headline, r.fits_label, r.formula_label
        self.numbers, self.number_names, self.error_label = r.numbers, r.number_names, r.error_label
        top = QHBoxLayout()
        left = QVBoxLayout()
        left.addWidget(self.form)
        left.addStretch(1)
        top.addLayout(left, 5)
        top.addWidget(self.results, 4)
        outer = QVBoxLayout(self)
        outer.addLayout(top, 0)
        outer.addWidget(self.chart, 1)
        self.apply_theme(self.theme)

    # ---- what the form holds, read where the tab's users look for it

    @property
    def spec(self) -> ModelSpec | None:
        return self.form.spec

    @property
    def runtime(self) -> str:
        return self.form.runtime

    @property
    def installed(self) -> InstalledModels | None:
        return self.form.installed

    @property
    def _context_values(self) -> list[int]:
        return self.form.context_values

    def use_installed(self, installed: InstalledModels) -> None:
        """List ``installed``'s models in the picker, after the presets (and follow it as it finds more)."""
        self.form.use_installed(installed)

    def current_source(self) -> str:
        return self.form.current_source()

    def set_context(self, tokens: int) -> None:
        """Move the context slider to the value nearest ``tokens``."""
        self.form.set_context(tokens)

    def set_detected_memory(self, total: int | None, device_name: str) -> None:
        """Offer the memory of the device the Live tab loaded onto (selected when it is a GPU)."""
        self.form.set_detected_memory(total, device_name)

    def memory_bytes(self) -> int | None:
        return self.form.memory_bytes()

    def parallelism(self) -> Parallelism:
        return self.form.parallelism()

    def inputs(self) -> CalcInputs:
        return self.form.inputs()

    # ---- the spec (loads in the background: kvscope.workers.spec_loader)

    @property
    def warm(self) -> bool:
        return self.loader.warm

    def warm_up(self) -> None:
        """Import transformers in the loader's thread (first job; spec loads queue behind it)."""
        self.loader.warm_up()

    def load_model(self, source: str) -> None:
        """Load a spec (preset, config path, model folder, GGUF file, installed model's name, hub id) in the
        background; the tab updates when it arrives."""
        source = self.form.resolve(source.strip())
        if not source:
            return
        if source not in self.loader.specs:
            self.form.show_loading(source)
        self.loader.load(source)

    def _spec_arrived(self, source: str, spec: ModelSpec) -> None:
        self.set_spec(spec)
        self.form.follow_runtime(source)

    def _spec_failed(self, error: str) -> None:
        self.model_status.setText("")
        self.results.show_error(error)

    def set_spec(self, spec: ModelSpec, source: str | None = None) -> None:
        """Show ``spec`` (also used for the model the Live tab loaded)."""
        if source:
            self.loader.specs[source] = spec
        self.form.show_spec(spec, source)
        self.results.show_error("")
        self._chart_key = None
        self.spec_loaded.emit(spec)
        self.recompute()

    # ---- the model's answer, rendered

    def _inputs_changed(self, curve: bool) -> None:
        if curve:
            self._chart_key = None
        self.recompute()

    def current_settings(self) -> RunSettings:
        """The run settings the inputs describe (as ``calc`` reads its flags)."""
        return rules_for(self.runtime).settings(self.spec, self.model.normalised(rules_for(self.runtime),
                                                                                 self.inputs()))

    def recompute(self) -> None:
        """Update every number, the formula and the chart for the current inputs (about a millisecond)."""
        spec = self.spec
        if spec is None:
            return
        try:
            figures = self.model.figures(spec, self.inputs())
            key = (spec, figures.inputs.with_(context=0, memory=None))
            chart = self.model.chart(spec, figures.inputs) if key != self._chart_key else None
        except SpecError as exc:  # SettingsError too: e.g. quantized cache on sliding layers
            self.results.show_error(exc)
            return
        self.results.show_error("")
        self.state = figures
        self.results.show_figures(spec, figures, self.theme)
        if chart is not None:
            self._chart_key = key
            self.chart.show_curve(spec, chart)
        self.chart.show_lines(spec, figures)
        self.updated.emit(figures)

    # ---- looks and settings

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        self.chart.apply_theme(theme)
        if self.spec is not None:
            self.recompute()

    def save_settings(self, s: QSettings) -> None:
        self.form.save(s)

    def restore_settings(self, s: QSettings) -> None:
        """Restore the last model and settings (the model loads in the background, then the sliders apply)."""
        model, saved = self.form.restore(s)

        def apply(_spec) -> None:
            self.spec_loaded.disconnect(apply)
            self.form.apply_saved(saved)

        self.spec_loaded.connect(apply)
        self.use_installed(InstalledModels.for_settings(s))
        self.installed.refresh()  # the window's controls asked already: the same scan is not started twice
        self.model_combo.setCurrentText(model)
        self.load_model(model)

    def shutdown(self, timeout_ms: int = 3000) -> None:
        """Wait for a spec load and a scan for installed models in flight (no pool thread may outlive the window)."""
        self.loader.wait(timeout_ms)
        if self.installed is not None:
            self.installed.wait(timeout_ms)
