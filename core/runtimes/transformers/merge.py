"""Fewer K/V heads that keep as much of the model as a training-free merge can: heads aligned, then merged.

GQA and MQA below the model's own head count replace each group of G K/V heads by one. Mean-pooling their
projections (Ainslie et al. 2023's initialisation, meant to be uptrained) adds heads that attend to different
things: on SmolLM2-135M (3 K/V heads) pooled to MQA, top-1 agreement with the loaded model falls to 6% and the text
to garbage. The ``aligned`` merge (the default; ``mqa:mean`` / ``gqa:N:mean`` keep the mean) follows the idea of
aligning heads before merging them (Jin et al. 2024, "Align attention heads before merging them: an effective way
for converting MHA to GQA"), solved in closed form and calibrated on the model's own K/V of the tokens so far:

- **Keys.** Rotary positions turn each pair of dims (a, b) of a key as one complex number z = k_a + i k_b times
  e^{i theta_t}. A map of one head's key that commutes with every position's rotation is, per pair, a complex
  scalar (a rotation and a scale). So per group and pair, the G heads' complex keys over the tokens, X [tokens, G],
  get their best rank-1 fit X ~ k' w^H (the top eigenvector w of X^H X): the merged key k' = X w, and head g's key
  is read back as k' conj(w_g). The conj(w_g) is folded into the query rows of every query head that read head g
  (q' = q w_g, a 2x2 map per pair), so q . k_g ~ q' . k'. Exact for heads that are copies of one head. Dims that
  rotary leaves alone (partial rotary) get the real version: the top ``dn`` principal directions of the group's
  un-rotated dims, mapped back per head into the query rows.
- **Values.** The G heads' values [tokens, G x d] are projected on their top ``d`` principal directions (the PCA,
  uncentered): v' = U^T [v_1..v_G]; head g's value is read back as U_g v' and U_g is folded into the output
  projection's columns of every query head that read head g.

K/V projections, query projections, output projections and the live cache all go through the same maps, so the
result is a plain GQA/MQA model (its cache the usual classes, its bytes those of G times fewer heads) that a
prefill of the same tokens would have cached at layer 0. The fit is calibrated on the cache when it holds the
model's own K/V (its Gram matrices are kept for later merges), else on the last such calibration; a prior of
``PRIOR_TOKENS`` tokens pulls the fit towards mean-pooling's solution (with no tokens at all, it is the mean).

Where the maps cannot be folded the merge refuses with its reason and the mean applies: a norm on the keys after
their projection (q_norm/k_norm: Qwen3, Gemma 3, OLMo 2), query or output projections that are not per-head
Linear layers, a rotary that is not pairs of dims. With a norm on K no cache can be pooled or merged in place
either (the normalized keys are no linear map of the input): the tokens so far re-run through the model with fewer
heads (``normalized_keys_rerun``), and a norm over all K/V heads at once refuses the head change
(``head_change_problem``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kvscope.core.model.attention import SettingsError

#: The merge methods, the default first.
METHODS = ("aligned", "mean")

#: Calibration reads at most this many of the most recent tokens per layer.
CALIBRATION_TOKENS = 1024

#: Mean-pooling's solution joins the tokens' Gram matrices as a prior worth this many tokens: a switch after a short
#: prompt stays close to the mean (its fit of hundreds of dims on a few tokens would not carry to the next ones).
PRIOR_TOKENS = 4

#: How each head's key error is weighted in the fit of a rotary pair: "none" (every head alike) or "queries" (by the
#: energy of the queries that read it on that pair, ``query_energy``: an error on a pair its queries weigh little
#: costs the attention little). Measured with benchmarks/merge_weighting.py (SmolLM2 to MQA, teacher-forced, KL nats
#: per token, unweighted -> the queries the prefix computed -> those the weights imply): 24+24 tokens 2.02 -> 2.06 /
#: 2.49, 64+64 1.70 -> 1.49 / 1.72, 96+96 2.57 -> 2.44 / 2.59; the embedded model 64+64 0.314 -> 0.322 / 0.314. Not
#: better everywhere, and the engine's calibration (the cache's K/V) holds no queries: "none" stays the default.
KEY_WEIGHTING = "none"

#: Names of a norm applied to queries or keys after their projection: the merge's maps cannot pass through it.
QK_NORMS = ("k_norm", "q_norm", "k_layernorm", "q_layernorm", "key_norm", "query_norm")


# ------------------------------------------------------------------------------------------------
# Which dims rotary turns together


@dataclass(frozen=True)
class Layout:
    """A head's dims as rotary treats them: ``a[i]``, ``b[i]`` the real and imaginary part of pair i, ``plain`` the
    dims no position turns."""

    a: torch.Tensor
    b: torch.Tensor
    plain: torch.Tensor

    @property
    def head_dim(self) -> int:
        return len(self.a) + len(self.b) + len(self.plain)


def _layout_from_rotation(m: torch.Tensor) -> Layout:
    """Pairs read off ``m`` [d, d], row i the rotated unit vector e_i at one position (a small positive angle per
    pair): e_a turns into (cos, +sin) on (a, b), e_b into (-sin, cos). Raises ValueError for anything else."""
    d = m.shape[0]
    off = m.clone()
    off.fill_diagonal_(0)
    moving = off != 0
    count = moving.sum(dim=1)
    if bool((count > 1).any()):
        raise ValueError(f"dim {int((count > 1).nonzero()[0])} turns with more than one dim")
    plain = (count == 0).nonzero().flatten()
    if not torch.allclose(m.diagonal()[plain], torch.ones(len(plain)), atol=1e-3):
        raise ValueError("a dim is scaled but not turned")
    rows = (count == 1).nonzero().flatten()
    partner = torch.full((d,), -1, dtype=torch.long)
    partner[rows] = moving[rows].float().argmax(dim=1)
    if bool((partner[partner[rows]] != rows).any()):
        raise ValueError("the dims do not turn in pairs")
    sin = off[rows, partner[rows]]
    if not (torch.allclose(sin, -off[partner[rows], rows], rtol=1e-3, atol=1e-9)
            and torch.allclose(m.diagonal()[rows], m.diagonal()[partner[rows]], rtol=1e-3, atol=1e-6)):
        raise ValueError("a pair of dims does not turn as one complex number")
    real = rows[sin > 0]  # e_a turns towards +b: a is the real part
    return Layout(real, partner[real], plain)


def layout_of(model: nn.Module, layer_idx: int, head_dim: int) -> Layout:
    """How the model's own rotary (``latent.rope_of``: its ``apply_rotary_pos_emb`` and rotary tables) turns layer
    ``layer_idx``'s keys; every dim plain when keys carry no rotary. SettingsError when it cannot be read."""
    from kvscope.core.runtimes.transformers import latent

    rope = latent.rope_of(model, layer_idx)
    if not rope.active:
        if rope.how == latent.Rope().how:
            return Layout(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.arange(head_dim))
        raise SettingsError(f"the aligned merge needs to know which dims rotary turns together: {rope.how}")
    device = next(model.parameters()).device
    eye = torch.eye(head_dim, dtype=torch.float32, device=device).reshape(1, head_dim, 1, head_dim)
    try:
        with torch.inference_mode():
            turned = rope.rotate(eye, 1)[0, :, 0, :].float().cpu()
        return _layout_from_rotation(turned)
    except (ValueError, RuntimeError, IndexError) as exc:
        raise SettingsError(f"the aligned merge needs rotary to turn pairs of dims; this model's does not ({exc})") \
            from exc


# ------------------------------------------------------------------------------------------------
# What the merge can apply to


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _norm_width(norm: nn.Module) -> int | None:
    """The features a norm normalizes together (its weight's, else its ``normalized_shape``; None: unknown)."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.shape[0])
    shape = getattr(norm, "normalized_shape", None)
    return int(shape[-1]) if shape else None


def key_norm(model: nn.Module) -> tuple[str, str] | None:
    """The norm a model applies to its queries or keys after their projection, as (its attribute, "per head" or
    "over all heads"); None where there is none."""
    from kvscope.core.runtimes.transformers.convert import _attention_modules, _head_dim

    try:
        modules = _attention_modules(model)
    except SettingsError:
        return None
    config = _text_config(model)
    for attn in modules:
        for n in QK_NORMS:
            norm = getattr(attn, n, None)
            if isinstance(norm, nn.Module):
                width = _norm_width(norm)
                return n, "per head" if width in (None, _head_dim(attn, config)) else "over all heads"
    return None


def normalized_keys_reason(model: nn.Module) -> str | None:
    """Why a cache of this model's K cannot have its heads merged or pooled in place (None: it can): keys normalized
    after their projection are no linear map of the input, so neither a mean nor a merge of the cached, normalized
    keys is what the model with fewer heads computes for the same tokens (tests/test_arch_qk_norm.py measured a
    relative difference of 0.48-0.57 on tiny Qwen3, Gemma 3 and LFM2): the tokens so far must go through the model
    with fewer heads again."""
    found = key_norm(model)
    if found is None:
        return None
    return (f"{type(model).__name__} normalizes its keys after their projection ({found[0]}): pooled cached keys "
            "are not what the model with fewer heads computes")


def normalized_keys_rerun(model: nn.Module, held: int | None, target: int, own: int) -> str | None:
    """Why a cache of ``held`` K/V heads must be re-run, not converted in place, to hold ``target`` (None: it need
    not): the model normalizes its keys after their projection and the cache would be pooled or merged (repeating
    the model's own heads copies them, which is exact whatever the norm)."""
    if held is None or held == target or (held % own == 0 and target % own == 0):
        return None
    why = normalized_keys_reason(model)
    heads = f"{target} K/V head{'s' if target != 1 else ''}"
    return f"{why}; the tokens so far go through the model with {heads}" if why else None


def head_change_problem(model: nn.Module) -> str | None:
    """Why this model cannot take fewer K/V heads at all (None: it can): a norm over all K/V heads at once (OLMo 2's
    k_norm) is fitted to the model's own count; with fewer heads it would need a norm the model does not have."""
    found = key_norm(model)
    if found is None or found[1] == "per head":
        return None
    return (f"{type(model).__name__} normalizes its queries or keys over all heads at once ({found[0]}, fitted to "
            "its own head count): fewer K/V heads would need a norm it does not have")


def problem(model: nn.Module) -> str | None:
    """Why the aligned merge cannot fold its maps into ``model`` (None: it can)."""
    from kvscope.core.runtimes.transformers.convert import _attention_modules, _head_dim

    name = type(model).__name__
    try:
        modules = _attention_modules(model)
    except SettingsError as exc:
        return str(exc)
    config = _text_config(model)
    q_heads = int(config.num_attention_heads)
    for attn in modules:
        norm = next((n for n in QK_NORMS if isinstance(getattr(attn, n, None), nn.Module)), None)
        if norm:
            return (f"{name} normalizes its keys after their projection ({norm}): the aligned merge's maps cannot "
                    "pass through the norm")
        q, o = getattr(attn, "q_proj", None), getattr(attn, "o_proj", None)
        if not isinstance(q, nn.Linear) or not isinstance(o, nn.Linear):
            return (f"{name}'s attention has no per-head q_proj/o_proj Linear layers for the aligned merge to fold "
                    "its maps into")
        d = _head_dim(attn, config)
        if q.out_features != q_heads * d or o.in_features != q_heads * d:
            return (f"{name}'s query or output projection is not {q_heads} heads of {d} (q_proj {q.out_features}, "
                    f"o_proj {o.in_features} features): the aligned merge folds per-head maps into them")
    return None


# ------------------------------------------------------------------------------------------------
# Calibration: Gram matrices of the model's own K/V heads, per layer


@dataclass
class Calibration:
    """One layer's sufficient statistics of its own K/V over ``tokens`` tokens (H own heads, P rotary pairs, dn plain
    dims): ``pairs`` [P, H, H] complex (sum of conj(z_g) z_h), ``plain`` [H*dn, H*dn], ``values`` [H*d, H*d];
    ``queries`` [Q, P], each query head's energy per pair (sum over tokens of |q_p|^2), where it was measured."""

    pairs: torch.Tensor
    plain: torch.Tensor
    values: torch.Tensor
    tokens: int
    queries: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pairs, self.plain, self.values))


def _pair_z(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[..., d] -> [..., P] complex: each rotary pair as one complex number."""
    a, b = layout.a.to(x.device), layout.b.to(x.device)
    return torch.complex(x[..., a].float(), x[..., b].float())


def calibrate(keys: torch.Tensor, values: torch.Tensor, layout: Layout) -> Calibration:
    """Gram matrices of one layer's own K/V, ``keys``/``values`` [batch, H, tokens, d] (rotated keys are fine:
    a position turns every head's pair by the same angle, which the pair Gram does not see)."""
    keys = keys[:, :, -CALIBRATION_TOKENS:].transpose(1, 2).reshape(-1, keys.shape[1], keys.shape[-1])  # [N, H, d]
    values = values[:, :, -CALIBRATION_TOKENS:].transpose(1, 2).reshape(-1, values.shape[1], values.shape[-1])
    n, h, _ = keys.shape
    z = _pair_z(keys, layout).permute(2, 1, 0)  # [P, H, N]
    pairs = torch.matmul(z.conj(), z.transpose(1, 2))  # [P, H, H]: sum over tokens of conj(z_g) z_h
    plain = keys[..., layout.plain.to(keys.device)].float().reshape(n, -1)
    v = values.float().reshape(n, -1)
    # Kept on the CPU (a few MiB for a small model): the eigen-solves run there, and a GPU's memory stays the model's.
    return Calibration(pairs.cpu(), (plain.T @ plain).cpu(), (v.T @ v).cpu(), n)


def query_energy(queries: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Each query head's energy per rotary pair, [Q, P], from queries [batch, Q, tokens, d] (rotated or not: a
    position turns a pair without changing its length)."""
    z = _pair_z(queries.float(), layout)  # [b, Q, N, P]
    return (z.real ** 2 + z.imag ** 2).sum(dim=(0, 2)).cpu()


def query_energy_of_weights(q_weight: torch.Tensor, layout: Layout, q_heads: int) -> torch.Tensor:
    """Each query head's energy per rotary pair, [Q, P], for inputs of equal energy in every direction: the squared
    norms of its rows of the pair in the query projection's weight (as loaded) [Q*d, hidden]."""
    w = q_weight.detach().float().reshape(q_heads, layout.head_dim, -1)
    rows = (w ** 2).sum(-1)  # [Q, d]
    return (rows[:, layout.a] + rows[:, layout.b]).cpu()


def _no_tokens(heads: int, layout: Layout) -> Calibration:
    """A calibration of no tokens (the merge is then mean-pooling's)."""
    p, dn, d = len(layout.a), len(layout.plain), layout.head_dim
    return Calibration(torch.zeros(p, heads, heads, dtype=torch.complex64), torch.zeros(heads * dn, heads * dn),
                       torch.zeros(heads * d, heads * d), 0)


# ------------------------------------------------------------------------------------------------
# The fitted merge of one layer


def _expand_index(own: int, target: int) -> tuple[int, torch.Tensor]:
    """Heads are merged from ``lcm(own, target)`` expanded heads (each own head repeated, as ``repeat_kv`` lays them
    out) in groups of ``lcm / target``: (the expanded count, each expanded head's own head)."""
    via = math.lcm(own, target)
    return via, torch.arange(via) // (via // own)


def _top_vectors(gram: torch.Tensor, k: int) -> torch.Tensor:
    """The top ``k`` eigenvectors of each Hermitian ``gram`` [..., n, n], as columns [..., n, k], largest first.

    Solved on the CPU in double precision (the matrices are small: a group's heads, or its heads' dims; a GPU's
    solver pays more per call than it saves, and two threads' spin-waits made a 192 x 192 float eigh 0.67 s here)."""
    wide = torch.complex128 if gram.is_complex() else torch.float64
    _, vectors = torch.linalg.eigh(gram.detach().to("cpu", wide))
    return vectors[..., -k:].flip(-1).to(gram.device, gram.dtype)


class LayerMerge:
    """The maps of one layer: ``target`` heads from ``own``. ``w`` [K, G, P] complex (each group's pair weights),
    ``up`` [K, G*dn, dn] and ``uv`` [K, G*d, d] (orthonormal bases of the plain dims and of the values)."""

    def __init__(self, cal: Calibration, layout: Layout, own: int, target: int, q_heads: int,
                 energy: torch.Tensor | None = None) -> None:
        self.layout, self.own, self.target, self.q_heads = layout, own, target, q_heads
        self.via, self.source = _expand_index(own, target)
        self.group = self.via // target
        d, dn, g = layout.head_dim, len(layout.plain), self.group
        self.tokens = cal.tokens
        src = self.source.reshape(target, g).to(cal.pairs.device)  # [K, G]: each group's own heads
        pairs = cal.pairs[:, src[:, :, None], src[:, None, :]]  # [P, K, G, G]
        pairs = self._with_prior(pairs, torch.ones(g, g, dtype=pairs.dtype, device=pairs.device) / g)
        # w merges the group's keys (k' = sum_g z_g w_g); r reads head g back (z_g ~ k' conj(r_g)), folded into the
        # queries. Unweighted they are the same unit vector, the top eigenvector of the group's pair Gram matrix.
        # Weighted by the energy s_g of head g's queries (the fit of sum_g s_g |z_g - k' conj(r_g)|^2): u, the top
        # eigenvector of S^1/2 X^H X S^1/2, gives w = S^1/2 u and r = S^-1/2 u.
        scale = self._query_scale(energy, src) if energy is not None and self.tokens else None  # [P, K, G]
        if scale is not None:
            pairs = pairs * (scale[..., :, None] * scale[..., None, :]).to(pairs.dtype)
        u = _top_vectors(pairs, 1)[..., 0]  # [P, K, G]
        self.w = (u * scale if scale is not None else u).permute(1, 2, 0).contiguous()  # [K, G, P]
        self.r = (u / scale if scale is not None else u).permute(1, 2, 0).contiguous()
        self.up = self._basis(cal.plain, src, dn)
        self.uv = self._basis(cal.values, src, d)

    def _query_scale(self, energy: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """sqrt of each expanded head's query energy per pair, [P, K, G], from ``energy`` [Q, P] (the query heads
        that read it, summed), scaled to a mean of 1 over each group (only the ratios within a group matter)."""
        per = torch.zeros(self.via, energy.shape[1], dtype=torch.float32)
        for j in range(self.q_heads):
            kk, gg = self._reader(j)
            per[kk * self.group + gg] += energy[j].float()
        per = per.reshape(self.target, self.group, -1).permute(2, 0, 1)  # [P, K, G]
        per = per / per.mean(dim=-1, keepdim=True).clamp_min(1e-30)
        return per.clamp_min(1e-6).sqrt().to(src.device)

    def _with_prior(self, block: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """``block`` (Gram matrices [..., n, n] over ``tokens``) plus ``PRIOR_TOKENS`` tokens' worth of ``mean``, the
        Gram matrix whose top eigenvectors are mean-pooling's (every head of the group the same, trace 1 per merged
        dim): few tokens fit close to the mean, many fit the tokens; none gives the mean itself."""
        if not self.tokens:
            return mean.expand_as(block).clone()
        width = float(torch.diagonal(mean).real.sum())
        energy = torch.diagonal(block, dim1=-2, dim2=-1).real.sum(-1) / (self.tokens * width)  # per merged dim
        return block + (PRIOR_TOKENS * energy)[..., None, None].to(block.dtype) * mean

    def _basis(self, gram: torch.Tensor, src: torch.Tensor, width: int) -> torch.Tensor:
        if width == 0:
            return gram.new_zeros(src.shape[0], 0, 0)
        g = src.shape[1]
        idx = (src[:, :, None] * width + torch.arange(width, device=src.device)).reshape(src.shape[0], -1)  # [K, G*w]
        block = gram[idx[:, :, None], idx[:, None, :]]  # [K, G*w, G*w]
        mean = torch.kron(torch.ones(g, g, device=gram.device), torch.eye(width, device=gram.device)) / g
        return _top_vectors(self._with_prior(block, mean.to(block.dtype)), width)

    # -- the maps, on any tensor whose last two dims are [heads, d]

    def _expand(self, x: torch.Tensor, held: int) -> torch.Tensor:
        """[..., held, d] (``held`` a multiple of own: each own head repeated) -> [..., K, G, d] expanded heads."""
        if held % self.own:
            raise SettingsError(f"{held} K/V heads are not the model's own {self.own} (or them repeated)")
        own = x[..., ::held // self.own, :]
        return own[..., self.source.to(x.device), :].reshape(*x.shape[:-2], self.target, self.group, x.shape[-1])

    def keys(self, x: torch.Tensor, held: int | None = None) -> torch.Tensor:
        """Merged keys [..., K, d] from the model's own keys [..., held, d] (rotated or not)."""
        e = self._expand(x, held or self.own).float()
        lay = self.layout
        a, b, p = lay.a.to(x.device), lay.b.to(x.device), lay.plain.to(x.device)
        out = torch.empty(*e.shape[:-3], self.target, lay.head_dim, dtype=torch.float32, device=x.device)
        if len(a):
            z = torch.complex(e[..., a], e[..., b])  # [..., K, G, P]
            merged = (z * self.w.to(x.device)).sum(-2)  # [..., K, P]
            out[..., a], out[..., b] = merged.real, merged.imag
        if len(p):
            flat = e[..., p].reshape(*e.shape[:-2], -1)  # [..., K, G*dn]
            out[..., p] = torch.einsum("...kf,kfe->...ke", flat, self.up.to(x.device))
        return out.to(x.dtype)

    def values(self, x: torch.Tensor, held: int | None = None) -> torch.Tensor:
        """Merged values [..., K, d] from the model's own values [..., held, d]."""
        e = self._expand(x, held or self.own).float()
        flat = e.reshape(*e.shape[:-2], -1)
        return torch.einsum("...kf,kfe->...ke", flat, self.uv.to(x.device)).to(x.dtype)

    def _reader(self, j: int) -> tuple[int, int]:
        """The (group, member) of the expanded head query head ``j`` reads."""
        e = j // (self.q_heads // self.via)
        return e // self.group, e % self.group

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Query rows [..., Q, d] mapped so that each query head reads the merged key as it read its own."""
        lay = self.layout
        a, b, p = lay.a.to(x.device), lay.b.to(x.device), lay.plain.to(x.device)
        readers = [self._reader(j) for j in range(self.q_heads)]
        kk = torch.tensor([r[0] for r in readers], device=x.device)
        gg = torch.tensor([r[1] for r in readers], device=x.device)
        xf = x.float()
        out = xf.clone()
        if len(a):
            w = self.r.to(x.device)[kk, gg]  # [Q, P]
            z = torch.complex(xf[..., a], xf[..., b]) * w
            out[..., a], out[..., b] = z.real, z.imag
        if len(p):
            dn = len(p)
            blocks = self.up.to(x.device).reshape(self.target, self.group, dn, dn)[kk, gg]  # [Q, dn(own), dn(merged)]
            out[..., p] = torch.einsum("...qf,qfe->...qe", xf[..., p], blocks)
        return out.to(x.dtype)

    def outputs(self, w_o: torch.Tensor) -> torch.Tensor:
        """The output projection's weight [hidden, Q*d] with each query head's columns reading the merged value."""
        d = self.layout.head_dim
        readers = [self._reader(j) for j in range(self.q_heads)]
        kk = torch.tensor([r[0] for r in readers], device=w_o.device)
        gg = torch.tensor([r[1] for r in readers], device=w_o.device)
        blocks = self.uv.to(w_o.device).reshape(self.target, self.group, d, d)[kk, gg]  # [Q, d(own), d(merged)]
        cols = w_o.float().reshape(w_o.shape[0], self.q_heads, d)
        return torch.einsum("hqf,qfe->hqe", cols, blocks).reshape(w_o.shape).to(w_o.dtype)


# ------------------------------------------------------------------------------------------------
# Applying a merge to the model and the cache


def _rows_as_heads(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A projection's weight [heads*d, hidden] as [hidden, heads, d] (rows grouped by head)."""
    return weight.reshape(heads, -1, weight.shape[-1]).permute(2, 0, 1)


def _heads_as_rows(x: torch.Tensor) -> torch.Tensor:
    """[hidden, heads, d] back to [heads*d, hidden]."""
    return x.permute(1, 2, 0).reshape(-1, x.shape[0]).contiguous()


def fit(model: nn.Module, origin, target: int, own_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        kept: dict[int, Calibration] | None = None) -> tuple[dict[int, LayerMerge], dict[int, Calibration], int]:
    """Each attention layer's merge from the model's own ``origin.heads`` K/V heads to ``target`` heads.

    ``own_kv``: per layer index, the model's own K/V of the tokens so far ([b, heads, tokens, d], heads a multiple of
    the model's own); else ``kept``, an earlier calibration; else the projections' weights. Returns the merges, the
    calibrations made from ``own_kv`` (to keep), and the tokens the fit was calibrated on (0: the weights only)."""
    from kvscope.core.runtimes.transformers.convert import _attention_modules

    why = problem(model)
    if why:
        raise SettingsError(why)
    config = _text_config(model)
    q_heads = int(config.num_attention_heads)
    merges, made, tokens = {}, {}, None
    types, layouts = list(getattr(config, "layer_types", None) or []), {}
    for i, attn in enumerate(_attention_modules(model)):
        idx = int(getattr(attn, "layer_idx", i))
        d = origin.head_dims[i]
        kind = (types[idx] if idx < len(types) else None, d)
        if kind not in layouts:  # one rotary per layer type: read once (rope_of walks the model)
            layouts[kind] = layout_of(model, idx, d)
        layout = layouts[kind]
        data = None
        if own_kv and idx in own_kv:
            k, v = own_kv[idx]
            step = k.shape[1] // origin.heads
            data = calibrate(k[:, ::step], v[:, ::step], layout)
            made[idx] = data
        elif kept and idx in kept:
            data = kept[idx]
        tokens = min(tokens, data.tokens if data else 0) if tokens is not None else (data.tokens if data else 0)
        energy = None
        if KEY_WEIGHTING == "queries" and len(layout.a):
            energy = data.queries if data is not None and data.queries is not None else \
                query_energy_of_weights(origin.queries[i][0], layout, q_heads)
        merges[idx] = LayerMerge(data or _no_tokens(origin.heads, layout), layout, origin.heads, target, q_heads,
                                 energy)
    return merges, made, int(tokens or 0)


def set_merged(model: nn.Module, origin, merges: dict[int, LayerMerge]) -> None:
    """Every attention layer's q/k/v/o projections merged (``merges`` from ``fit``), from the model's own tensors
    (``origin``), as new Parameters; config and modules' head counts as ``set_kv_heads`` sets them."""
    from kvscope.core.runtimes.transformers.convert import _attention_modules, _own_storage, set_head_counts

    config = _text_config(model)
    q_heads = int(config.num_attention_heads)
    target = next(iter(merges.values())).target
    modules = _attention_modules(model)
    with torch.no_grad():
        for i, attn in enumerate(modules):
            m = merges[int(getattr(attn, "layer_idx", i))]
            kw, kb, vw, vb, qw, qb, ow = origin.layers[i][:4] + origin.queries[i]
            _own_storage(attn)
            k = m.keys(_rows_as_heads(kw.detach(), m.own))
            v = m.values(_rows_as_heads(vw.detach(), m.own))
            q = m.queries(_rows_as_heads(qw.detach(), q_heads))
            attn.k_proj.weight = nn.Parameter(_heads_as_rows(k), requires_grad=False)
            attn.v_proj.weight = nn.Parameter(_heads_as_rows(v), requires_grad=False)
            attn.q_proj.weight = nn.Parameter(_heads_as_rows(q), requires_grad=False)
            attn.o_proj.weight = nn.Parameter(m.outputs(ow.detach()), requires_grad=False)
            if kb is not None:
                attn.k_proj.bias = nn.Parameter(m.keys(kb.detach().reshape(m.own, -1)).reshape(-1),
                                                requires_grad=False)
            if vb is not None:
                attn.v_proj.bias = nn.Parameter(m.values(vb.detach().reshape(m.own, -1)).reshape(-1),
                                                requires_grad=False)
            if qb is not None:
                attn.q_proj.bias = nn.Parameter(m.queries(qb.detach().reshape(q_heads, -1)).reshape(-1),
                                                requires_grad=False)
            attn.k_proj.out_features = attn.v_proj.out_features = target * m.layout.head_dim
    set_head_counts(model, modules, target)


def merge_cache(cache, merges: dict[int, LayerMerge], held: int) -> None:
    """The live cache's K/V (``held`` heads per layer: the model's own, or them repeated) merged in place through the
    same maps as the projections; every cache class the head conversion knows (``convert._convert_layer_with``)."""
    from kvscope.core.runtimes.transformers.convert import _convert_layer_with, _layer_heads

    for i, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False):
            continue
        m = merges.get(i)
        if m is None:
            raise SettingsError(f"cache layer {i} has no attention layer to merge its heads with")
        if _layer_heads(layer) != held:
            raise SettingsError(f"cache layer {i} holds {_layer_heads(layer)} K/V heads, not {held}")

        def keys(t, m=m):
            return m.keys(t.transpose(1, 2), held).transpose(1, 2).contiguous()

        def values(t, m=m):
            return m.values(t.transpose(1, 2), held).transpose(1, 2).contiguous()

        _convert_layer_with(layer, keys, values, m.target, f"cache layer {i}")
