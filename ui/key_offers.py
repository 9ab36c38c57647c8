"""What a key or a combo entry of the controls may offer from the settings in force (issue 25: C stuck on a quantized
cache the engine refuses): the refusals the engine gave, the runtime's own rules (its registry ``switch_problem``),
the greyed entries with their reasons, and what keys 1-5, F and C mean for the loaded model.

``KeyOffers`` is a part of ``kvscope.ui.controls.ControlsPanel`` (its combos, choices and the settings in force are the
panel's); it decides nothing about a run: the window sends what it offers.
"""

from __future__ import annotations

from kvscope.core import runtimes
from kvscope.core.model.settings import ATTN_IMPLS

#: The axes a live switch changes, in the command line's spelling.
SWITCH_KEYS = ("attention", "attn-impl", "cache")


def _short(reason: str, limit: int = 44) -> str:
    """A reason short enough for a combo entry (the whole one is its tooltip)."""
    return reason if len(reason) <= limit else reason[:limit - 1].rstrip() + "\u2026"


class KeyOffers:
    """The controls' judgement of switches: needs ``combo(key)``, ``running``, ``refusals``, ``runtime``, the choices,
    ``model_spec``/``model_device``, ``context_tokens``/``tokens_ahead`` and ``run_max_context`` (the panel's)."""

    def set_model(self, spec, device: str | None) -> None:
        """The loaded model's spec and device: what ``switch_problem`` judges by; refusals learned for
        another model are forgotten."""
        self.model_spec, self.model_device = spec, device
        self.refusals.clear()
        self.running = {}

    @staticmethod
    def _state(now: dict[str, str]) -> tuple[str, str, str]:
        return (now.get("attention", ""), now.get("attn-impl", ""), now.get("cache", ""))

    def settings_ahead(self) -> dict[str, str]:
        """The settings once the switches asked are in: the combos (which show what was asked), else what runs."""
        out = dict(self.running)
        for key in SWITCH_KEYS:
            data = self.combo(key).currentData()
            if data:
                out[key] = data
        return out

    def problem(self, key: str, value: str, now: dict[str, str] | None = None) -> str | None:
        """Why ``key=value`` cannot run from ``now`` (default: the settings ahead), or None: a refusal the
        engine gave from that state, else the runtime's own rules (its registry ``switch_problem``:
        ``kvscope.core.runtimes.transformers.switches.switch_problem`` for transformers). Only a run with a known model is judged, and only
        where its runtime judges ahead (a runtime whose own choices say what it reloads judges none)."""
        now = self.settings_ahead() if now is None else now
        info = runtimes.find(self.runtime)
        if self.model_spec is None or len(now) < 3 or info is None or info.switch_problem is None:
            return None
        if now.get(key) == value:
            return None  # what runs: no switch
        learned = self.refusals.get((key, value, self._state(now)))
        if learned:
            return learned
        return runtimes.switch_problem(self.runtime, self.model_spec, self.model_device, now, key, value,
                                       tokens=self.context_tokens(), max_context=self.run_max_context,
                                       ahead=self.tokens_ahead())

    def grey_what_cannot_run(self) -> None:
        """Grey out, with the reason, each combo entry the engine cannot apply from the settings ahead;
        enable again what can (the entries the choices themselves rule out stay grey)."""
        base = {"cache": dict(self.cache_choices),
                "attn-impl": {k: None if k in self.impl_choices else "not available here" for k in self._impls_listed()}}
        now = self.settings_ahead()
        for key in SWITCH_KEYS:
            combo = self.combo(key)
            model = combo.model()
            for i in range(combo.count()):
                value = combo.itemData(i)
                item = model.item(i)
                if not value or item is None or (key == "cache" and runtimes.reloads_cache(self.runtime)):
                    continue
                fixed = base.get(key, {}).get(value)
                reason = fixed or self.problem(key, value, now)
                item.setEnabled(reason is None)
                item.setToolTip(reason or "")
                item.setText(value if reason is None else f"{value} ({_short(reason)})")

    def _offer(self, key: str, value: str | None) -> str | None:
        """``value`` when it can run from the settings ahead; else None, with the reason in ``last_problem``."""
        if value is None:
            self.last_problem = "not available for this model"
            return None
        reason = self.problem(key, value)
        if reason:
            self.last_problem = f"{value}: {reason}"
            return None
        self.last_problem = ""
        return value

    # ---- what the keys mean for this model

    def attention_for_key(self, n: int) -> str | None:
        """Keys 1-5: mha, the middle GQA choice, mqa, mla, the smallest window (its plateau shows soonest);
        None (with ``last_problem``) when the model has none or the engine cannot apply it from here."""
        choices = list(self.attention_choices)
        gqa = [c for c in choices if c.startswith("gqa:")]
        return self._offer("attention", {
            1: "mha" if "mha" in choices else None,
            2: gqa[len(gqa) // 2] if gqa else None,
            3: "mqa" if "mqa" in choices else None,
            4: "mla" if "mla" in choices else None,
            5: next((c for c in reversed(choices) if c.startswith("window")), None),
        }.get(n))

    def _impls_listed(self) -> list[str]:
        """The kernels the Kernel combo lists: torch's three (those this model cannot run greyed), or the
        runtime's own where it names others (e.g. ``fa-off`` / ``fa-on``)."""
        own = [k for k in self.impl_choices if k not in ATTN_IMPLS]
        return list(self.impl_choices) if own else list(ATTN_IMPLS)

    def _flash_kernel(self) -> str | None:
        """The kernel key F means here: SDPA's flash, or a runtime's flash attention on (``fa-on``)."""
        return next((k for k in ("flash", "fa-on") if k in self.impl_choices), None)

    def flash_toggled(self) -> str | None:
        """Key F: the kernel to switch to (flash, or back to the last other one); None (with ``last_problem``)
        if flash is not here or cannot run from the settings ahead."""
        flash = self._flash_kernel()
        if flash is not None and (self.impl_combo.currentData() or "sdpa") == flash:
            others = [k for k in self.impl_choices if k != flash]
            back = self.last_non_flash if self.last_non_flash in others else (others[0] if others else None)
            return self._offer("attn-impl", back)
        return self._offer("attn-impl", flash)

    def next_cache(self) -> str | None:
        """Key C: the next cache strategy after the one shown that the engine can apply from the settings
        ahead (what it cannot is skipped, never proposed again and again); None when there is none."""
        listed = [k for k, reason in self.cache_choices if reason is None]
        current = self.cache_combo.currentData() or "dynamic"
        start = listed.index(current) + 1 if current in listed else 0
        for k in listed[start:] + listed[:start]:
            if k != current and self.problem("cache", k) is None:
                self.last_problem = ""
                return k
        self.last_problem = "no other cache can run with these settings"
        return None

