"""Multi-GPU prediction: what each GPU holds under tensor parallelism (TP) and pipeline parallelism (PP).

The rules are vLLM's (the layout of ``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py`` and ``vllm/distributed/utils.py``'s ``get_pp_indices``, vLLM 0.33.0):

- TP over N GPUs splits the query heads N ways and the KV heads N ways; when N exceeds the KV-head
  count, each GPU holds one KV head and the heads are replicated N / kv_heads times
  (``QKVParallelLinear``: ``num_kv_heads = max(1, total_num_kv_heads // tp_size)``); vLLM refuses a
  head count that neither divides nor is divided by N, and so do we. An MLA latent is one "head":
  every TP rank caches the whole latent. The MLP, the embedding and the LM head are split N ways
  (the vocabulary first padded to a multiple of 64, ``DEFAULT_VOCAB_PADDING_SIZE``); norms are
  replicated on every GPU.
- PP over M stages splits the layers: ``num_layers // M`` each, the remainder one more each from the
  second-to-last stage backwards (``get_pp_indices``). The first stage holds the embedding, the last
  the final norm and the LM head (its own copy when the embedding is tied and M > 1).

Each GPU is predicted by ``kvscope.core.prediction.predict`` on a shard spec: the model as that GPU sees it (its layers,
its heads, its share of the MLP, its parameters). KV bytes per GPU are then exact for the layout
above; weights are exact where the parameter count decomposes into embedding + attention + norms +
the rest (a dense decoder such as Llama), else the rest is assumed split evenly (said in ``notes``);
activations are ``kvscope.core.prediction.predict``'s replayed peaks of each shard, per GPU (the gathered logits counted
in full on the last stage).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.settings import RunSettings, effective_spec
from kvscope.core.model.spec import ModelSpec
from kvscope.core.prediction.predict import Prediction, last_true, predict

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` (vocab_parallel_embedding.py): the vocabulary is padded to it.
VOCAB_PADDING = 64

#: The most GPUs one command may ask for (TP x PP); beyond any single deployment.
MAX_GPUS = 4096


@dataclass(frozen=True)
class Parallelism:
    """``tensor`` GPUs per pipeline stage, ``pipeline`` stages: tensor x pipeline GPUs in all."""

    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name, value in (("tensor-parallel", self.tensor), ("pipeline-parallel", self.pipeline)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SettingsError(f"--{name} must be a positive whole number of GPUs, got {value!r}")
        if self.tensor * self.pipeline > MAX_GPUS:
            raise SettingsError(f"{self.tensor} x {self.pipeline} GPUs is more than {MAX_GPUS:,}")

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline

    @property
    def single(self) -> bool:
        return self.gpus == 1


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers [first_layer, end_layer), and what each of its TP GPUs holds."""

    index: int
    first_layer: int
    end_layer: int
    kv_heads_per_gpu: int  # K/V heads one GPU caches per layer (an MLA latent counts as 1)
    kv_replicas: int  # how many GPUs of the stage hold the same KV head (1: none replicated)
    parameters_per_gpu: int
    spec: ModelSpec  # the model as one GPU of this stage sees it

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


@dataclass(frozen=True)
class ParallelLayout:
    spec: ModelSpec  # the effective spec (attention mode applied)
    parallelism: Parallelism
    stages: tuple[Stage, ...]
    notes: tuple[str, ...]

    def gpu_stage(self, gpu: int) -> Stage:
        """GPU ``gpu`` (0-based, stage-major as vLLM numbers ranks: rank = stage x TP + tp_rank)."""
        return self.stages[gpu // self.parallelism.tensor]


def pp_partition(num_layers: int, stages: int) -> list[int]:
    """Layers per stage, as vLLM's ``get_pp_indices`` splits them (no VLLM_PP_LAYER_PARTITION)."""
    if stages > num_layers:
        raise SettingsError(f"--pipeline-parallel {stages} is more stages than the model's {num_layers} layers")
    parts = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        parts[-i] += 1
    return parts


def _padded_vocab_share(vocab: int, tp: int) -> int:
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def layout(spec: ModelSpec, settings: RunSettings, parallelism: Parallelism) -> ParallelLayout:
    """Split ``spec`` (under ``settings``' attention mode) over ``parallelism``'s GPUs, vLLM's way."""
    eff = effective_spec(spec, settings)
    tp, pp = parallelism.tensor, parallelism.pipeline
    notes: list[str] = []
    if eff.num_query_heads % tp:
        raise SettingsError(f"--tensor-parallel {tp} does not divide the {eff.num_query_heads} query heads "
                            "(vLLM refuses it too)")
    if eff.is_mla:
        kv_per_gpu, replicas = 1, tp
        if tp > 1:
            notes.append(f"MLA: every one of the {tp} GPUs of a stage caches the whole latent (as vLLM does)")
    else:
        kv = eff.num_kv_heads
        if kv % tp and tp % kv:
            raise SettingsError(f"--tensor-parallel {tp} neither divides nor is a multiple of the {kv} KV heads "
                                "(vLLM refuses it too)")
        kv_per_gpu, replicas = max(1, kv // tp), max(1, tp // kv)
        if replicas > 1:
            notes.append(f"{tp} GPUs > {kv} KV heads: each GPU holds 1 KV head, every head replicated "
                         f"on {replicas} GPUs (as vLLM does)")

    h, hd, vd = eff.hidden_size, eff.head_dim, eff.v_head_dim or eff.head_dim
    embed = eff.vocab_size * h
    lm_head = 0 if eff.tie_word_embeddings else embed
    norms_per_layer = 2 * h
    if eff.is_mla:
        attention = 0  # not decomposed: MLA's projections go into the evenly split rest
        attention_shard = 0
    else:
        bias_q, bias_kv = (eff.num_query_heads * hd, eff.num_kv_heads * (hd + vd)) if eff.kv_bias else (0, 0)
        attention = h * eff.num_query_heads * hd * 2 + h * eff.num_kv_heads * (hd + vd) + bias_q + bias_kv
        attention_shard = ((h * eff.num_query_heads * hd * 2 + bias_q) // tp
                           + kv_per_gpu * (h * (hd + vd) + (hd + vd if eff.kv_bias else 0)))
    rest = eff.num_parameters - embed - lm_head - h - eff.num_layers * (attention + norms_per_layer)
    if rest < 0 or eff.is_mla:
        # The decomposition does not fit this architecture: split all but the embeddings evenly.
        attention = attention_shard = 0
        rest = max(0, eff.num_parameters - embed - lm_head - h - eff.num_layers * norms_per_layer)
        if not parallelism.single:
            notes.append("weights per GPU are an estimate for this architecture: all but the embeddings and "
                         "norms assumed split evenly")
    rest_per_layer = rest / eff.num_layers if eff.num_layers else 0.0
    vocab_share = _padded_vocab_share(eff.vocab_size, tp)

    stages = []
    start = 0
    for index, n_layers in enumerate(pp_partition(eff.num_layers, pp)):
        first, last = index == 0, index == pp - 1
        params = n_layers * (attention_shard + norms_per_layer) + int(math.ceil(n_layers * rest_per_layer / tp))
        if first:
            params += vocab_share * h
        if last:
            params += h  # the final norm
            if lm_head or pp > 1:
                params += vocab_share * h  # the LM head (tied to the embedding only when on the same GPU)
        if parallelism.single:
            params = eff.num_parameters  # exact, whatever the architecture
        config = dict(eff.config)
        inter = eff.intermediate_size
        config["intermediate_size"] = -(-inter // tp)
        per_layer = {}
        states = getattr(eff, "layer_states", None)  # what layers hold beside K/V, where a spec says so
        if states is not None and len(states) == eff.num_layers:
            per_layer["layer_states"] = states[start:start + n_layers]
        shard = dataclasses.replace(
            eff,
            **per_layer,
            num_layers=n_layers,
            layer_types=eff.layer_types[start:start + n_layers],
            num_query_heads=eff.num_query_heads // tp,
            num_kv_heads=eff.num_kv_heads if eff.is_mla else kv_per_gpu,
            num_parameters=params,
            # Only the last stage computes logits (gathered in full); the others pass hidden states on.
            vocab_size=eff.vocab_size if last else 0,
            config=config,
        )
        stages.append(Stage(index, start, start + n_layers, kv_per_gpu, replicas, params, shard))
        start += n_layers
    return ParallelLayout(eff, parallelism, tuple(stages), tuple(notes))


@dataclass(frozen=True)
class ParallelPrediction:
    """One context's prediction on every stage (each of a stage's TP GPUs holds the same)."""

    context: int
    per_stage: tuple[Prediction, ...]
    layout: ParallelLayout

    def per_gpu(self) -> list[Prediction]:
        """Every GPU's prediction, rank order (stage-major)."""
        return [p for p in self.per_stage for _ in range(self.layout.parallelism.tensor)]

    @property
    def largest_gpu_total(self) -> int:
        return max(p.total for p in self.per_stage)

    def total(self, part: str) -> int:
        """Sum over every GPU of ``part`` (weights, kv_cache, activations) or of the total (``"total"``)."""
        return sum(p.total if part == "total" else (getattr(p.breakdown, part) or 0) for p in self.per_gpu())


def _shard_settings(settings: RunSettings) -> RunSettings:
    # The shard spec already has the attention mode applied.
    return settings.with_(attention=None)


def predict_parallel(spec: ModelSpec, settings: RunSettings, parallelism: Parallelism, context: int,
                     plan: ParallelLayout | None = None) -> ParallelPrediction:
    """Per-GPU predicted bytes after ``context`` tokens (weights, KV, activation peak), stage by stage."""
    plan = plan or layout(spec, settings, parallelism)
    s = _shard_settings(settings)
    return ParallelPrediction(context, tuple(predict(st.spec, s, context) for st in plan.stages), plan)


def max_context_per_gpu(spec: ModelSpec, settings: RunSettings, parallelism: Parallelism, gpu_memory: int,
                        limit: int, plan: ParallelLayout | None = None) -> int | None:
    """Largest context whose prediction fits in ``gpu_memory`` bytes on every GPU; None if not 1 token."""
    plan = plan or layout(spec, settings, parallelism)
    s = _shard_settings(settings)

    def fits(n: int) -> bool:
        ss = s.with_(max_context=n) if s.cache.name == "static" else s
        return all(predict(st.spec, ss, n).total <= gpu_memory for st in plan.stages)

    if not fits(1):
        return None
    return last_true(fits, 1, limit)


# ------------------------------------------------------------------------------------------------
# The calc command's view: a JSON list and table lines per GPU.


def gpu_rows(prediction: ParallelPrediction) -> list[dict]:
    """One dict per GPU, rank order: rank, stage, tp_rank, its layers, KV heads, and bytes."""
    plan = prediction.layout
    out = []
    for rank, p in enumerate(prediction.per_gpu()):
        stage = plan.gpu_stage(rank)
        out.append({
            "gpu": rank, "pp_stage": stage.index, "tp_rank": rank % plan.parallelism.tensor,
            "layers": [stage.first_layer, stage.end_layer], "kv_heads": stage.kv_heads_per_gpu,
            "kv_head_replicas": stage.kv_replicas, "parameters": stage.parameters_per_gpu,
            "kv_cache_bytes": p.breakdown.kv_cache, "weights_bytes": p.breakdown.weights,
            "activation_bytes": p.breakdown.activations, "total_bytes": p.total,
        })
    return out


def describe(plan: ParallelLayout) -> list[str]:
    """Lines saying how the model is split (for the calc table)."""
    par = plan.parallelism
    parts = [f"{par.gpus} GPUs: tensor parallel {par.tensor} x pipeline parallel {par.pipeline} (vLLM's layout)"]
    for st in plan.stages:
        heads = "1 latent (MLA)" if plan.spec.is_mla else f"{st.kv_heads_per_gpu} KV head{'s' if st.kv_heads_per_gpu != 1 else ''}"
        who = f"GPUs {st.index * par.tensor}-{(st.index + 1) * par.tensor - 1}" if par.tensor > 1 else f"GPU {st.index}"
        parts.append(f"  stage {st.index} ({who}): layers {st.first_layer}-{st.end_layer - 1}, {heads} and "
                     f"{st.parameters_per_gpu:,} parameters per GPU")
    parts += [f"  {note}" for note in plan.notes]
    return parts
