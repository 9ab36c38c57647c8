"""Live conversions of a running model and its KV cache, between two generated tokens.

Attention modes (MHA / GQA(n) / MQA) rewrite every decoder layer's ``k_proj``/``v_proj`` and the
cache the same way, so generation continues without re-running the prompt:

- going UP in KV heads (the new count a multiple of the old) repeats each head. This is exact:
  transformers' ``repeat_kv`` lets query head ``i`` read KV head ``i // groups``, so a GQA model
  and its head-repeated MHA twin compute the same numbers, and the repeated cache is what the twin
  would have cached.
- going DOWN (the old count a multiple of the new) mean-pools each group of heads, the
  initialisation of the GQA paper (Ainslie et al. 2023, "uptraining"). Approximate: the pooled
  model is a different model, and the pooled cache is only what it would have cached at layer 0
  (deeper layers saw hidden states of the unpooled model).
- any other pair goes through the least common multiple of the two counts (which divides the
  query heads): repeat up to it, then pool down. Same as passing through MHA.

The engine keeps the loaded model's own K/V projections aside (``keep_kv_projections``: the tensors as
loaded, by reference) and every head change starts from them (``set_kv_heads(..., origin=)``), never
from the last converted state: a switch back to the model's own head count puts the loaded tensors
themselves back, and MQA after MHA is the same MQA as straight from the model's own heads.

Cache strategies switch by reading each layer's valid K/V out (``dense_kv``) and pushing it into a
fresh cache of the new kind (``refill_cache``): exact between dynamic and static; a quantized
target quantizes everything on that one update (lossy); a quantized source is dequantized.

A sliding window W comes from the model's own sliding-window support (``with_window``); a Llama
model gets a MistralForCausalLM twin that shares its very modules. ``convert_cache_window`` moves a
dynamic cache to and from sliding layers.

MLA on a model that is not MLA is a latent of its own K/V in the cache (``kvscope.core.runtimes.transformers.latent``); ``dense_kv``
reads such a cache's K/V reconstructed.

Why one file of about 700 lines: every conversion here walks the same decoder layers and the same
cache layers with the same helpers (head pooling, the dense K/V read-out, the layer-pattern
twins), and the switch transaction (``kvscope.core.runtimes.transformers.transaction``) snapshots and restores exactly what these
functions touch; split apart, each half would need the other's internals.

Every function here works on any Llama/Mistral/Qwen2-style model (``q_proj``/``k_proj``/
``v_proj``/``o_proj`` per layer and a ``num_key_value_groups`` attribute), in any dtype or device.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers.cache_utils import (BaseQuantizedLayer, Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer,
                                      Fp8QuantizedLayer, QuantizedLayer, StaticLayer, StaticSlidingWindowLayer,
                                      get_layer_types_and_kwargs)

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.spec import FULL_ATTENTION, SLIDING_ATTENTION

__all__ = [
    "DynamicTruncatedLayer",
    "KVOrigin",
    "cache_heads",
    "check_kv_projections",
    "convert_cache",
    "convert_cache_kv_heads",
    "convert_cache_window",
    "dense_kv",
    "keep_kv_projections",
    "kv_heads_of",
    "refill_cache",
    "regroup_heads",
    "set_head_counts",
    "set_kv_heads",
    "with_window",
]


# ------------------------------------------------------------------------------------------------
# Head regrouping, shared by weights and caches so both follow one convention.


def regroup_heads(x: torch.Tensor, old_heads: int, new_heads: int, dim: int) -> torch.Tensor:
    """``x`` with its ``old_heads`` heads along ``dim`` turned into ``new_heads`` heads.

    Up (new a multiple of old): each head repeated ``new // old`` times in place
    (``repeat_interleave``, the layout of ``repeat_kv``), exact. Down (old a multiple of new):
    each run of ``old // new`` consecutive heads averaged, computed in float32 and cast back; a run
    of copies of one head (what repeating left) gives that head itself, exact.
    Otherwise: up to ``lcm(old, new)``, then down. Returns a new tensor (never a view of ``x``).
    """
    if old_heads <= 0 or new_heads <= 0:
        raise SettingsError(f"head counts must be positive, not {old_heads} -> {new_heads}")
    if x.shape[dim] != old_heads:
        raise SettingsError(f"expected {old_heads} heads along dim {dim}, found {x.shape[dim]}")
    dim = dim % x.dim()
    if new_heads == old_heads:
        return x.clone()
    if new_heads % old_heads == 0:
        return x.repeat_interleave(new_heads // old_heads, dim=dim)
    if old_heads % new_heads == 0:
        group = old_heads // new_heads
        grouped = x.reshape(*x.shape[:dim], new_heads, group, *x.shape[dim + 1:])
        first = grouped.narrow(dim + 1, 0, 1)
        if torch.equal(grouped, first.expand_as(grouped)):
            # Every group is copies of one head (a repeated cache going back down): that head, bit for bit
            # (a float mean of three equal addends can be one ulp off).
            return first.squeeze(dim + 1).clone()
        # Averaging in float32 keeps bf16/fp16 pools from losing the low bits of each addend.
        return grouped.float().mean(dim=dim + 1).to(x.dtype)
    via = math.lcm(old_heads, new_heads)
    return regroup_heads(regroup_heads(x, old_heads, via, dim), via, new_heads, dim)


def _is_exact(old_heads: int, new_heads: int) -> bool:
    """Whether converting ``old_heads`` -> ``new_heads`` K/V heads loses nothing (pure repetition)."""
    return new_heads % old_heads == 0


# ------------------------------------------------------------------------------------------------
# Model weights


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


#: Names under which architectures keep one fused Q/K/V projection (GPT-2's Conv1D c_attn, GPT-NeoX,
#: Falcon, Phi-3, MPT, Baichuan, OLMo): their K/V heads are rows of a shared matrix.
FUSED_QKV_NAMES = ("c_attn", "query_key_value", "qkv_proj", "Wqkv", "W_pack", "att_proj", "qkv")


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every attention module with per-head K/V projections and grouped K/V heads; SettingsError with
    the real reason for a model that has none (fused QKV, a latent cache, MHA-only attention)."""
    modules = [m for m in model.modules()
               if isinstance(getattr(m, "k_proj", None), nn.Linear) and isinstance(getattr(m, "v_proj", None), nn.Linear)
               and hasattr(m, "num_key_value_groups")]
    if modules:
        return modules
    name = type(model).__name__
    for module in model.modules():
        fused = next((n for n in FUSED_QKV_NAMES if isinstance(getattr(module, n, None), nn.Module)), None)
        if fused:
            raise SettingsError(f"{name} computes Q, K and V in one fused projection ({fused}); changing its K/V "
                                "heads needs separate k_proj/v_proj layers")
        if hasattr(module, "kv_a_proj_with_mqa") or hasattr(module, "kv_b_proj"):
            raise SettingsError(f"{name} caches a compressed latent (MLA), not K/V heads: there are no heads to regroup")
        if isinstance(getattr(module, "k_proj", None), nn.Linear):
            raise SettingsError(f"{name}'s attention has no grouped K/V heads (no num_key_value_groups): it computes "
                                "one K/V head per query head and cannot share them")
    raise SettingsError(f"{name} has no k_proj/v_proj attention layers whose K/V heads can be converted")


def _head_dim(attn: nn.Module, config) -> int:
    head_dim = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


def kv_heads_of(model: nn.Module) -> int:
    """The number of K/V heads the model's attention layers compute now (read off ``k_proj``)."""
    config = _text_config(model)
    counts = {attn.k_proj.out_features // _head_dim(attn, config) for attn in _attention_modules(model)}
    if len(counts) != 1:
        raise SettingsError(f"{type(model).__name__}'s attention layers compute different numbers of K/V heads "
                            f"({' and '.join(map(str, sorted(counts)))}): one head count for every layer would change "
                            "the model, not regroup its heads")
    return counts.pop()


def check_kv_projections(model: nn.Module, kv_layers: int, hidden_size: int) -> None:
    """Refuse (SettingsError) a K/V head change whose weights the prediction cannot follow.

    The prediction (``kvscope.core.model.attention.with_kv_heads``) counts, per K/V head added or removed, one ``hidden_size``-wide
    row of ``k_proj`` and of ``v_proj`` (``head_dim`` outputs each) in each of the ``kv_layers`` layers that cache
    K/V. That holds when each such layer owns its projections and they read the hidden state; it does not when
    projections serve several cache layers (one attention block shared by a hybrid's layers, Zamba; layers run in
    cycles, HRM) or read something wider (Zamba 2's shared block reads the hidden state and the embeddings)."""
    modules = _attention_modules(model)
    name = type(model).__name__
    projections = {id(attn.k_proj.weight) for attn in modules}
    if len(projections) != kv_layers:
        raise SettingsError(f"{name}'s {kv_layers} layers that cache K/V share {len(projections)} K/V projection(s) "
                            "(one attention block reused by several layers, or layers run more than once): a head "
                            "change there cannot be predicted layer by layer")
    config = _text_config(model)
    for attn in modules:
        width = {attn.k_proj.in_features, attn.v_proj.in_features}
        if width != {hidden_size}:
            raise SettingsError(f"{name}'s K/V projections read {' and '.join(map(str, sorted(width)))} features, not "
                                f"its hidden size ({hidden_size}): a head change there cannot be predicted from the "
                                "hidden size")
        head_dim = _head_dim(attn, config)
        if attn.v_proj.out_features != attn.k_proj.out_features or attn.k_proj.out_features % head_dim:
            raise SettingsError(f"{name}'s keys and values are of different widths ({attn.k_proj.out_features} and "
                                f"{attn.v_proj.out_features} per token): its heads cannot be regrouped as "
                                f"{head_dim}-wide K/V heads")


def _own_storage(attn: nn.Module) -> None:
    """Give every other parameter of ``attn`` that is a view of the same tensor as its K/V projections a tensor of its
    own. transformers loads some checkpoints' fused q/k/v weight as three views of one tensor (Sarvam-MoE): once
    k_proj and v_proj are replaced, q_proj alone would keep the whole fused tensor alive (its K/V rows included)."""
    fused = {p.untyped_storage().data_ptr() for proj in (attn.k_proj, attn.v_proj) for p in proj.parameters()
             if p.device.type != "meta"}
    for full_name, param in list(attn.named_parameters()):
        owner_name, _, leaf = full_name.rpartition(".")
        owner = attn.get_submodule(owner_name) if owner_name else attn
        if owner in (attn.k_proj, attn.v_proj) or param.device.type == "meta":
            continue
        if param.untyped_storage().data_ptr() in fused:
            setattr(owner, leaf, nn.Parameter(param.detach().clone(), requires_grad=False))


def _regroup_linear(proj: nn.Linear, old_heads: int, new_heads: int, head_dim: int) -> None:
    """Regroup the output rows of a K or V projection, head by head, in place."""
    weight = proj.weight.detach()
    new_weight = regroup_heads(weight.reshape(old_heads, head_dim, weight.shape[-1]), old_heads, new_heads, 0)
    # Inference only: the new parameters do not require grad (an inference-mode tensor cannot).
    proj.weight = nn.Parameter(new_weight.reshape(new_heads * head_dim, weight.shape[-1]), requires_grad=False)
    if proj.bias is not None:
        bias = proj.bias.detach()
        new_bias = regroup_heads(bias.reshape(old_heads, head_dim), old_heads, new_heads, 0)
        proj.bias = nn.Parameter(new_bias.reshape(new_heads * head_dim), requires_grad=False)
    proj.out_features = new_heads * head_dim


class KVOrigin:
    """A model's own K/V projections as loaded, kept aside by reference (no copy): per attention module, in
    ``model.modules()`` order, its k_proj and v_proj weight and bias Parameters, and the heads they compute.

    Conversions assign new Parameters and never write into these, so they stay the loaded bytes for the whole
    run, through any switch, a refused one included (the switch transaction restores the modules' tables; these
    tensors are not in them once replaced, and nothing touches them). A structural copy of the model (a
    re-run's shadow) has its attention modules in the same order and shares these very tensors."""

    __slots__ = ("heads", "head_dims", "layers", "queries")

    def __init__(self, heads: int, head_dims: tuple[int, ...],
                 layers: tuple[tuple[nn.Parameter, nn.Parameter | None, nn.Parameter, nn.Parameter | None], ...],
                 queries: tuple[tuple[nn.Parameter | None, nn.Parameter | None, nn.Parameter | None], ...] = ()) -> None:
        self.heads = heads
        self.head_dims = head_dims
        self.layers = layers
        #: Per attention module, its q_proj weight and bias and its o_proj weight as loaded (None where it has no such
        #: Linear): the aligned merge (``merge.set_merged``) folds its maps into them, and a head change puts them back.
        self.queries = queries or tuple((None, None, None) for _ in layers)

    def is_loaded(self, model: nn.Module) -> bool:
        """Whether every K/V projection of ``model`` is the loaded tensor itself (not a copy, not a regrouping)."""
        modules = _attention_modules(model)
        return len(modules) == len(self.layers) and all(
            attn.k_proj.weight is kw and attn.k_proj.bias is kb and attn.v_proj.weight is vw and attn.v_proj.bias is vb
            for attn, (kw, kb, vw, vb) in zip(modules, self.layers)) and all(
            (qw is None or attn.q_proj.weight is qw) and (qb is None or attn.q_proj.bias is qb)
            and (ow is None or attn.o_proj.weight is ow) for attn, (qw, qb, ow) in zip(modules, self.queries))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer if t is not None)


def keep_kv_projections(model: nn.Module) -> KVOrigin | None:
    """The model's own K/V projections, by reference, for ``set_kv_heads(..., origin=)``; None for a model
    whose K/V heads cannot be regrouped (fused QKV, a latent cache, layers of different head counts)."""
    try:
        heads = kv_heads_of(model)
        modules = _attention_modules(model)
    except SettingsError:
        return None
    config = _text_config(model)

    def linear(attn, name):
        proj = getattr(attn, name, None)
        return proj if isinstance(proj, nn.Linear) else None

    def queries(attn):
        q, o = linear(attn, "q_proj"), linear(attn, "o_proj")
        return (_kept(attn, q.weight) if q is not None else None, _kept(attn, q.bias) if q is not None else None,
                _kept(attn, o.weight) if o is not None else None)

    return KVOrigin(heads, tuple(_head_dim(attn, config) for attn in modules),
                    tuple(tuple(_kept(attn, t) for t in (attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight,
                                                         attn.v_proj.bias)) for attn in modules),
                    tuple(queries(attn) for attn in modules))


def _kept(attn: nn.Module, tensor: nn.Parameter | None) -> nn.Parameter | None:
    """``tensor`` itself, unless it is a view of one storage with other parameters of ``attn`` (a fused q/k/v weight
    loaded as three views, Sarvam-MoE): then a copy of its own bytes, so that once a switch gives q_proj a tensor of
    its own (``_own_storage``), keeping the K/V rows aside does not keep the whole fused tensor alive."""
    if tensor is None or tensor.device.type == "meta":
        return tensor
    mine = tensor.untyped_storage().data_ptr()
    shared = any(p is not tensor and p.device.type != "meta" and p.untyped_storage().data_ptr() == mine
                 for p in attn.parameters())
    return nn.Parameter(tensor.detach().clone(), requires_grad=False) if shared else tensor


def _regrouped(weight: nn.Parameter, bias: nn.Parameter | None, old: int, new: int, head_dim: int
               ) -> tuple[nn.Parameter, nn.Parameter | None]:
    w = weight.detach()
    new_w = regroup_heads(w.reshape(old, head_dim, w.shape[-1]), old, new, 0).reshape(new * head_dim, w.shape[-1])
    new_b = None
    if bias is not None:
        new_b = nn.Parameter(regroup_heads(bias.detach().reshape(old, head_dim), old, new, 0).reshape(new * head_dim),
                             requires_grad=False)
    return nn.Parameter(new_w, requires_grad=False), new_b


def _set_from_origin(attn: nn.Module, own: tuple, heads: int, kv_heads: int, head_dim: int,
                     queries: tuple = (None, None, None)) -> None:
    """``attn``'s k_proj/v_proj as ``kv_heads`` heads regrouped from its own (``own``); the tensors themselves
    when ``kv_heads`` is the model's own count."""
    kw, kb, vw, vb = own
    if kv_heads == heads:
        pairs = ((attn.k_proj, kw, kb), (attn.v_proj, vw, vb))
    else:
        pairs = ((attn.k_proj, *_regrouped(kw, kb, heads, kv_heads, head_dim)),
                 (attn.v_proj, *_regrouped(vw, vb, heads, kv_heads, head_dim)))
    for proj, weight, bias in pairs:
        proj.weight = weight
        if bias is not None:
            proj.bias = bias
        proj.out_features = kv_heads * head_dim
    _queries_from_origin(attn, queries)


def _queries_from_origin(attn: nn.Module, queries: tuple) -> None:
    """``attn``'s q_proj and o_proj as loaded (an aligned merge had folded its maps into them)."""
    qw, qb, ow = queries
    if qw is not None and attn.q_proj.weight is not qw:
        attn.q_proj.weight = qw
    if qb is not None and attn.q_proj.bias is not qb:
        attn.q_proj.bias = qb
    if ow is not None and attn.o_proj.weight is not ow:
        attn.o_proj.weight = ow


def set_kv_heads(model: nn.Module, kv_heads: int, origin: KVOrigin | None = None) -> bool:
    """Convert every decoder layer's k_proj/v_proj, in place, to ``kv_heads`` K/V heads.

    Repeats heads going up (exact), mean-pools groups going down (approximate), and goes through
    the lcm of the two counts otherwise. Updates ``config.num_key_value_heads`` and each attention
    module's ``num_key_value_groups`` (and ``num_key_value_heads`` where a module keeps one) so the
    next forward pass is consistent. Raises SettingsError when ``kv_heads`` does not divide the
    query heads, or the model has no per-head K/V projections.

    ``origin`` (``keep_kv_projections`` of this model as loaded): regroup from the model's own projections,
    whatever the model computes now, and put those very tensors back when ``kv_heads`` is their count. Without
    it, the projections the model has now are regrouped (a pooled model stays pooled: repeating its heads again
    does not bring the original heads back).

    Returns True when the result is exact: the same numbers as the model's own heads (``origin``), or as the
    heads it had before (without), i.e. every layer only repeated heads.
    """
    config = _text_config(model)
    q_heads = int(config.num_attention_heads)
    if not isinstance(kv_heads, int) or kv_heads <= 0 or q_heads % kv_heads:
        choices = ", ".join(str(n) for n in range(1, q_heads + 1) if q_heads % n == 0)
        raise SettingsError(f"{kv_heads} KV heads do not divide the {q_heads} query heads; choose one of {choices}")
    modules = _attention_modules(model)
    if origin is not None and len(origin.layers) != len(modules):
        raise SettingsError(f"the K/V projections kept aside are of {len(origin.layers)} attention layers, the model "
                            f"has {len(modules)}")
    exact = True
    with torch.no_grad():
        for i, attn in enumerate(modules):
            head_dim = _head_dim(attn, config)
            old = attn.k_proj.out_features // head_dim
            if origin is not None:
                exact = exact and _is_exact(origin.heads, kv_heads)
                _own_storage(attn)
                _set_from_origin(attn, origin.layers[i], origin.heads, kv_heads, origin.head_dims[i], origin.queries[i])
            elif old != kv_heads:
                exact = exact and _is_exact(old, kv_heads)
                _own_storage(attn)
                _regroup_linear(attn.k_proj, old, kv_heads, head_dim)
                _regroup_linear(attn.v_proj, old, kv_heads, head_dim)
    set_head_counts(model, modules, kv_heads)
    return exact


def set_head_counts(model: nn.Module, modules: list[nn.Module], kv_heads: int) -> None:
    """Every attention module's (and the config's) K/V head count and query groups, after its projections changed."""
    config = _text_config(model)
    q_heads = int(config.num_attention_heads)
    for attn in modules:
        attn.num_key_value_groups = q_heads // kv_heads
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = kv_heads
    config.num_key_value_heads = kv_heads
    if model.config is not config:
        model.config.num_key_value_heads = kv_heads


# ------------------------------------------------------------------------------------------------
# Live cache: KV heads


def _mark_static(t: torch.Tensor) -> None:
    """Give a replaced static buffer the fixed-address tag StaticLayer.lazy_initialization gives its own."""
    try:
        torch._dynamo.mark_static_address(t)
    except Exception:  # marking is an optimisation for torch.compile; a plain run does not need it
        pass


def cache_heads(cache: Cache) -> int | None:
    """K/V heads held by the cache's first initialized attention layer (None when nothing is cached)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            if isinstance(layer, BaseQuantizedLayer):
                return int(_layer_kv(layer)[0].shape[1])
            return int(layer.keys.shape[1])
    return None


def _layer_heads(layer) -> int:
    """The K/V heads one initialized cache layer holds."""
    return int(_layer_kv(layer)[0].shape[1] if isinstance(layer, BaseQuantizedLayer) else layer.keys.shape[1])


def _convert_layer_heads(layer, old: int, new: int, where: str) -> None:
    def go(t: torch.Tensor) -> torch.Tensor:
        return regroup_heads(t, old, new, 1)

    _convert_layer_with(layer, go, go, new, where)


def _convert_layer_with(layer, keys_fn, values_fn, new: int, where: str) -> None:
    """One cache layer's K/V, [b, heads, tokens, d], through ``keys_fn`` / ``values_fn`` (to ``new`` heads), in the
    layer's own form: quanto/hqq and fp8 codes dequantized, mapped and quantized again; static buffers replaced by
    buffers of the same slots."""
    if isinstance(layer, QuantizedLayer):
        # quanto/hqq groups do not follow heads, so the integer codes cannot be regrouped as they
        # are: dequantize, regroup, requantize (lossy even going up: the groups change).
        keys, values = layer._apply_pending_reorder(layer._dequantize(layer._quantized_keys),
                                                    layer._dequantize(layer._quantized_values))
        layer._pending_beam_idx = None
        layer._quantized_keys = layer._quantize(keys_fn(keys).contiguous(), axis=layer.axis_key)
        layer._quantized_values = layer._quantize(values_fn(values).contiguous(), axis=layer.axis_value)
        if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.numel():
            layer.keys, layer.values = keys_fn(layer.keys), values_fn(layer.values)
    elif isinstance(layer, Fp8QuantizedLayer):
        # One scale per tensor, recalibrated on the regrouped amax: repetition keeps the amax, so
        # the scale and every fp8 code come out the same going up.
        keys = layer._dequantize(layer._quantized_keys)
        values = layer._dequantize(layer._quantized_values)
        layer._quantized_keys = layer._quantize(keys_fn(keys))
        layer._quantized_values = layer._quantize(values_fn(values))
    elif isinstance(layer, StaticLayer):
        # Keep the preallocated semantics: a new [b, new, max_cache_len, d] buffer, same slots filled.
        layer.keys, layer.values = keys_fn(layer.keys), values_fn(layer.values)
        layer.num_heads = new
        _mark_static(layer.keys)
        _mark_static(layer.values)
    elif isinstance(layer, DynamicLayer):
        layer.keys, layer.values = keys_fn(layer.keys), values_fn(layer.values)
    else:
        raise SettingsError(f"{where}: a {type(layer).__name__} cache layer has no K/V heads to convert")


def convert_cache_kv_heads(cache: Cache, old_kv_heads: int, new_kv_heads: int) -> bool:
    """Convert a live cache, in place, from ``old_kv_heads`` to ``new_kv_heads`` K/V heads per layer.

    Same rule as ``set_kv_heads``: repeat up (exact), mean-pool down (approximate). Works for
    DynamicCache (full and sliding-window layers), StaticCache (a new ``[b, new, max_cache_len, d]``
    buffer per layer, same slots filled) and QuantizedCache: quanto/hqq layers are dequantized,
    regrouped and requantized (approximate even going up, as the quantization groups change);
    fp8 layers likewise, and going up is exact there (same per-tensor scale). The token count
    (``get_seq_length``) is unchanged. Returns True when the conversion was exact.
    """
    if old_kv_heads == new_kv_heads:
        return True
    exact = _is_exact(old_kv_heads, new_kv_heads)
    for i, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False):
            continue  # nothing cached yet; the layer will be created at the new width
        held = _layer_heads(layer)
        if held != old_kv_heads:
            raise SettingsError(f"cache layer {i} holds {held} K/V heads, not {old_kv_heads}")
        if isinstance(layer, BaseQuantizedLayer):
            exact = exact and isinstance(layer, Fp8QuantizedLayer)
        _convert_layer_heads(layer, old_kv_heads, new_kv_heads, f"cache layer {i}")
    return exact


# ------------------------------------------------------------------------------------------------
# Live cache: strategy switch (dynamic <-> static <-> quantized)


class DynamicTruncatedLayer(DynamicLayer):
    """A full-attention dynamic layer that no longer holds its oldest ``dropped_tokens`` tokens.

    Left behind when a sliding-window cache goes back to full attention: the evicted tokens are
    gone. It reports the true token count (so RoPE positions continue where they were) and tells
    the mask that the keys it holds start at position ``dropped_tokens``.
    """

    def __init__(self, dropped_tokens: int, **kwargs):
        super().__init__(**kwargs)
        self.dropped_tokens = int(dropped_tokens)

    def get_seq_length(self) -> int:
        return super().get_seq_length() + self.dropped_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return super().get_seq_length() + query_length, self.dropped_tokens


def _layer_kv(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V one layer holds, [b, h, tokens_held, d], dequantized; static buffers cut to the filled part."""
    if isinstance(layer, QuantizedLayer):
        keys, values = layer._apply_pending_reorder(layer._dequantize(layer._quantized_keys),
                                                    layer._dequantize(layer._quantized_values))
        if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.numel():
            keys = torch.cat([keys, layer.keys], dim=-2)
            values = torch.cat([values, layer.values], dim=-2)
        return keys, values
    if isinstance(layer, Fp8QuantizedLayer):
        return layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
    if isinstance(layer, StaticSlidingWindowLayer):
        # The buffer is in time order: slots [0, n) until full, then the last max_cache_len tokens,
        # of which slot 0 rolls out before the next query could see it (and may be a placeholder
        # after _fill_static_sliding), so a full window gives its last W - 1, like a dynamic one.
        n, slots = layer.cumulative_length_int, layer.max_cache_len
        if n < slots:
            return layer.keys[:, :, :n], layer.values[:, :, :n]
        return layer.keys[:, :, 1:], layer.values[:, :, 1:]
    if isinstance(layer, StaticLayer):
        held = int(layer.cumulative_length)
        return layer.keys[:, :, :held], layer.values[:, :, :held]
    if callable(getattr(layer, "dense_kv", None)):  # kvscope.core.runtimes.transformers.latent.LatentLayer: reconstructed
        return layer.dense_kv()
    if isinstance(layer, DynamicLayer):
        return layer.keys, layer.values
    raise SettingsError(f"a {type(layer).__name__} cache layer holds no plain K/V to read")


def dense_kv(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the valid K and V the cache holds, each ``[batch, heads, tokens_held, head_dim]``.

    Quantized layers are dequantized (their residual tokens appended); static layers give only the
    filled slots; sliding-window layers give the tokens the next query can still see (at most
    W - 1, which may be fewer than ``cache.get_seq_length()``). Tensors may be views of the cache's storage; ``refill_cache``
    copies them. Raises SettingsError when a layer holds nothing yet.
    """
    out = []
    for i, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False):
            raise SettingsError(f"cache layer {i} is empty: run the prompt before switching the cache")
        out.append(_layer_kv(layer))
    if not out:
        raise SettingsError("the cache is empty: run the prompt before switching the cache")
    return out


def _fill_static_sliding(layer: StaticSlidingWindowLayer, keys: torch.Tensor, values: torch.Tensor,
                         seq_length: int, where: str) -> None:
    """Write a static sliding layer as if it had seen ``seq_length`` tokens, the last of them ``keys``."""
    slots = layer.max_cache_len
    held = keys.shape[-2]
    if seq_length < slots:
        if held != seq_length:
            raise SettingsError(f"{where}: holds {held} of {seq_length} tokens; a {slots}-slot window needs all of them")
        take, start = held, 0
    else:
        # Once full, slot 0 is the token about to roll out, never attended to again: the last
        # slots - 1 tokens are all the next query needs (a dynamic window layer keeps exactly those).
        if held < slots - 1:
            raise SettingsError(f"{where}: holds only the last {held} tokens; a window of {slots} needs {slots - 1}")
        take = min(held, slots)
        start = slots - take
    layer.lazy_initialization(keys[:, :, :0], values[:, :, :0])
    layer.keys[:, :, start:start + take].copy_(keys[:, :, held - take:])
    layer.values[:, :, start:start + take].copy_(values[:, :, held - take:])
    layer.cumulative_length_int = int(seq_length)
    layer.cumulative_length.fill_(min(seq_length, slots))


def refill_cache(new_cache: Cache, kv: list[tuple[torch.Tensor, torch.Tensor]], seq_length: int | None = None) -> None:
    """Push per-layer K/V (from ``dense_kv``) into a fresh cache, one update per layer.

    ``seq_length`` is how many tokens the sequence has seen (default: the most any layer holds);
    pass ``old_cache.get_seq_length()`` when the source had sliding-window layers, which hold
    fewer. A quantized target quantizes everything on this one update (QuantizedLayer.update), so
    its residual starts empty. A full-attention dynamic layer given fewer tokens than
    ``seq_length`` becomes a ``DynamicTruncatedLayer`` (the earlier tokens are gone); a static or
    quantized full layer cannot, and raises SettingsError, as does a static cache too short.
    After the call ``new_cache.get_seq_length() == seq_length``.
    """
    if not kv:
        raise SettingsError("nothing to refill: the source cache is empty")
    held_max = max(k.shape[-2] for k, _ in kv)
    seq_length = held_max if seq_length is None else int(seq_length)
    if getattr(new_cache, "layer_class_to_replicate", None) is None and len(new_cache.layers) != len(kv):
        raise SettingsError(f"the new cache has {len(new_cache.layers)} layers, the K/V given {len(kv)}")
    for i, (keys, values) in enumerate(kv):
        where = f"cache layer {i}"
        held = keys.shape[-2]
        if held > seq_length:
            raise SettingsError(f"{where}: holds {held} tokens, more than the {seq_length} seen")
        if getattr(new_cache, "layer_class_to_replicate", None) is not None:
            while len(new_cache.layers) <= i:
                new_cache.layers.append(new_cache.layer_class_to_replicate())
        layer = new_cache.layers[i]
        if getattr(layer, "is_initialized", False):
            raise SettingsError(f"{where} of the new cache already holds tokens; refill a fresh cache")
        if isinstance(layer, StaticSlidingWindowLayer):
            _fill_static_sliding(layer, keys, values, seq_length, where)
            continue
        if isinstance(layer, StaticLayer) and seq_length > layer.max_cache_len:
            raise SettingsError(f"a static cache of {layer.max_cache_len} tokens cannot hold the {seq_length} so far; "
                                "choose a larger max context")
        if held < seq_length:
            if isinstance(layer, DynamicSlidingWindowLayer):
                needed = min(seq_length, layer.sliding_window - 1)
                if held < needed:
                    raise SettingsError(f"{where}: holds only the last {held} tokens; a window of "
                                        f"{layer.sliding_window} needs {needed}")
                layer.update(keys, values)
                layer.cumulative_length = seq_length
                continue
            if type(layer) is DynamicLayer:
                layer = DynamicTruncatedLayer(dropped_tokens=seq_length - held)
                new_cache.layers[i] = layer
            elif not isinstance(layer, DynamicTruncatedLayer):
                raise SettingsError(f"{where}: only the last {held} of {seq_length} tokens are still held; "
                                    f"a {type(layer).__name__} needs all of them")
        layer.update(keys.contiguous(), values.contiguous())


def convert_cache(old_cache: Cache, new_cache: Cache) -> None:
    """Move everything ``old_cache`` holds into the fresh ``new_cache`` (``dense_kv`` + ``refill_cache``)."""
    refill_cache(new_cache, dense_kv(old_cache), seq_length=int(old_cache.get_seq_length()))


# ------------------------------------------------------------------------------------------------
# Sliding window


def _check_window(window: int | None) -> None:
    # transformers' window layers keep the last W - 1 tokens; W = 1 would keep everything
    # (the slice ``[-0:]``), so the smallest window that works is 2.
    if window is not None and (not isinstance(window, int) or window < 2):
        raise SettingsError(f"a sliding window must be a whole number of at least 2 tokens, not {window!r}")


def _mistral_twin(model: nn.Module, window: int | None) -> nn.Module:
    """A MistralForCausalLM built around the very modules of a Llama model (no weight copy)."""
    from transformers import MistralConfig, MistralForCausalLM

    src = model.config
    fields = {k: v for k, v in src.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", "sliding_window", "layer_types")}
    config = MistralConfig(**fields)
    config.sliding_window = window
    config.architectures = ["MistralForCausalLM"]
    config.num_key_value_heads = src.num_key_value_heads
    config.head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    # Same attention kernel as the model it stands in for.
    config._attn_implementation = src._attn_implementation
    with torch.device("meta"):
        twin = MistralForCausalLM(config)
    base, twin_base = model.model, twin.model
    # Share modules, not copies: a later set_kv_heads on the twin reaches the same Linear objects,
    # and the rotary module keeps the Llama's exact rope (including llama3/yarn scaling).
    twin_base.embed_tokens = base.embed_tokens
    twin_base.norm = base.norm
    twin_base.rotary_emb = base.rotary_emb
    twin.lm_head = model.lm_head
    for mine, theirs in zip(twin_base.layers, base.layers, strict=True):
        mine.input_layernorm = theirs.input_layernorm
        mine.post_attention_layernorm = theirs.post_attention_layernorm
        mine.mlp = theirs.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(mine.self_attn, name, getattr(theirs.self_attn, name))
        for name in ("head_dim", "num_key_value_groups", "scaling", "is_causal"):
            setattr(mine.self_attn, name, getattr(theirs.self_attn, name))
    left = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if left:
        raise SettingsError(f"cannot build a sliding-window twin of this model: {', '.join(left[:3])} has no counterpart")
    twin.generation_config = model.generation_config
    twin.train(model.training)
    return twin


def _set_layer_windows(model: nn.Module, window: int | None) -> None:
    """Qwen2/Qwen3-style models: each attention module and the config carry the window per layer."""
    config = model.config
    n = config.num_hidden_layers
    config.sliding_window = window
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = window is not None
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = 0 if window is not None else n
    config.layer_types = [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * n
    for module in model.modules():
        if hasattr(module, "layer_type") and hasattr(module, "sliding_window") and hasattr(module, "k_proj"):
            module.layer_type = config.layer_types[module.layer_idx]
            module.sliding_window = window
        if hasattr(module, "has_sliding_layers"):
            module.has_sliding_layers = window is not None


def with_window(model: nn.Module, window: int | None) -> nn.Module:
    """A model computing sliding-window attention with window ``window`` (None: full attention).

    HF semantics: a query at position p sees keys at positions p - W + 1 .. p (W tokens with
    itself); the dynamic cache keeps W - 1. Every layer becomes sliding, as ``kvscope.core.model.attention.Window``
    predicts. Mistral: sets ``config.sliding_window`` (read at each forward) and returns the same
    model. Qwen2/Qwen3: sets the config and each layer's window in place, returns the same model.
    Llama: returns a MistralForCausalLM sharing the Llama's modules (no weight copy; use only the
    returned model from then on). Other architectures raise SettingsError.
    """
    _check_window(window)
    model_type = getattr(model.config, "model_type", "")
    if model_type == "mistral":
        model.config.sliding_window = window
        return model
    if hasattr(model.config, "layer_types") and any(
            hasattr(m, "sliding_window") and hasattr(m, "layer_type") for m in model.modules()):
        _set_layer_windows(model, window)
        return model
    if model_type == "llama":
        if window is None:
            return model
        return _mistral_twin(model, window)
    raise SettingsError(f"a sliding window is not available for {model_type or type(model).__name__} models here "
                        "(Llama, Mistral and Qwen2/Qwen3 are)")


_PATTERN_CONFIG_FIELDS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
_PATTERN_MODULE_FIELDS = ("layer_type", "sliding_window", "is_sliding", "attention_type", "has_sliding_layers")


def layer_pattern(model: nn.Module) -> dict:
    """Which layers slide and by how much, as the model holds it now (config fields and the attributes
    attention modules copy from it): what ``restore_layer_pattern`` puts back."""
    config = _text_config(model)
    fields = {k: copy.deepcopy(getattr(config, k)) for k in _PATTERN_CONFIG_FIELDS if hasattr(config, k)}
    modules = {}
    for name, module in model.named_modules():
        saved = {k: getattr(module, k) for k in _PATTERN_MODULE_FIELDS if k in vars(module)}
        if saved:
            modules[name] = saved
    return {"config": fields, "modules": modules}


def restore_layer_pattern(model: nn.Module, pattern: dict) -> None:
    """Put back a pattern taken with ``layer_pattern`` (a model's own sliding/full layers)."""
    config = _text_config(model)
    for key, value in pattern["config"].items():
        setattr(config, key, copy.deepcopy(value))
        if model.config is not config and hasattr(model.config, key):
            setattr(model.config, key, copy.deepcopy(value))
    named = dict(model.named_modules())
    for name, saved in pattern["modules"].items():
        for key, value in saved.items():
            setattr(named[name], key, value)


def convert_cache_window(cache: Cache, window: int | None, config) -> int:
    """Turn a live DynamicCache's layers into sliding-window layers of ``window`` (or back to full), in place.

    ``config`` is the config of the model that will run next (from ``with_window``): its sliding
    layers get a ``DynamicSlidingWindowLayer`` holding the last W - 1 tokens with
    ``cumulative_length`` = tokens seen; its full layers become full layers. Going from a window
    back to full attention keeps only the tokens still held: such a layer becomes a
    ``DynamicTruncatedLayer`` and the earlier tokens are gone for good.

    Exactness: after the switch the next logits equal those of a model that ran with window W from
    the start iff the sequence so far has at most W tokens (until then no query reached further
    back than W, so both models cached the same K/V).

    Returns the number of earlier tokens no longer held by some full-attention layer (0 if none).
    Raises SettingsError for a non-dynamic cache (switch those with ``dense_kv``/``refill_cache``
    into a cache built from the new config) or a window larger than what is still held.
    """
    _check_window(window)
    if type(cache) is not DynamicCache:
        raise SettingsError(f"a live window switch converts a dynamic cache, not a {type(cache).__name__}; "
                            "rebuild it from the new model's config with dense_kv and refill_cache")
    if window is None:
        types = [FULL_ATTENTION] * len(cache.layers)
    else:
        types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        types = [SLIDING_ATTENTION if t in (SLIDING_ATTENTION, "chunked_attention") else FULL_ATTENTION for t in types]
        if SLIDING_ATTENTION not in types:
            raise SettingsError("the model config has no sliding layers: call with_window(model, W) first")
        if len(types) != len(cache.layers):
            raise SettingsError(f"the config has {len(types)} layers, the cache {len(cache.layers)}")
    dropped = 0
    for i, (layer, kind) in enumerate(zip(cache.layers, types)):
        if not getattr(layer, "is_initialized", False):
            raise SettingsError(f"cache layer {i} is empty: run the prompt before switching the window")
        if not isinstance(layer, DynamicLayer) or isinstance(layer, BaseQuantizedLayer):
            raise SettingsError(f"cache layer {i} is a {type(layer).__name__}, not a dynamic layer")
        seen = int(layer.get_seq_length())
        keys, values = layer.keys, layer.values
        held = keys.shape[-2]
        if kind == SLIDING_ATTENTION:
            needed = min(seen, window - 1)
            if held < needed:
                raise SettingsError(f"cache layer {i} holds only the last {held} tokens; a window of {window} needs {needed}")
            new = DynamicSlidingWindowLayer(sliding_window=window)
            new.update(keys[:, :, held - needed:], values[:, :, held - needed:])
            new.cumulative_length = seen
        elif held == seen:
            if type(layer) is DynamicLayer:
                continue
            new = DynamicLayer()
            new.update(keys, values)
        else:
            new = DynamicTruncatedLayer(dropped_tokens=seen - held)
            new.update(keys, values)
            dropped = max(dropped, seen - held)
        cache.layers[i] = new
    return dropped
