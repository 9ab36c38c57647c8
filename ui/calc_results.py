"""The calculator's results: the headline (the total, and whether it fits), the largest context that fits, the
breakdown's rows, the KV-cache formula and the last error, rendered from the model's ``CalcFigures``.

It renders only: the figures come from ``kvscope.core.runtimes.calculator`` (each runtime's rows, names and
meanings), and ``kvscope.ui.calculator.CalculatorTab`` hands them over.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QVBoxLayout, QWidget

from kvscope.core.base.safe_text import NAME_LIMIT, safe_text
from kvscope.core.model.spec import ModelSpec, human_bytes
from kvscope.core.runtimes.calculator import CalcFigures
from kvscope.ui.axes import format_tokens
from kvscope.ui.theme import Theme

#: The numbers' rows before a model is shown (each runtime's figures name them: ``CalcRow``).
ROW_KEYS = ("weights", "kv", "activations", "total", "per_token")


class CalcResults(QWidget):
    """The results column: ``show_figures`` for a model's answer, ``show_error`` for a refusal."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.headline = QLabel("Loading\u2026")
        self.headline.setObjectName("headline")
        self.headline.setWordWrap(True)
        self.fits_label = QLabel("")
        self.fits_label.setToolTip("The largest context whose predicted total (weights + KV + activation peak) "
                                   "fits in the GPU memory above (kvscope.core.prediction.predict.max_context_that_fits).")
        self.fits_label.setObjectName("headline")
        self.fits_label.setWordWrap(True)  # never wider than the column: at 1024x768 its one line cut the numbers off
        numbers_box = QGroupBox("Breakdown at this context")
        self._grid = QGridLayout(numbers_box)
        self.numbers: dict[str, QLabel] = {}
        self.number_names: dict[str, QLabel] = {}
        self._show_rows(ROW_KEYS)
        self.formula_label = QLabel("")
        self.formula_label.setObjectName("formula")
        self.formula_label.setWordWrap(True)
        self.formula_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.formula_label.setToolTip("The KV-cache formula with this model's numbers substituted; the result is "
                                      "the exact bytes a dynamic cache of full-attention layers holds.")
        self.error_label = QLabel("")
        self.error_label.setTextFormat(Qt.TextFormat.PlainText)  # errors quote files: never HTML
        self.error_label.setObjectName("error")
        self.error_label.setWordWrap(True)
        formula_box = QGroupBox("KV cache formula")
        QVBoxLayout(formula_box).addWidget(self.formula_label)
        column = QVBoxLayout(self)
        column.setContentsMargins(0, 0, 0, 0)  # a column of the tab's own layout, as it was before it was a widget
        for w in (self.headline, self.fits_label, numbers_box, formula_box, self.error_label):
            column.addWidget(w)
        column.addStretch(1)

    def _show_rows(self, keys) -> None:
        """One name and one value label per row the runtime's figures have (built again when they change)."""
        if tuple(self.numbers) == tuple(keys):
            return
        for label in (*self.numbers.values(), *self.number_names.values()):
            self._grid.removeWidget(label)
            label.deleteLater()
        self.numbers.clear()
        self.number_names.clear()
        for row, key in enumerate(keys):
            name = QLabel(key)
            name.setObjectName("statName")
            value = QLabel("\u2014")
            value.setObjectName("statValue")
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self._grid.addWidget(name, row, 0)
            self._grid.addWidget(value, row, 1)
            self.numbers[key], self.number_names[key] = value, name

    def show_error(self, text: str) -> None:
        """The error line (``""`` clears it); text from files and servers, made safe to show."""
        self.error_label.setText(safe_text(text) if text else "")

    def show_figures(self, spec: ModelSpec, f: CalcFigures, t: Theme) -> None:
        """The model's answer for ``spec``: the rows, the headline, what fits and the formula, in theme ``t``."""
        self._show_rows([row.key for row in f.rows])
        for row in f.rows:
            self.number_names[row.key].setText(row.name)
            shown = "not predicted" if row.bytes is None else human_bytes(row.bytes)
            self.numbers[row.key].setText(shown)
            for w in (self.number_names[row.key], self.numbers[row.key]):
                w.setToolTip(row.tip)
        memory = f.memory
        verdict = "" if f.fits_now is None else (f"<span style='color:{t.curves['allocated']}'>fits</span>" if f.fits_now
                                                 else f"<span style='color:{t.error}'>does not fit</span>")
        per_gpu = f" per GPU (the busiest of {f.gpus})" if f.per_gpu else ""
        name = html.escape(safe_text(spec.label, limit=NAME_LIMIT))
        self.headline.setText(
            f"{human_bytes(f.total)}{per_gpu} at {format_tokens(f.context)} tokens"
            + (f" \u2014 {verdict} in {human_bytes(memory)}" if memory else "")
            + (f"<br><span style='font-size:{t.font_pt}pt;color:{t.warning}'>beyond {name}'s trained context of "
               f"{format_tokens(spec.max_position_embeddings)}</span>" if f.beyond_trained else ""))
        if memory is None:
            self.fits_label.setText("<span style='font-size:small'>type a GPU memory size to see what fits</span>")
        elif f.fit is None:
            self.fits_label.setText(f"Weights alone do not fit in {human_bytes(memory)}")
        else:
            where = f" on every one of {f.gpus} GPUs" if f.per_gpu else ""
            past = (f"<br><span style='font-size:small'>past the trained {format_tokens(spec.max_position_embeddings)}"
                    "</span>" if f.fit > spec.max_position_embeddings else "")
            self.fits_label.setText(f"Largest context that fits{where}: {f.fit:,}{'+' if f.fit_capped else ''} "
                                    f"tokens{past}")
        self.formula_label.setText(f.formula)
