"""The recipes' registry: a model type's recipe (``RECIPES``), and the one a type without its own gets (``DEFAULT``).

A new architecture is a recipe class in its family's module and one line here."""

from __future__ import annotations

from kvscope.core.prediction.replay.decoder import Decoder
from kvscope.core.prediction.replay.gemma import Gemma, Gemma2
from kvscope.core.prediction.replay.llama import Cohere, Glm, Granite, Llama, Phi3
from kvscope.core.prediction.replay.neox import GptNeox, Phi, StableLm, Starcoder2
from kvscope.core.prediction.replay.olmo import Olmo, Olmo2

#: Model types whose decoder layers the replay follows op by op (transformers 5.24's modeling code).
RECIPES: dict[str, Decoder] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "helium"), Llama()),
    "phi3": Phi3(), "glm": Glm(), "granite": Granite(), "cohere": Cohere(),
    "gemma": Gemma(), "gemma2": Gemma2(),
    "gpt_neox": GptNeox(), "phi": Phi(), "stablelm": StableLm(), "starcoder2": Starcoder2(),
    "olmo": Olmo(), "olmo2": Olmo2(),
}

#: What a model type without a recipe is replayed as.
DEFAULT: Decoder = RECIPES["llama"]


def recipe_for(model_type: str) -> tuple[Decoder, bool]:
    """The recipe of ``model_type``, and whether it is its own (False: ``DEFAULT`` stands in)."""
    recipe = RECIPES.get(model_type)
    return (recipe, True) if recipe is not None else (DEFAULT, False)


__all__ = ["DEFAULT", "RECIPES", "Decoder", "recipe_for"]
