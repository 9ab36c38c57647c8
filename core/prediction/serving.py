"""Serving capacity under vLLM's rules: KV blocks, the tokens they hold, and "Maximum concurrency".

The rules follow vLLM 0.33.0 (read in its wheel, vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl):

- ``vllm/v1/worker/utils.py`` ``request_memory``: requested = ceil(total GPU memory x
  gpu_memory_utilization); ``vllm/config/cache.py``: gpu_memory_utilization defaults to 0.92 (older
  releases used 0.9) and block_size to ``CacheConfig.DEFAULT_BLOCK_SIZE`` = 16 tokens.
- ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``: available KV memory = requested -
  non_kv_cache_memory - the CUDA-graph memory estimate (on by default,
  ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``); ``vllm/utils/mem_utils.py`` ``memory_profiling``:
  non_kv_cache_memory = what the instance consumed (weights, non-torch memory such as the CUDA
  context and NCCL buffers) + the transient peak of a profile run over max_num_batched_tokens.
- ``vllm/v1/kv_cache_interface.py`` ``AttentionSpec.page_size_bytes``: block_size x KV heads x
  (head_size + head_size_v) x dtype bytes per layer (an MLA latent: one head of the latent width);
  ``vllm/v1/core/kv_cache_planning.py``: bytes per block = the sum over the layers of a group, and
  num_blocks = available // bytes per block; every worker of a TP/PP group then uses the smallest
  worker's count.
- ``vllm/v1/core/kv_cache_utils.py`` ``get_max_concurrency_for_kv_cache_config`` and
  ``update_kv_cache_capacity``: concurrency = num_blocks / cdiv(max_model_len, block_size); tokens =
  int(concurrency x max_model_len); logged as "GPU KV cache size: N tokens, Maximum concurrency for
  M tokens per request: X.XXx".
- Hybrid models (sliding-window and full layers), the hybrid KV cache manager (on unless
  ``--disable-hybrid-kv-cache-manager``): ``vllm/v1/core/kv_cache_planning.py`` ``get_kv_cache_groups`` ->
  ``unify_kv_cache_spec_page_size`` (a smaller page takes a larger block_size, page ratio) ->
  ``_get_kv_cache_groups_uniform_page_size``: the layers are bucketed by spec, group_size = the smallest
  bucket's layer count (the largest when it is under 1.5x the smallest), each bucket splits into
  cdiv(len, group_size) groups (``layers[i::num_groups]``); ``get_kv_cache_config_from_groups`` /
  ``_get_kv_cache_bytes_per_block``: bytes per block = the largest group's summed pages, num_blocks = available //
  that. ``vllm/v1/core/kv_cache_utils.py`` ``get_max_concurrency_for_kv_cache_config``: a request takes, in every
  group, cdiv(spec.max_memory_usage_bytes, page): a full layer cdiv(max_model_len, block_size) blocks
  (``FullAttentionSpec``), a window layer cdiv(min(window - 1 + max_in_flight_tokens, max_model_len),
  block_size) + 1 (``vllm/v1/kv_cache_interface.py`` ``SlidingWindowSpec.max_admission_blocks_per_request``;
  ``vllm/config/vllm.py``: max_in_flight_tokens = max_concurrent_batches (2 with async scheduling, vLLM's
  default, at pipeline size 1) x max_num_batched_tokens); concurrency = num_blocks / the sum. The default
  (layer-outermost) KV layout is assumed: the block-outermost packing (``_get_packed_kv_cache_groups``) is not
  followed. MLA layers cache one latent head (kv_lora_rank + rope, ``MLAAttentionSpec``, head_size_v 0). Layers
  with a fixed-size state (linear attention, Mamba) are ``MambaSpec``s: ``vllm/platforms/interface.py``
  ``_align_hybrid_block_size`` grows the attention block (a multiple of the 16-token kernel block) until its page
  holds a state and pads the state page to it; a request takes one block per state group. The state's bytes are
  transformers' (``kvscope.core.model.states``). ``scripts/vllm_groups_against_vllm.py`` runs vLLM 0.33.0's own planning
  functions on the CPU against ``block_groups`` (300 generated layer mixes, all equal).
- ``vllm/engine/arg_utils.py``: max_num_batched_tokens defaults (the OpenAI server) to 2048 below
  70 GiB, 8192 from 70 GiB (not A100), 16384 from 160 GiB.

Exact here: the block bytes, the block count and the concurrency for a given available memory, and
the weights (``kvscope.core.prediction.predict``/``kvscope.core.prediction.parallel``). Estimates: the activation peak (vLLM profiles it at
start-up; KV Scope estimates it with ``kvscope.core.prediction.predict.activation_bytes`` over max_num_batched_tokens),
the non-torch memory and the CUDA-graph memory (KV Scope's defaults below; pass the figures from your
own vLLM log to replace them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.caches import kv_layout
from kvscope.core.model.settings import RunSettings
from kvscope.core.model.spec import NO_KV, ModelSpec, dtype_bytes, human_bytes
from kvscope.core.prediction.parallel import Parallelism, layout
from kvscope.core.prediction.predict import activation_bytes, kv_elem_bytes, weight_bytes

VLLM_VERSION = "0.33.0"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
GiB = 1 << 30
#: KV Scope's guesses (not vLLM's): the CUDA context, cuBLAS and NCCL workspaces outside torch's
#: allocator, and the captured CUDA graphs. vLLM measures both at start-up.
DEFAULT_NON_TORCH_BYTES = 512 << 20
DEFAULT_CUDAGRAPH_BYTES = 512 << 20


def default_max_num_batched_tokens(gpu_memory: int) -> int:
    """vLLM 0.33.0's default for the OpenAI server (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``)."""
    if gpu_memory >= 160 * GiB:
        return 16384
    if gpu_memory >= 70 * GiB:
        return 8192
    return 2048


@dataclass(frozen=True)
class VllmOptions:
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # default: vLLM's for this GPU size
    non_torch_bytes: int = DEFAULT_NON_TORCH_BYTES
    cudagraph_bytes: int = DEFAULT_CUDAGRAPH_BYTES
    #: vLLM's ``kv_cache_memory_bytes`` (``--kv-cache-memory``): the KV memory per GPU, given; vLLM then
    #: skips the profiling and so does KV Scope (no estimate enters). Also the way to check KV Scope
    #: against a vLLM log: its "Available KV cache memory" figure in, its block count out.
    kv_cache_memory: int | None = None
    #: vLLM's hybrid KV cache manager (``--disable-hybrid-kv-cache-manager`` turns it off: window layers then take
    #: blocks for every token, as full layers do).
    hybrid_kv_cache_manager: bool = True

    def __post_init__(self) -> None:
        if not (0 < self.gpu_memory_utilization <= 1):  # vLLM: Field(gt=0, le=1); refuses NaN too
            raise SettingsError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size <= 0:
            raise SettingsError(f"--block-size must be positive, got {self.block_size}")
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.non_torch_bytes < 0 or self.cudagraph_bytes < 0:
            raise SettingsError("memory overheads cannot be negative")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise SettingsError("--kv-cache-memory must be positive")


@dataclass(frozen=True)
class WorkerCapacity:
    """One GPU (worker) of the deployment: what it holds and the KV blocks left for it."""

    gpu: int
    requested: int  # ceil(total x utilization)
    weights: int
    activation_peak: int  # estimate
    non_torch: int  # estimate
    cudagraphs: int  # estimate
    available_kv: int  # requested - the above (may be negative: does not fit)
    block_bytes: int  # exact
    num_blocks: int  # this worker's own count (max(0, available // block_bytes))


@dataclass(frozen=True)
class BlockGroup:
    """One of vLLM's KV cache groups: layers of one spec sharing a block table."""

    kind: str  # "full" or "sliding window"
    layers: int  # layers in this group (the last group of a kind may be padded with fewer)
    block_size: int  # tokens per block (a smaller page is unified by a larger block)
    page_bytes: int  # one layer's bytes per block
    window: int | None = None

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """cdiv(spec.max_memory_usage_bytes, page_size_bytes) for one request of ``max_model_len`` tokens."""
        if self.kind == MAMBA:  # MambaSpec.max_memory_usage_bytes, mamba_cache_mode "none": one state
            return 1
        if self.window is None:  # FullAttentionSpec.max_memory_usage_bytes
            return -(-max_model_len // self.block_size)
        # SlidingWindowSpec.max_admission_blocks_per_request
        tokens = min(self.window - 1 + max_in_flight_tokens, max_model_len)
        return -(-tokens // self.block_size) + 1


#: FlashAttention's kernel block sizes are MultipleOf(16) (vllm/v1/attention/backends/flash_attn.py
#: get_supported_kernel_block_sizes): the alignment of a hybrid model's attention block size.
KERNEL_BLOCK_ALIGNMENT = 16
MAMBA = "state"  # a group of layers that keep a fixed-size state (linear attention, Mamba): vLLM's MambaSpec


def mamba_block_size(block_size: int, attn_page_1_token: int, mamba_page: int) -> int:
    """vllm/platforms/interface.py ``_align_hybrid_block_size``: the smallest attention block size (a multiple of
    the kernel block) whose page holds a Mamba state; never smaller than ``block_size``. The state's page is then
    padded to the attention page."""
    align = max(KERNEL_BLOCK_ALIGNMENT, block_size)
    needed = align * -(-mamba_page // (align * attn_page_1_token))
    needed = KERNEL_BLOCK_ALIGNMENT * -(-needed // KERNEL_BLOCK_ALIGNMENT)
    return max(block_size, needed)


def block_groups(layers, block_size: int, elem: float, hybrid: bool = True, states: tuple[int, ...] = ()
                 ) -> tuple[tuple[BlockGroup, ...], int]:
    """vLLM's KV cache groups of ``layers`` (``kvscope.core.model.caches.LayerKV``) and the bytes of one block over a group (the
    largest): ``get_kv_cache_groups`` and ``_get_kv_cache_bytes_per_block`` (see the module docstring). With
    ``hybrid`` False (--disable-hybrid-kv-cache-manager) window layers count as full ones (``unify_hybrid_kv_cache_
    specs``). ``states``: the bytes of each state layer's per-sequence state (linear attention, Mamba), which vLLM
    gives pages of their own, one block per request, padded to the attention page (the attention block size grows
    until its page holds a state: ``mamba_block_size``)."""
    states = tuple(n for n in states if n > 0)
    if states and layers:
        block_size = mamba_block_size(block_size, int(math.ceil(layers[0].width * elem)), max(states))
    specs = []
    for layer in layers:
        page = int(math.ceil(block_size * layer.width * elem))
        window = layer.window if hybrid else None
        specs.append((window, page))
    if states:
        attn_page = specs[0][1] if specs else max(states)
        specs += [(MAMBA, attn_page)] * len(states)  # MambaSpec.page_size_padded = the attention page
    if not specs:
        return (), 0
    def group(w, n: int, bs: int, page: int) -> BlockGroup:
        if w == MAMBA:
            return BlockGroup(MAMBA, n, bs, page)
        return BlockGroup("full" if w is None else "sliding window", n, bs, page, w)

    windows = {w for w, _ in specs}
    if len(windows) == 1:  # one type of layer: one group (uniform spec, or UniformTypeKVCacheSpecs)
        (w,) = windows
        pages = [p for _, p in specs]
        if len(set(pages)) == 1:
            return (group(w, len(pages), block_size, pages[0]),), sum(pages)
        # UniformTypeKVCacheSpecs: page = the sum; a request needs the same blocks per layer
        return (group(w, len(pages), block_size, sum(pages)),), sum(pages)
    # unify_kv_cache_spec_page_size: a smaller page that divides the largest takes a larger block size
    max_page = max(p for _, p in specs)
    unified = []
    for w, p in specs:
        if p == max_page:
            unified.append((w, block_size, p))
        elif max_page % p == 0:
            unified.append((w, block_size * (max_page // p), max_page))
        else:  # padded to the largest page (non-MLA attention)
            unified.append((w, block_size, max_page))
    buckets: dict[tuple, int] = {}
    for spec in unified:
        buckets[spec] = buckets.get(spec, 0) + 1
    counts = list(buckets.values())
    group_size = min(counts)
    if max(counts) < group_size * 1.5:
        group_size = max(counts)
    groups = []
    for (w, bs, page), n in buckets.items():
        num_groups = -(-n // group_size)
        for i in range(num_groups):
            groups.append(group(w, len(range(i, n, num_groups)), bs, page))
    return tuple(groups), max(g.layers * g.page_bytes for g in groups)


@dataclass(frozen=True)
class ServingCapacity:
    spec: ModelSpec
    options: VllmOptions
    parallelism: Parallelism
    gpu_memory: int
    max_model_len: int
    max_num_batched_tokens: int
    workers: tuple[WorkerCapacity, ...]
    notes: tuple[str, ...]
    groups: tuple[BlockGroup, ...] = ()
    max_in_flight_tokens: int = 0

    @property
    def num_gpu_blocks(self) -> int:
        """What every worker allocates: the smallest worker's count."""
        return min(w.num_blocks for w in self.workers)

    def blocks_for(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens takes, summed over the groups."""
        if not self.groups:
            return -(-tokens // self.options.block_size)
        return sum(g.blocks_per_request(tokens, self.max_in_flight_tokens) for g in self.groups)

    @property
    def blocks_per_request(self) -> int:
        return self.blocks_for(self.max_model_len)

    def concurrency(self, tokens_per_request: int | None = None) -> float:
        """vLLM's "Maximum concurrency for N tokens per request" (N = max_model_len by default)."""
        n = tokens_per_request or self.max_model_len
        return self.num_gpu_blocks / self.blocks_for(n)

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens" (int(concurrency x max_model_len))."""
        return int(self.concurrency() * self.max_model_len)

    def log_line(self) -> str:
        """The line vLLM prints at start-up, with KV Scope's figures."""
        return (f"GPU KV cache size: {self.kv_cache_tokens:,} tokens, Maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.concurrency():.2f}x")

    def to_json(self) -> dict:
        return {
            "runtime": "vllm", "vllm_version": VLLM_VERSION,
            "gpu_memory_utilization": self.options.gpu_memory_utilization, "block_size": self.options.block_size,
            "max_model_len": self.max_model_len, "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_gpu_blocks": self.num_gpu_blocks, "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency": self.concurrency(), "blocks_per_request": self.blocks_per_request,
            "kv_cache_groups": [{"kind": g.kind, "layers": g.layers, "block_size": g.block_size,
                                 "page_bytes": g.page_bytes, "window": g.window} for g in self.groups],
            "workers": [{
                "gpu": w.gpu, "requested_bytes": w.requested, "weights_bytes": w.weights,
                "activation_peak_bytes": w.activation_peak, "non_torch_bytes": w.non_torch,
                "cudagraph_bytes": w.cudagraphs, "available_kv_bytes": w.available_kv,
                "block_bytes": w.block_bytes, "num_blocks": w.num_blocks,
            } for w in self.workers],
            "estimated": [] if self.options.kv_cache_memory is not None else
                         ["activation_peak_bytes", "non_torch_bytes", "cudagraph_bytes"],
            "notes": list(self.notes),
        }


def vllm_capacity(spec: ModelSpec, settings: RunSettings, gpu_memory: int, options: VllmOptions | None = None,
                  parallelism: Parallelism | None = None) -> ServingCapacity:
    """vLLM's KV capacity for ``spec`` on GPUs of ``gpu_memory`` bytes each (see the module docstring)."""
    options = options or VllmOptions()
    parallelism = parallelism or Parallelism()
    if settings.cache.name != "dynamic":
        raise SettingsError(f"--runtime vllm uses vLLM's paged cache, not a {settings.cache.key} cache; leave --cache out")
    if settings.batch != 1:
        raise SettingsError("--runtime vllm answers how many requests fit; leave --batch out")
    settings = settings.with_(attn_impl="flash")  # vLLM's attention kernels hold no q x kv scores
    plan = layout(spec, settings, parallelism)
    max_len = options.max_model_len or spec.max_position_embeddings
    batched = options.max_num_batched_tokens or default_max_num_batched_tokens(gpu_memory)
    notes = list(plan.notes)
    eff = plan.spec
    elem = kv_elem_bytes(spec, settings)
    # vllm/config/vllm.py max_concurrent_batches: 2 with async scheduling (the default) at pipeline size 1
    in_flight = (2 if parallelism.pipeline <= 1 else parallelism.pipeline + 1) * batched
    requested = math.ceil(gpu_memory * options.gpu_memory_utilization)
    shard_settings = settings.with_(attention=None)
    workers = []
    for rank in range(parallelism.gpus):
        stage = plan.gpu_stage(rank)
        layers = kv_layout(stage.spec)
        st = stage.spec
        model_elem = dtype_bytes(st.dtype)
        state_sizes = tuple(state.nbytes(1, model_elem) for kind, state in
                            zip(st.layer_types, st.layer_states or (None,) * len(st.layer_types))
                            if kind == NO_KV and state is not None)
        stage_groups, block = block_groups(layers, options.block_size, elem, options.hybrid_kv_cache_manager,
                                           state_sizes)
        if rank == 0:
            groups = stage_groups
        weights = weight_bytes(stage.spec, shard_settings)
        # The profile run: one forward pass over max_num_batched_tokens tokens (chunked prefill).
        act = activation_bytes(stage.spec, shard_settings, batched, batched)
        available = requested - weights - act - options.non_torch_bytes - options.cudagraph_bytes
        if options.kv_cache_memory is not None:
            available = options.kv_cache_memory  # gpu_worker.py: kv_cache_memory_bytes skips the profiling
        blocks = max(0, available // block) if block else 0
        workers.append(WorkerCapacity(rank, requested, weights, act, options.non_torch_bytes, options.cudagraph_bytes,
                                      available, block, blocks))
    if any(g.kind == MAMBA for g in groups):
        bs = next(g.block_size for g in groups if g.kind != MAMBA) if any(g.kind != MAMBA for g in groups) else 0
        notes.append(f"layers with a fixed-size state (linear attention, Mamba): one state block per request in each "
                     f"of their groups, padded to the attention page; attention blocks of {bs} tokens so that a page "
                     "holds a state (vllm/platforms/interface.py _align_hybrid_block_size). The state's size is "
                     "transformers' (kvscope.core.model.states); vLLM's own state dtypes (--mamba-ssm-cache-dtype) may differ")
    elif any(kind == NO_KV for kind in eff.layer_types):
        notes.append("layers without K/V and without a known state: not counted in the blocks")
    if len(groups) > 1:
        kinds = sorted({g.kind for g in groups})
        notes.append(f"vLLM's hybrid allocator: {len(groups)} KV cache groups ({' and '.join(kinds)}) of up to "
                     f"{max(g.layers for g in groups)} layers; a block is {block:,} B over a group; a request of "
                     f"{max_len:,} tokens takes {sum(g.blocks_per_request(max_len, in_flight) for g in groups):,} "
                     "blocks over all groups")
    return ServingCapacity(spec, options, parallelism, gpu_memory, max_len, batched, tuple(workers), tuple(notes),
                           groups, in_flight)


def render(cap: ServingCapacity) -> list[str]:
    """Lines for the calc table: the rules' source, one worker's budget (the tightest), vLLM's log line."""
    w = min(cap.workers, key=lambda x: x.num_blocks)
    o = cap.options
    gpus = f" (GPU {w.gpu}, the tightest of {cap.parallelism.gpus})" if cap.parallelism.gpus > 1 else ""
    est = "estimate"

    def row(label: str, n: int, note: str = "") -> str:
        return f"  {label:<40} {n:>19,} B  {human_bytes(n):>10}{'  ' + note if note else ''}"

    if o.kv_cache_memory is not None:
        return [
            f"Serving capacity with vLLM {VLLM_VERSION}'s rules (vllm/v1/core/kv_cache_utils.py), for the KV memory "
            "given (--kv-cache-memory, vLLM's kv_cache_memory_bytes: no profiling, no estimate):",
            f"  block_size {o.block_size} tokens, max_model_len {cap.max_model_len:,}{gpus}",
            row("available KV cache memory (given)", w.available_kv, "exact"),
            row(f"KV per block ({o.block_size} tokens)", w.block_bytes, "exact"),
            f"  num_gpu_blocks = floor(available / block) = {cap.num_gpu_blocks:,}",
            f"  {cap.log_line()}",
            *[f"  {note}" for note in cap.notes],
        ]
    lines = [
        f"Serving capacity with vLLM {VLLM_VERSION}'s rules (vllm/v1/worker/gpu_worker.py determine_available_memory, "
        "vllm/v1/core/kv_cache_utils.py):",
        f"  gpu_memory_utilization {o.gpu_memory_utilization:g}, block_size {o.block_size} tokens, max_model_len "
        f"{cap.max_model_len:,}, max_num_batched_tokens {cap.max_num_batched_tokens:,}{gpus}",
        row(f"requested ({o.gpu_memory_utilization:g} x {human_bytes(cap.gpu_memory)})", w.requested, "exact"),
        row("- weights", w.weights, "exact"),
        row(f"- activation peak ({cap.max_num_batched_tokens:,} tokens)", w.activation_peak,
            f"{est}: vLLM profiles it at start-up"),
        row("- non-torch memory (CUDA context, NCCL)", w.non_torch, f"{est}: vLLM measures it"),
        row("- CUDA graphs", w.cudagraphs, f"{est}: vLLM profiles it (0 with --enforce-eager)"),
        row("= available KV cache memory", w.available_kv),
        row(f"KV per block ({o.block_size} tokens)", w.block_bytes, "exact"),
        f"  num_gpu_blocks = floor(available / block) = {cap.num_gpu_blocks:,}",
        f"  {cap.log_line()}",
    ]
    if cap.num_gpu_blocks == 0:
        lines.append("  No KV block fits: vLLM would refuse to start (raise --gpu-memory-utilization or add GPUs).")
    elif cap.concurrency() < 1:
        lines.append(f"  Less than one request of {cap.max_model_len:,} tokens fits: vLLM refuses to start; lower "
                     "--max-model-len.")
    lines += [f"  {note}" for note in cap.notes]
    return lines
