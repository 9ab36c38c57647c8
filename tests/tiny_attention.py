"""An attention mode the docs' recipe 3 adds (docs/extending.md): ``half``, half the model's own K/V heads, mean-pooled.

It is this module and one entry in ``kvscope.core.model.attention.ATTENTION_MODES`` (``register_half`` makes it at
run time, as a line in that list would): nothing else in the tree names it. ``tests/test_attention_recipe.py``
drives it through calc, run (live, under transformers), the command line's help and messages, and the window's
Attention combo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvscope.core.model.attention import ATTENTION_MODES, AttentionMode, with_kv_heads
from kvscope.core.model.spec import ModelSpec, SettingsError

NAME = "half"


@dataclass(frozen=True)
class Half(AttentionMode):
    name: ClassVar[str] = NAME
    help: ClassVar[str] = "half the model's own K/V heads, each the mean of two of its own"
    spellings: ClassVar[tuple[str, ...]] = (NAME,)

    @classmethod
    def choices(cls, spec: ModelSpec) -> list[str]:
        return [NAME] if spec.num_kv_heads % 2 == 0 and not spec.is_mla else []

    def check(self, spec: ModelSpec) -> None:
        if spec.num_kv_heads % 2 or spec.is_mla:
            raise SettingsError(f"half needs an even number of K/V heads; {spec.label} has {spec.num_kv_heads}")

    def apply(self, spec: ModelSpec) -> ModelSpec:
        self.check(spec)
        return with_kv_heads(spec, spec.num_kv_heads // 2)


def register_half() -> None:
    """The recipe's one line."""
    ATTENTION_MODES.append(Half)


def unregister_half() -> None:
    ATTENTION_MODES.remove(Half)
