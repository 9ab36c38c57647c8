"""MLA as a latent of the running model: each full-attention layer caches a low-rank latent of its own K and V.

Key 4 / ``attention=mla[:RANK]`` on a model that is not MLA (issue 34, item 3). No twin and no re-run: the model
stays the model as loaded, and its cache's full-attention layers become ``LatentLayer``\\s. At the switch each
layer takes the K/V it holds (``convert.dense_kv``), undoes the rotary positions on the keys (the model's own
``apply_rotary_pos_emb`` with the inverse rotation, on the rotated dims only: partial rotary leaves the rest as it
is), and fits an orthonormal basis of rank r over [K_pre, V] of all its K/V heads together (the PCA of the layer's
own cached keys and values: activation-aware, shared over the heads as MLA's latent is). It stores only the
coefficients per token, ``latent`` [batch, tokens, r], and the basis once per layer, ``basis`` [heads x (k + v), r]
(bookkeeping the predictor counts too: ``kvscope.core.model.caches.LayerKV.fixed``). Every update projects the new
tokens and returns the reconstruction, the keys rotated again at each cached token's position. At full rank the
basis is square and orthonormal: exact (to rounding); below it, the best rank-r fit of the tokens calibrated on.

A cache built fresh in MLA mode (a prefill, or a re-run) calibrates each layer on its first update. Sliding-window
layers, and any layer that is not a plain ``DynamicLayer``, stay as they are. Where the model passes no rotary
tables that KV Scope can rebuild (no ``rotary_emb`` on the model, or a ``apply_rotary_pos_emb`` that is not a
rotation), the keys are fitted as they are cached, rotated; ``Rope.how`` says which.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvscope.core.model.attention import SettingsError

#: Calibration uses at most this many tokens (the most recent) per layer: the switch stays fast at long contexts.
CALIBRATION_TOKENS = 1024


class Rope:
    """The model's rotary positions for one layer, as a plain object (the byte walker does not enter it: its
    tables are not the cache's). ``how`` says what the latent does with the keys' positions."""

    def __init__(self, rotary: nn.Module | None = None, apply: Any = None, layer_type: str | None = None,
                 how: str = "no rotary positions in the keys") -> None:
        self.rotary, self.apply, self.layer_type, self.how = rotary, apply, layer_type, how

    @property
    def active(self) -> bool:
        return self.rotary is not None and self.apply is not None

    def table(self, start: int, count: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, count, rot] of positions start..start+count-1, as the model computes them."""
        positions = torch.arange(start, start + count, device=like.device).unsqueeze(0)
        if self.layer_type is not None:
            return self.rotary(like, positions, self.layer_type)
        return self.rotary(like, positions)

    def _turn(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1]
        part = keys[..., :rot]
        turned = self.apply(part, part, cos, sin)[1]
        return turned if rot == keys.shape[-1] else torch.cat([turned, keys[..., rot:]], dim=-1)

    def rotate(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """``keys`` [b, h, n, d] (un-rotated) rotated at positions start.., as the model rotates them."""
        if not self.active:
            return keys
        cos, sin = self.table(start, keys.shape[-2], keys)
        return self._turn(keys, cos, sin)

    def unrotate(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """The inverse: ``x cos + J x sin`` scaled by s undone by ``(cos, -sin) / s^2`` (any attention scaling)."""
        if not self.active:
            return keys
        cos, sin = self.table(start, keys.shape[-2], keys)
        norm = cos * cos + sin * sin
        return self._turn(keys, cos / norm, -sin / norm)


def _attention_of(model: nn.Module) -> dict[int, nn.Module]:
    from kvscope.core.runtimes.transformers.convert import _attention_modules

    try:
        modules = _attention_modules(model)
    except SettingsError:  # fused q/k/v (GPT-NeoX, Phi-3): no heads to regroup, but attention modules all the same
        modules = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    return {int(getattr(m, "layer_idx", i)): m for i, m in enumerate(modules)}


def _rotary_module(model: nn.Module) -> nn.Module | None:
    """The model's one rotary embedding, computed once per forward pass and handed to every attention layer."""
    found = [m for name, m in model.named_modules() if name.endswith("rotary_emb") and ".layers." not in name]
    return found[0] if len(found) == 1 else None


def rope_of(model: nn.Module, layer_idx: int) -> Rope:
    """How layer ``layer_idx``'s cached keys carry their positions (see ``Rope``), checked on a random key: the
    model's rotation undone by ``unrotate`` must give the key back, else the keys are fitted as they are."""
    attn = _attention_of(model).get(layer_idx)
    module = sys.modules.get(type(attn).__module__) if attn is not None else None
    apply = getattr(module, "apply_rotary_pos_emb", None)
    rotary = _rotary_module(model)
    if apply is None and rotary is None:
        return Rope()
    if apply is None or rotary is None:
        return Rope(how="the keys are fitted rotated, as cached (no rotary tables KV Scope can rebuild)")
    params = list(inspect.signature(rotary.forward).parameters)
    layer_type = None
    if "layer_type" in params:
        types = getattr(getattr(model, "config", None), "layer_types", None) or []
        cfg = getattr(model.config, "get_text_config", lambda: model.config)()
        types = getattr(cfg, "layer_types", None) or types
        layer_type = types[layer_idx] if layer_idx < len(types) else "full_attention"
    rope = Rope(rotary, apply, layer_type, how="rotary positions undone before the fit and applied again on reading")
    try:
        with torch.inference_mode():
            dtype = next(model.parameters()).dtype
            device = next(model.parameters()).device
            head = int(getattr(attn, "head_dim", 0) or getattr(attn, "head_size", 0) or 0) or 64
            x = torch.randn(1, 1, 5, head, generator=torch.Generator().manual_seed(0)).to(device=device,
                                                                                              dtype=torch.float32)
            probe = x.to(dtype)
            back = rope.unrotate(rope.rotate(probe, 3), 3).float()
            moved = rope.rotate(probe, 3).float()
        if back.shape != x.shape or not torch.allclose(back, probe.float(), atol=1e-2, rtol=1e-2) or \
                torch.allclose(moved, probe.float()):
            raise ValueError("not a rotation")
    except Exception:  # noqa: BLE001 - a rotary of another shape or form: fit the keys as cached
        return Rope(how="the keys are fitted rotated, as cached (the model's rotary is not one KV Scope can undo)")
    return rope


#: Past the rank, the basis is fitted again on what the latent holds plus the new tokens each time the context has
#: grown by this factor (until ``LatentLayer.refit_until``): a stall of one fit per layer on the token path, a few times.
REFIT_GROWTH = 1.25

#: K and V fitted together (one basis over [K_pre, V], as MLA's one latent) or each with half the rank.
JOINT = True


def _top(x: torch.Tensor, rank: int) -> torch.Tensor:
    x = x.float()
    _, vectors = torch.linalg.eigh(x.T @ x)  # ascending; a complete orthonormal set even when x has few rows
    return vectors.flip(-1)[:, :rank]


def fit_basis(x: torch.Tensor, rank: int, k_width: int | None = None) -> torch.Tensor:
    """An orthonormal basis [D, rank] of the rows of ``x`` [N, D] (its last CALIBRATION_TOKENS): the top ``rank``
    principal directions (no centering: the mean is a direction like any other), completed to any rank up to D when
    N < D; at full rank the identity (exact, nothing to fit). ``k_width`` with ``JOINT`` off: K's first columns and
    V's last each get their own half of the rank (a block-diagonal basis, the same bytes)."""
    d = x.shape[-1]
    if rank >= d:
        return torch.eye(d, dtype=torch.float32, device=x.device)
    x = x[-CALIBRATION_TOKENS:]
    if JOINT or k_width is None:
        return _top(x, rank).contiguous()
    rk = rank // 2
    basis = torch.zeros(d, rank, dtype=torch.float32, device=x.device)
    basis[:k_width, :rk] = _top(x[:, :k_width], rk)
    basis[k_width:, rk:] = _top(x[:, k_width:], rank - rk)
    return basis


class LatentLayer(DynamicLayer):
    """A full-attention layer that caches ``latent`` [b, tokens, rank] and ``basis`` [heads x (k + v), rank] only.

    ``update`` takes the rotated keys and the values of the new tokens, stores their coefficients and returns the
    keys and values of every token so far, reconstructed (keys rotated at their positions)."""

    is_croppable = False

    def __init__(self, rank: int, rope: Rope, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rank = int(rank)
        self.rope = rope
        self.latent: torch.Tensor | None = None
        self.basis: torch.Tensor | None = None
        self.shape: tuple[int, int, int] | None = None  # heads, k, v
        self.fitted = 0  # tokens the basis was last fitted on
        self.used = 0  # basis columns in use (the rest zero while the latent still holds every token exactly)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys = self.values = None
        self.is_initialized = True

    def _flat(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> torch.Tensor:
        b, h, n, k = key_states.shape
        pre = self.rope.unrotate(key_states, start)
        return torch.cat([pre.transpose(1, 2).reshape(b, n, h * k),
                          value_states.transpose(1, 2).reshape(b, n, h * value_states.shape[-1])], dim=-1)

    def calibrate(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int = 0) -> None:
        """Fit the basis on these tokens (the layer's own K/V, positions from ``start``) and store their latent."""
        b, h, n, k = key_states.shape
        v = value_states.shape[-1]
        if self.rank > h * (k + v):
            raise SettingsError(f"a latent of rank {self.rank} is wider than the layer's own K/V ({h} heads x "
                                f"({k} + {v}) = {h * (k + v)} per token)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.shape = (h, k, v)
        self._start(self._flat(key_states, value_states, start))

    def _start(self, flat: torch.Tensor) -> None:
        if flat.shape[0] * flat.shape[1] >= self.rank or self.rank >= flat.shape[-1]:
            self._fit(flat)
            return
        # Fewer tokens than the rank: the basis spans exactly the tokens so far, its other columns zero, and grows
        # with each new token's own direction (``_extend``) until the rank is used: no token is lost meanwhile.
        self.basis = torch.zeros(flat.shape[-1], self.rank, dtype=flat.dtype, device=flat.device)
        self.latent = None
        self.used = 0
        self._extend(flat)
        self.latent = flat @ self.basis

    def _extend(self, flat: torch.Tensor) -> None:
        """Add the directions of ``flat``'s tokens that the basis does not span yet, as long as columns are free."""
        rows = flat.reshape(-1, flat.shape[-1]).double()
        used = self.basis[:, :self.used].double()
        residual = rows - (rows @ used) @ used.T
        residual = residual - (residual @ used) @ used.T  # twice: orthogonal to the working precision
        q, r = torch.linalg.qr(residual.T)  # [D, n]
        keep = r.diagonal().abs() > 1e-4 * rows.norm(dim=-1).clamp_min(1e-30)  # each token against its own size
        # A token that repeats an earlier one adds nothing; its Q column is noise, which the later columns were made
        # orthogonal to: the kept tokens are orthonormalized again on their own.
        new = torch.linalg.qr(residual[keep].T)[0][:, :self.rank - self.used] if bool(keep.any()) else q[:, :0]
        if new.shape[1]:
            basis = self.basis.clone()
            basis[:, self.used:self.used + new.shape[1]] = new.to(basis.dtype)
            self.basis = basis
            self.used += int(new.shape[1])
        self.fitted = self.get_seq_length() + int(flat.shape[1])

    def _fit(self, flat: torch.Tensor) -> None:
        """Fit the basis on ``flat`` [b, tokens, D] (every token so far) and store their coefficients."""
        h, k, _ = self.shape
        self.basis = fit_basis(flat.reshape(-1, flat.shape[-1]), self.rank, h * k).to(flat.dtype)
        self.latent = flat @ self.basis
        self.fitted = int(flat.shape[1])
        self.used = self.rank

    @property
    def width(self) -> int:
        """Elements of K and V per token this layer compressed (its full rank)."""
        h, k, v = self.shape
        return h * (k + v)

    def refit(self, rank: int) -> None:
        """A new rank (at most the current one: what the latent holds is all there is), fitted on what it holds."""
        flat = self.latent @ self.basis.T
        self.rank = int(rank)
        self._start(flat)

    @property
    def refit_until(self) -> int:
        """The basis is fitted again each time the context doubles, until it was fitted on this many tokens (the
        width of the layer's K/V, where the fit has seen every direction; at most CALIBRATION_TOKENS). Until the
        context passes the rank, the latent holds every token exactly, so a refit loses nothing."""
        h, k, v = self.shape
        width = h * (k + v)
        return 0 if self.rank >= width else min(width, CALIBRATION_TOKENS)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.basis is None:
            self.calibrate(key_states, value_states)
        else:
            start = self.get_seq_length()
            new = self._flat(key_states, value_states, start)
            if self.used < self.rank:
                self._extend(new)
                self.latent = torch.cat([self.latent, new @ self.basis], dim=1)
            elif self.fitted < self.refit_until and start + new.shape[1] >= REFIT_GROWTH * self.fitted:
                self._fit(torch.cat([self.latent @ self.basis.T, new], dim=1))
            else:
                self.latent = torch.cat([self.latent, new @ self.basis], dim=1)
        return self.dense_kv()

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of every token held, [b, heads, tokens, d], reconstructed from the latent."""
        h, k, v = self.shape
        flat = self.latent @ self.basis.T
        b, n, _ = flat.shape
        keys = flat[..., :h * k].reshape(b, n, h, k).transpose(1, 2)
        values = flat[..., h * k:].reshape(b, n, h, v).transpose(1, 2)
        return self.rope.rotate(keys, 0), values

    def get_seq_length(self) -> int:
        return 0 if getattr(self, "latent", None) is None else int(self.latent.shape[1])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        self.latent = self.basis = None
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a latent cache layer cannot be cropped")


def is_latent(cache: Any) -> bool:
    return any(isinstance(layer, LatentLayer) for layer in getattr(cache, "layers", None) or [])


def latent_rank(cache: Any) -> int | None:
    ranks = {layer.rank for layer in getattr(cache, "layers", None) or [] if isinstance(layer, LatentLayer)}
    return ranks.pop() if len(ranks) == 1 else None


def _ropes(model: nn.Module, layers: list[int]) -> dict[int, Rope]:
    return {i: rope_of(model, i) for i in layers}


def latent_cache(model: nn.Module, rank: int) -> DynamicCache:
    """A fresh cache for ``model`` whose full-attention layers are uncalibrated latent layers of ``rank`` (each fits
    its basis at its first update: the prefill, or a re-run)."""
    cache = DynamicCache(config=model.config)
    full = [i for i, layer in enumerate(cache.layers) if type(layer) is DynamicLayer]
    if not full:
        raise SettingsError("no full-attention layer caches plain K/V here: there is nothing to keep as a latent")
    ropes = _ropes(model, full)
    for i in full:
        cache.layers[i] = LatentLayer(rank, ropes[i])
    return cache


def convert_to_latent(cache: Any, model: nn.Module, rank: int) -> str:
    """The live cache's full-attention layers (plain ``DynamicLayer``) become latent layers of ``rank``, calibrated on
    the K/V each holds; the other layers stay as they are. In place (the switch transaction restores the list).
    Returns how the keys' positions were treated, for the event."""
    layers = cache.layers
    full = [i for i, layer in enumerate(layers) if type(layer) is DynamicLayer]
    if not full:
        raise SettingsError("no full-attention layer caches plain K/V here: there is nothing to keep as a latent")
    others = {type(layers[i]).__name__ for i in range(len(layers)) if i not in full}
    ropes = _ropes(model, full)
    for i in full:
        old = layers[i]
        if not old.is_initialized or old.keys is None or not old.keys.numel():
            raise SettingsError(f"cache layer {i} is empty: run the prompt before switching to MLA")
        layer = LatentLayer(rank, ropes[i])
        layer.calibrate(old.keys, old.values)
        layers[i] = layer
    hows = sorted({ropes[i].how for i in full})
    kept = f"; {len(layers) - len(full)} layers ({', '.join(sorted(others))}) kept as they are" if others else ""
    return "; ".join(hows) + kept
