"""The quality probe of an engine: the model as loaded kept beside the running one (``reference.py``), and what it
says of each token: the run's next-token distribution against the loaded model's, teacher-forced."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.core.runtimes.transformers.engine import Engine


def keep_reference(engine: "Engine") -> None:
    """The quality probe's reference: a copy of the model as loaded sharing its tensors (``reference.py``)."""
    from kvscope.core.runtimes.transformers.reference import LoadedReference

    try:
        engine._reference = LoadedReference(engine.base_model, engine.max_context())
    except Exception as exc:  # noqa: BLE001 - a model that cannot be copied structurally: no probe, said once
        engine._reference = None
        engine._reference_problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        engine.notes.append(f"quality probe off: the model as loaded cannot be kept beside the run "
                            f"({engine._reference_problem})")


def quality_now(engine: "Engine") -> dict[str, Any]:
    """The quality probe's figures for sequence 0 (empty when it is off), against the model as loaded on the same
    tokens (teacher-forced, its own full dynamic cache; untimed: tokens/s is the run's own): whether the run's
    most likely next token is the loaded model's (``quality_top1`` 1 or 0), KL(loaded || run) of the next-token
    distributions over the whole vocabulary in nats (``quality_kl``), and the loaded model's most likely next
    token (``quality_token``, ``quality_token_text``). The loaded model runs the tokens its cache lacks: one
    decode step per token of the run, the prompt once; everything again only if its cache was dropped."""
    from kvscope.core.runtimes.transformers.reference import quality

    if not engine.quality_probe or engine._reference is None or engine._next_logits is None or engine.ids is None:
        return {}
    ref = engine._reference.follow(engine.ids)
    top1, kl, best = quality(engine._next_logits[0], ref)
    tokenizer = getattr(engine.loaded, "tokenizer", None)
    text = tokenizer.decode([best]) if tokenizer is not None else None
    return {"quality_top1": top1, "quality_kl": kl, "quality_token": best,
            "quality_token_text": None if text is None else text[:256], "quality_kv_bytes": engine._reference.nbytes}
