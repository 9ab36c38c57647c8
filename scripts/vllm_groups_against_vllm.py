"""Check kvscope.core.prediction.serving's KV cache groups, block bytes and concurrency against vLLM 0.33.0's own code, run on the CPU.

vLLM cannot be installed here (CUDA wheels, many services), but its KV planning is plain Python. This script imports
vllm/v1/core/kv_cache_planning.py and kv_cache_utils.py from the wheel, with the modules they pull in but never call
(zmq, openai, fastapi...) replaced by empty stand-ins, and compares, on a generated set of layer mixes (full and
sliding-window attention, fixed-state layers padded to the attention page), vLLM's
``get_kv_cache_groups`` -> ``get_kv_cache_config_from_groups`` -> ``get_max_concurrency_for_kv_cache_config``
with ``kvscope.core.prediction.serving.block_groups`` (MLA layers too: one latent head, ``MLAAttentionSpec``):

    pip download 'vllm==0.33.0' --no-deps -d /tmp/vllm-wheel
    mkdir -p /tmp/vllm-src && cd /tmp/vllm-src && unzip -q /tmp/vllm-wheel/vllm-0.33.0-*.whl 'vllm/*' -x 'vllm/*.so'
    .venv/bin/python scripts/vllm_groups_against_vllm.py /tmp/vllm-src

The vLLM config is a plain namespace holding the fields these functions read, at vLLM's defaults (async scheduling:
two batches in flight; the layer-outermost LBNHC layout FlashAttention takes; the hybrid manager on).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

STUBBED = ("cbor2 zmq aiohttp openai_harmony openai PIL pybase64 cachetools msgspec cloudpickle uvloop cpuinfo xgrammar "
           "fastapi vllm.renderers vllm.parser vllm.v1.structured_output vllm.entrypoints").split()


class _Any(types.ModuleType):
    """A module (and anything read from it) that is never used by the functions under test."""

    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any(f"{self.__name__}.{name}")

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any("call")

    def __mro_entries__(self, bases):
        return (object,)

    def __getitem__(self, k):
        return self

    def __or__(self, other):
        return self

    __ror__ = __or__


class _Generic(dict):
    def __class_getitem__(cls, item):
        return cls

    def __init_subclass__(cls, **kw):
        pass


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Any(spec.name)
        if spec.name == "cachetools":
            m.LRUCache = m.TTLCache = m.Cache = _Generic
        if spec.name == "msgspec":
            m.Struct = _Generic
            m.field = lambda *a, **k: None
        return m

    def exec_module(self, module):
        pass


def main(vllm_src: str) -> int:
    sys.path.insert(0, vllm_src)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.meta_path.insert(0, _Stubs())
    import torch
    import vllm.v1.core.kv_cache_planning as planning
    import vllm.v1.core.kv_cache_utils as utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvscope.core.model.caches import LayerKV
    from kvscope.core.prediction.serving import block_groups, mamba_block_size

    rng = random.Random(33)
    checked = 0
    for case in range(300):
        heads, head = rng.choice((1, 2, 4, 8)), rng.choice((64, 128, 256))
        n_full = rng.randint(1, 16)
        n_swa = rng.choice((0, rng.randint(1, 60)))
        n_state = rng.choice((0, 0, rng.randint(1, 40)))
        window = rng.choice((128, 512, 1024, 4096))
        max_len = rng.choice((2048, 8192, 32768, 131072))
        batched = rng.choice((2048, 8192, 16384))
        state = rng.choice((40_000, 700_000, 1 << 20, 3 << 20))
        # window layers with fewer KV heads (a smaller page: unify_kv_cache_spec_page_size), without state layers
        swa_heads = heads if n_state else rng.choice((heads, max(1, heads // 2), max(1, heads // 4)))
        block_size = 16
        per_token = heads * head * 2 * 2  # K and V, 2 B
        if n_state:
            block_size = mamba_block_size(16, per_token, state)
        specs = {}
        mla = case % 10 == 9  # an MLA model: one latent head of kv_lora_rank + rope per layer (MLAAttentionSpec)
        if mla:
            n_swa = n_state = 0
            rank, rope = rng.choice(((512, 64), (256, 32)))
            for i in range(n_full):
                specs[f"mla.{i}"] = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=rank + rope,
                                                     dtype=torch.bfloat16, cache_dtype_str="auto")
        for i in range(0 if mla else n_full):
            specs[f"full.{i}"] = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head,
                                                   dtype=torch.bfloat16)
        for i in range(n_swa):
            specs[f"swa.{i}"] = SlidingWindowSpec(block_size=block_size, num_kv_heads=swa_heads, head_size=head,
                                                  dtype=torch.bfloat16, sliding_window=window)
        for i in range(n_state):
            specs[f"state.{i}"] = MambaSpec(block_size=block_size, shapes=((state,),), dtypes=(torch.int8,),
                                            page_size_padded=block_size * per_token)
        cfg = SimpleNamespace(
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=batched),
            cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBNHC,
                                         prefix_cache_retention_interval=None, num_gpu_blocks_override=None,
                                         mamba_cache_mode="none", kv_sharing_fast_prefill=False),
            attention_config=SimpleNamespace(hisparse_config=None),
            model_config=SimpleNamespace(max_model_len=max_len),
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
            max_in_flight_tokens=2 * batched, speculative_config=None)
        available = rng.choice((1, 10, 40)) << 30
        groups = planning.get_kv_cache_groups(cfg, specs)
        config = planning.get_kv_cache_config_from_groups(cfg, groups, available)
        concurrency = utils.get_max_concurrency_for_kv_cache_config(cfg, config)
        layers = ([LayerKV(heads=1, k_dim=rank, v_dim=rope)] * n_full if mla else
                  [LayerKV(heads=heads, k_dim=head, v_dim=head)] * n_full
                  + [LayerKV(heads=swa_heads, k_dim=head, v_dim=head, window=window)] * n_swa)
        ours, block = block_groups(layers, 16, 2, states=(state,) * n_state)
        blocks = available // block
        ours_concurrency = blocks / sum(g.blocks_per_request(max_len, 2 * batched) for g in ours)
        theirs = sorted(len(g.layer_names) for g in groups)
        assert sorted(g.layers for g in ours) == theirs, (case, theirs, ours)
        assert blocks == config.num_blocks, (case, blocks, config.num_blocks)
        assert abs(ours_concurrency - concurrency) < 1e-12, (case, ours_concurrency, concurrency)
        checked += 1
    print(f"{checked} layer mixes: groups, num_blocks and concurrency equal to vLLM 0.33.0's own functions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/vllm-src"))
