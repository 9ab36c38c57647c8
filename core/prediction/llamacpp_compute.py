"""llama.cpp's compute and output buffers, predicted by replaying what llama.cpp does at context creation.

Read in the source that llama-cpp-python 0.3.36 vendors (llama.cpp 0c1e570):

- ``src/llama-context.cpp`` ``sched_reserve``: three graphs are reserved with the memory treated as full
  (``init_full``: every cell counted, n_kv = the cache size): the prompt graph (n_tokens = min(n_ctx, n_ubatch),
  rounded up to a multiple of n_seq_max; n_outputs = min(n_tokens, n_batch)), the one-token-per-sequence graph
  (n_tokens = n_outputs = n_seq_max), then the prompt graph again. ``ggml_gallocr_reserve_n`` only ever grows a
  buffer, so the compute buffer is the largest of the graphs' high-water marks.
- ``ggml/src/ggml-alloc.c`` (the graph allocator, "gallocr"): the graph's inputs (leafs first, in the order the
  graph found them) are allocated, then each node in order; a node whose op may work in place
  (``ggml_op_can_inplace``) takes over a parent that has no other consumer and the same layout; a tensor is freed
  when its last consumer has run (graph outputs never); free blocks are best-fit, merged with their neighbours, and
  every size is aligned to the buffer type's alignment (32 bytes on the CPU). The buffer is the high-water mark.
- ``src/llama-graph.cpp`` and ``src/models/<arch>.cpp``: the graph itself (``build_inp_embd``, ``build_attn``,
  ``build_attn_mha``: with flash attention off, kq = n_kv x n_tokens x n_head f32, soft-maxed in place, then
  kqv; with it on, one ``ggml_flash_attn_ext`` node), ``build_ffn``, the output norm and the logits.
- ``llama_context::output_reserve`` (at creation, for n_seq_max outputs): n_vocab x n_seq_max x 4 bytes of
  logits (+ n_embd x n_seq_max x 4 with embeddings), in host memory.

``estimate`` builds the same graphs, tensor by tensor (shape, strides, type, sources, views, the inputs and
outputs), with ggml's own ordering (``ggml_build_forward_expand``: sources first, left to right), and runs the same
allocator over them (``gallocr_high_water``). Replayed: llama (and llama-family files with attention biases),
qwen2, qwen3, gemma3 (interleaved window layers) and deepseek2 with MLA and dense FFNs; quantized caches with
llama.cpp's Hadamard rotation, f32 caches cast for flash attention, split and unified streams. Anything else is
None ("n/a"), never a guess. This is the CPU backend's buffer; CUDA and Metal reserve through the same allocator
but place some nodes differently (and their kernels may ask for other sizes): not checked yet.
tests/test_llamacpp_compute.py checks every figure against the real llama.cpp, byte for byte.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

#: ggml_op_can_inplace (ggml/src/ggml-alloc.c): the ops the allocator lets reuse a parent's memory.
INPLACE_OPS = frozenset({"FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL",
                         "DIV", "SQR", "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM",
                         "RMS_NORM_BACK", "CLAMP", "SOFT_MAX", "SOFT_MAX_BACK"})
CPU_ALIGNMENT = 32  # TENSOR_ALIGNMENT, ggml_backend_cpu_buffer_type_get_alignment
#: ggml type: (block, bytes per block)
TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "i32": (1, 4), "i64": (1, 8), "q8_0": (32, 34),
         "q4_0": (32, 18), "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24)}


def _row(type_: str, n: int) -> int:
    block, size = TYPES[type_]
    return n // block * size


@dataclass(eq=False)
class Tensor:
    """A ggml tensor as the allocator sees it: shape (ne), strides (nb), type, op, sources, view source, flags."""

    ne: tuple[int, int, int, int]
    type: str
    op: str = "NONE"
    src: tuple = ()
    view_src: "Tensor | None" = None
    nb: tuple[int, int, int, int] = ()
    external: bool = False  # weights and the KV cache: memory of their own, never the compute buffer's
    view_offs: int = 0  # a view's byte offset into its source
    is_input: bool = False
    is_output: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if not self.nb:
            block, size = TYPES[self.type]
            nb0 = size
            nb1 = _row(self.type, self.ne[0])
            self.nb = (nb0, nb1, nb1 * self.ne[1], nb1 * self.ne[1] * self.ne[2])

    @functools.cached_property
    def nbytes(self) -> int:
        """ggml_nbytes."""
        if any(n == 0 for n in self.ne):
            return 0
        block = TYPES[self.type][0]
        if block == 1:
            return TYPES[self.type][1] + sum((self.ne[i] - 1) * self.nb[i] for i in range(4))
        return self.ne[0] * self.nb[0] // block + sum((self.ne[i] - 1) * self.nb[i] for i in range(1, 4))


def _shape(*ne: int) -> tuple[int, int, int, int]:
    return tuple(list(ne) + [1] * (4 - len(ne)))  # type: ignore[return-value]


class Graph:
    """A ggml context and a cgraph: tensors made by the ops below, nodes and leafs in ggml's visiting order."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()

    # -- tensors
    def weight(self, *ne: int, type_: str = "f16", name: str = "") -> Tensor:
        return Tensor(_shape(*ne), type_, external=True, name=name)

    def input(self, type_: str, *ne: int, name: str = "") -> Tensor:
        return Tensor(_shape(*ne), type_, is_input=True, name=name)

    def new(self, op: str, type_: str, ne, *src: Tensor | None) -> Tensor:
        return Tensor(tuple(ne), type_, op, tuple(src))

    def view(self, a: Tensor, op: str, ne, nb) -> Tensor:
        return Tensor(tuple(ne), a.type, op, (a,), a.view_src or a, tuple(nb))

    # -- ops (ggml.c)
    def get_rows(self, a: Tensor, b: Tensor) -> Tensor:
        return self.new("GET_ROWS", "f32" if a.type != "i32" else "i32", (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), a, b)

    def unary_like(self, op: str, a: Tensor, *src: Tensor | None) -> Tensor:
        return self.new(op, a.type, a.ne, a, *src)

    def mul_mat(self, a: Tensor, b: Tensor) -> Tensor:
        return self.new("MUL_MAT", "f32", (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), a, b)

    def reshape(self, a: Tensor, *ne: int) -> Tensor:
        t = Tensor(_shape(*ne), a.type)  # contiguous strides
        return self.view(a, "RESHAPE", t.ne, t.nb)

    def view_nd(self, a: Tensor, ne, nb_123, offset: int = 0) -> Tensor:
        ne = _shape(*ne)
        nb = (TYPES[a.type][1],) + tuple(nb_123) + tuple(0 for _ in range(3 - len(nb_123)))
        nb = list(nb)
        for i in range(1 + len(nb_123), 4):  # ggml_view_impl: the unused strides follow the last one
            nb[i] = nb[i - 1] * ne[i - 1]
        t = self.view(a, "VIEW", ne, nb)
        t.view_offs = a.view_offs + offset
        return t

    def concat(self, a: Tensor, b: Tensor, dim: int = 0) -> Tensor:
        ne = list(a.ne)
        ne[dim] += b.ne[dim]
        return self.new("CONCAT", a.type, tuple(ne), a, b)

    def permute(self, a: Tensor, *axes: int) -> Tensor:
        ne, nb = [0] * 4, [0] * 4
        for i, ax in enumerate(axes):
            ne[ax], nb[ax] = a.ne[i], a.nb[i]
        return self.view(a, "PERMUTE", ne, nb)

    def transpose(self, a: Tensor) -> Tensor:
        return self.view(a, "TRANSPOSE", (a.ne[1], a.ne[0], a.ne[2], a.ne[3]), (a.nb[1], a.nb[0], a.nb[2], a.nb[3]))

    def cont(self, a: Tensor, *ne: int) -> Tensor:
        return self.new("CONT", a.type, _shape(*ne) if ne else a.ne, a)

    def cast(self, a: Tensor, type_: str) -> Tensor:
        t = Tensor(a.ne, type_, "CPY", (a,))
        t.src = (a, t)
        return t

    def set_rows(self, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        return Tensor(a.ne, a.type, "SET_ROWS", (a, b, c), a.view_src or a, a.nb)

    # -- ggml_build_forward_expand
    def expand(self, t: Tensor) -> None:
        stack = [(t, 0)]
        while stack:  # iterative ggml_visit_parents_graph: sources left to right, then the tensor
            node, i = stack.pop()
            if i == 0:
                if id(node) in self._seen:
                    continue
                self._seen.add(id(node))
            if i < len(node.src):
                stack.append((node, i + 1))
                s = node.src[i]
                if s is not None and id(s) not in self._seen:
                    stack.append((s, 0))
                continue
            (self.leafs if node.op == "NONE" else self.nodes).append(node)


# --------------------------------------------------------------------------------------------
# ggml-alloc.c: ggml_dyn_tallocr and ggml_gallocr_alloc_graph_impl, for one buffer (the CPU's)


class _DynAllocator:
    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.free: list[list[int]] = [[0, 1 << 62]]  # [offset, size], sorted by offset; the last one is endless
        self.max_size = 0

    def _align(self, n: int) -> int:
        return (n + self.alignment - 1) // self.alignment * self.alignment

    def alloc(self, size: int) -> int:
        size = self._align(size)
        best, best_size = -1, None
        for i, (_, bsize) in enumerate(self.free[:-1]):  # best fit among all but the last block
            if bsize >= size and (best_size is None or bsize <= best_size):
                best, best_size = i, bsize
        if best == -1:
            best = len(self.free) - 1
        block = self.free[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.free[best]
        self.max_size = max(self.max_size, offset + size)
        return offset

    def free_bytes(self, offset: int, size: int) -> None:
        size = self._align(size)
        for i, block in enumerate(self.free):
            if block[0] + block[1] == offset:
                block[1] += size
                if i + 1 < len(self.free) and block[0] + block[1] == self.free[i + 1][0]:
                    block[1] += self.free[i + 1][1]
                    del self.free[i + 1]
                return
            if offset + size == block[0]:
                block[0] = offset
                block[1] += size
                if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == block[0]:
                    self.free[i - 1][1] += block[1]
                    del self.free[i]
                return
        pos = 0
        while pos < len(self.free) and self.free[pos][0] < offset:
            pos += 1
        self.free.insert(pos, [offset, size])


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def gallocr_high_water(graph: Graph, alignment: int = CPU_ALIGNMENT) -> int:
    """The bytes ``ggml_gallocr_reserve_n`` asks of one buffer type for ``graph`` (its chunk's max_size).

    ggml_gallocr_alloc_graph_impl step by step: the leafs, then the inputs (as the nodes name them), then each node
    after its sources, freeing a source at its last consumer; the allocator's per-tensor state (hash_node: children,
    views, allocated, offset) is kept on the tensors themselves (a fresh graph each time)."""
    alloc = _DynAllocator(alignment)
    everything = list(graph.leafs) + list(graph.nodes)
    for t in everything:
        for x in (t, *[s for s in t.src if s is not None], t.view_src):
            if x is not None:
                x.n_children = x.n_views = 0
                x.allocated = False
                x.offset = -1

    def allocate(node: Tensor) -> None:
        if node.external or node.allocated or node.view_src is not None:
            return
        node.allocated = True
        if node.op in INPLACE_OPS:
            for parent in node.src:
                if parent is None or not parent.allocated:
                    continue
                if parent.is_output or (parent.view_src is not None and parent.view_src.is_output):
                    continue
                if not _same_layout(node, parent):
                    continue
                if parent.n_children == 1 and parent.n_views == 0:
                    vs = parent.view_src
                    if vs is not None:
                        if vs.n_views == 1 and vs.n_children == 0 and parent.view_offs == 0:  # data == view_src->data
                            node.offset = parent.offset
                            parent.allocated = False
                            vs.allocated = False
                            _free_extra(alloc, node, vs, vs.offset)
                            return
                    else:
                        node.offset = parent.offset
                        parent.allocated = False
                        _free_extra(alloc, node, parent, parent.offset)
                        return
        node.offset = alloc.alloc(node.nbytes)

    def free(node: Tensor) -> None:
        if node.is_output:
            return
        alloc.free_bytes(node.offset, node.nbytes)
        node.allocated = False

    for leaf in graph.leafs:
        allocate(leaf)
    for node in graph.nodes:
        if node.view_src is not None and node.op != "NONE":
            node.view_src.n_views += 1
        if node.is_input:
            allocate(node)
        for s in node.src:
            if s is None:
                continue
            s.n_children += 1
            if s.is_input:
                allocate(s)
    for node in graph.nodes:
        for s in node.src:
            if s is not None:
                allocate(s)
        allocate(node)
        for parent in node.src:
            if parent is None:
                continue
            parent.n_children -= 1
            if parent.n_children == 0 and parent.n_views == 0:
                vs = parent.view_src
                if vs is not None:
                    vs.n_views -= 1
                    if vs.n_views == 0 and vs.n_children == 0 and vs.allocated:
                        free(vs)
                elif parent.allocated:
                    free(parent)
    return alloc.max_size


def _free_extra(alloc: _DynAllocator, node: Tensor, parent: Tensor, parent_offset: int) -> None:
    """ggml_gallocr_free_extra_space: an in-place node smaller than its parent gives back the tail."""
    psize, nsize = alloc._align(parent.nbytes), alloc._align(node.nbytes)
    if psize > nsize:
        alloc.free_bytes(parent_offset + nsize, psize - nsize)


# --------------------------------------------------------------------------------------------
# the model's graph (src/models/llama.cpp, gemma3.cpp; llama-graph.cpp)


@dataclass(frozen=True)
class GraphShape:
    """What llama.cpp's graph of a decoder needs to know about the model."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_k: tuple[int, ...]
    head_v: tuple[int, ...]
    n_ff: tuple[int, ...]
    n_vocab: int
    swa: tuple[bool, ...]
    has_kv: tuple[bool, ...]
    #: deepseek2's MLA (kv_lora_rank, rope, nope, v_head): the latent cache, Q absorbed (src/models/deepseek2.cpp)
    mla: tuple[int, int, int, int] | None = None
    qkv_bias: tuple[bool, bool, bool, bool] = (False, False, False, False)  # Q, K, V, output biases (qwen2...)
    qk_norm: bool = False  # per-head RMS norms of Q and K before RoPE (qwen3)


@dataclass(frozen=True)
class CacheGeom:
    """One of the KV caches the graph reads (full or window): cells per stream, streams, types, V transposed."""

    cells: int
    streams: int
    type_k: str
    type_v: str
    v_trans: bool
    v_width_max: int  # n_embd_v_gqa_max (the transposed V pads every layer's row to it)
    rot_k: int = 0  # the Hadamard rotation's size for a quantized K cache (attn_rot_k), 0: none
    rot_v: int = 0


class _Ctx:
    """One reserved graph: ``llm_graph_context`` for n_tokens tokens in n_seqs sequences."""

    def __init__(self, shape: GraphShape, n_tokens: int, n_seqs: int, n_outputs: int, flash: bool, unified: bool,
                 caches: dict[str, CacheGeom]):
        self.s, self.g = shape, Graph()
        self.T, self.n_seqs, self.n_outputs, self.flash = n_tokens, n_seqs, n_outputs, flash
        self.n_stream = 1 if unified else n_seqs
        self.caches = caches
        self.inputs: dict[str, dict[str, Tensor]] = {}
        self._cache_tensors: dict[tuple[str, int], tuple[Tensor, Tensor]] = {}

    def w(self, *ne: int) -> Tensor:
        return self.g.weight(*ne)

    def cache_inputs(self, which: str) -> dict[str, Tensor]:
        """build_attn_inp_kv(_iswa): k_idxs, v_idxs and the mask of one cache (made once, shared by its layers),
        and the Hadamard matrices of a rotated (quantized) cache."""
        if which not in self.inputs:
            c = self.caches[which]
            T = self.T
            v_idx = T * c.v_width_max if c.v_trans else T
            self.inputs[which] = {
                "k_rot": self.g.input("f32", c.rot_k, c.rot_k, name=f"k_rot_{which}") if c.rot_k else None,
                "v_rot": self.g.input("f32", c.rot_v, c.rot_v, name=f"v_rot_{which}") if c.rot_v else None,
                "k_idxs": self.g.input("i64", T, name=f"k_idxs_{which}"),
                "v_idxs": self.g.input("i64", v_idx, name=f"v_idxs_{which}"),
                # build_attn_inp_kq_mask: f16 for flash attention, f32 without
                "mask": self.g.input("f16" if self.flash else "f32", c.cells, T // self.n_stream, 1, self.n_stream,
                                     name=f"kq_mask_{which}"),
            }
        return self.inputs[which]

    def cache(self, which: str, il: int) -> tuple[Tensor, Tensor]:
        key = (which, il)
        if key not in self._cache_tensors:
            c, s = self.caches[which], self.s
            k_w = s.head_k[il] * s.n_head_kv[il]
            v_w = c.v_width_max if c.v_trans else s.head_v[il] * s.n_head_kv[il]
            k = Tensor(_shape(k_w, c.cells, c.streams), c.type_k, external=True)
            v = Tensor(_shape(v_w, c.cells, c.streams), c.type_v, external=True)
            self._cache_tensors[key] = (k, v)
        return self._cache_tensors[key]

    def attention(self, il: int, which: str, q_cur: Tensor, k_cur: Tensor, v_cur: Tensor, wo: Tensor,
                  kq_scale_ops: int = 0) -> Tensor:
        """llm_graph_context::build_attn (the KV cache's) and build_attn_mha, then the output projection."""
        g, s, c = self.g, self.s, self.caches[which]
        inp = self.cache_inputs(which)
        if inp["k_rot"] is not None:  # llama_mul_mat_hadamard (src/llama-impl.h)
            q_cur = self.hadamard(q_cur, inp["k_rot"])
            k_cur = self.hadamard(k_cur, inp["k_rot"])
        if inp["v_rot"] is not None:
            v_cur = self.hadamard(v_cur, inp["v_rot"])
        # build_attn expands Q, V, K for one cache and Q, K, V for the two caches of a window model (-iswa)
        for t in ((q_cur, k_cur, v_cur) if "swa" in self.caches else (q_cur, v_cur, k_cur)):
            g.expand(t)
        k_cache, v_cache = self.cache(which, il)
        n_head_kv, hk, hv = s.n_head_kv[il], s.head_k[il], s.head_v[il]
        T = self.T
        # cpy_k
        kc = k_cache if c.streams == 1 else g.reshape(k_cache, k_cache.ne[0], c.cells * c.streams)
        k_view = g.view_nd(k_cur, (hk * n_head_kv, T), (k_cur.nb[2],))
        g.expand(g.set_rows(kc, k_view, inp["k_idxs"]))
        # cpy_v
        if not c.v_trans:
            v_view = g.view_nd(v_cur, (hv * n_head_kv, T), (v_cur.nb[2],))
            vc = v_cache if c.streams == 1 else g.reshape(v_cache, v_cache.ne[0], c.cells * c.streams)
            g.expand(g.set_rows(vc, v_view, inp["v_idxs"]))
        else:
            vcur = g.reshape(v_cur, hv * n_head_kv, T)
            if hv * n_head_kv < c.v_width_max:
                vcur = g.new("PAD", vcur.type, (c.v_width_max, T, 1, 1), vcur)
            v_flat = g.reshape(v_cache, 1, v_cache.ne[0] * v_cache.ne[1] * v_cache.ne[2])
            vcur = g.reshape(vcur, 1, vcur.ne[0] * vcur.ne[1])
            g.expand(g.set_rows(v_flat, vcur, inp["v_idxs"]))
        # get_k / get_v
        ns = c.streams
        k = g.view_nd(k_cache, (hk, n_head_kv, c.cells, ns),
                      (_row(c.type_k, hk), _row(c.type_k, hk * n_head_kv), _row(c.type_k, hk * n_head_kv * c.cells)))
        vw = v_cache.ne[0]
        if not c.v_trans:
            v = g.view_nd(v_cache, (hv, n_head_kv, c.cells, ns),
                          (_row(c.type_v, hv), _row(c.type_v, vw), _row(c.type_v, vw * c.cells)))
        else:
            v = g.view_nd(v_cache, (c.cells, n_head_kv, hv, ns),
                          (_row(c.type_v, c.cells * hv), _row(c.type_v, c.cells), _row(c.type_v, c.cells * vw)))
        # build_attn_mha
        q = q_cur
        q = g.view_nd(q, (q.ne[0], q.ne[1], q.ne[2] // self.n_stream, self.n_stream),
                      (q.nb[1], q.nb[2], q.nb[2] * (q.ne[2] // self.n_stream)))
        q = g.permute(q, 0, 2, 1, 3)
        k = g.permute(k, 0, 2, 1, 3)
        v = g.permute(v, 0, 2, 1, 3)
        if self.flash:
            if c.v_trans:
                v = g.transpose(v)
            # an f32 cache is cast to f16 for the kernel (ggml_cast: a CPY node whose second source is itself)
            if k.type == "f32":
                k = g.cast(k, "f16")
            if v.type == "f32":
                v = g.cast(v, "f16")
            cur = g.new("FLASH_ATTN_EXT", "f32", (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), q, k, v, inp["mask"])
            cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            kq = g.mul_mat(k, q)
            for _ in range(kq_scale_ops):  # soft-capping: scale, tanh, scale (all in place)
                kq = g.unary_like("SCALE", kq)
            kq = g.new("SOFT_MAX", "f32", kq.ne, kq, inp["mask"])
            if not c.v_trans:
                v = g.cont(g.transpose(v))
            kqv = g.mul_mat(v, kq)
            cur = g.permute(kqv, 0, 2, 1, 3)
            cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        if inp["v_rot"] is not None:
            cur = self.hadamard(cur, inp["v_rot"])
        return g.mul_mat(wo, cur)

    def hadamard(self, cur: Tensor, rot: Tensor) -> Tensor:
        """llama_mul_mat_hadamard: rows of rot's size multiplied by it, back in cur's shape (cur is contiguous)."""
        g, n = self.g, rot.ne[0]
        elements = cur.ne[0] * cur.ne[1] * cur.ne[2] * cur.ne[3]
        res = g.mul_mat(rot, g.reshape(cur, n, elements // n))
        return g.reshape(res, *cur.ne)


def _ffn(c: _Ctx, cur: Tensor, n_ff: int, gelu: bool = False) -> Tensor:
    g, s = c.g, c.s
    up = g.mul_mat(c.w(s.n_embd, n_ff), cur)
    gate = g.mul_mat(c.w(s.n_embd, n_ff), cur)
    act = g.new("GLU", "f32", gate.ne, gate, up)  # ggml_swiglu_split / ggml_geglu_split
    return g.mul_mat(c.w(n_ff, s.n_embd), act)


def _norm(c: _Ctx, x: Tensor) -> Tensor:
    g = c.g
    return g.new("MUL", "f32", x.ne, g.new("RMS_NORM", "f32", x.ne, x), c.w(x.ne[0]))


def _build_decoder(c: _Ctx) -> Graph:
    """src/models/llama.cpp and gemma3.cpp: embeddings, per layer norm / attention / residual / FFN / residual,
    the output norm and the logits."""
    g, s, T = c.g, c.s, c.T
    gemma = s.arch == "gemma3"
    # build_inp_embd: the token path and the embeddings path (an input of its own), selected
    tokens = g.input("i32", T, name="inp_tokens")
    embd_in = g.input("f32", s.n_embd, T, name="inp_embd")
    tok_embd = c.w(s.n_embd, s.n_vocab)
    x = g.get_rows(tok_embd, tokens)
    g.expand(x)  # ggml_build_forward_select: both paths are in the graph, the token path first
    g.expand(embd_in)
    if gemma:  # gemma3.cpp: the embeddings scaled by sqrt(n_embd)
        x = g.unary_like("SCALE", x)
    pos = g.input("i32", T, name="inp_pos")
    out_ids = g.input("i32", c.n_outputs, name="inp_out_ids")
    inpL = x
    for il in range(s.n_layer):
        which = "swa" if s.swa[il] and "swa" in c.caches else "full"
        inpSA = inpL
        cur = _norm(c, inpL)
        nh, nkv, hk, hv = s.n_head[il], s.n_head_kv[il], s.head_k[il], s.head_v[il]
        qkv = []
        for width, bias in ((nh * hk, s.qkv_bias[0]), (nkv * hk, s.qkv_bias[1]), (nkv * hv, s.qkv_bias[2])):
            t = g.mul_mat(c.w(s.n_embd, width), cur)
            if bias:  # build_qkv: ggml_add(Qcur, wq_b), in place
                t = g.new("ADD", "f32", t.ne, t, c.w(width))
            qkv.append(t)
        q = g.reshape(qkv[0], hk, nh, T)
        k = g.reshape(qkv[1], hk, nkv, T)
        v = g.reshape(qkv[2], hv, nkv, T)
        if s.qk_norm and not gemma:  # qwen3: Q and K normed per head, then RoPE
            q = g.new("ROPE", "f32", q.ne, _norm(c, q), pos)
            k = g.new("ROPE", "f32", k.ne, _norm(c, k), pos)
        elif gemma:  # per-head Q/K norms before RoPE
            q = _norm(c, q)
            q = g.new("ROPE", "f32", q.ne, q, pos)
            k = _norm(c, k)
            k = g.new("ROPE", "f32", k.ne, k, pos)
            q = g.unary_like("SCALE", q)  # gemma3 scales Q by hparams.f_attention_scale
        else:
            q = g.new("ROPE", "f32", q.ne, q, pos)
            k = g.new("ROPE", "f32", k.ne, k, pos)
        cur = c.attention(il, which, q, k, v, c.w(nh * hv, s.n_embd))
        if s.qkv_bias[3]:  # build_attn: ggml_add(cur, wo_b)
            cur = g.new("ADD", "f32", cur.ne, cur, c.w(s.n_embd))
        if il == s.n_layer - 1:  # only the rows that are output go on
            cur = g.get_rows(cur, out_ids)
            inpSA = g.get_rows(inpSA, out_ids)
        if gemma:
            cur = _norm(c, cur)  # attn_post_norm
        ffn_inp = g.new("ADD", "f32", cur.ne, cur, inpSA)
        cur = _norm(c, ffn_inp)
        cur = _ffn(c, cur, s.n_ff[il])
        if gemma:
            cur = _norm(c, cur)
        cur = g.new("ADD", "f32", cur.ne, cur, ffn_inp)
        inpL = cur
    cur = _norm(c, inpL)
    cur.is_output = True  # result_norm (t_embd)
    logits = g.mul_mat(c.w(s.n_embd, s.n_vocab), cur)
    logits.is_output = True  # result_output (t_logits)
    g.expand(logits)
    return g


def _build_mla(c: _Ctx) -> Graph:
    """src/models/deepseek2.cpp with MLA (the latent cache, build_attn_inp_k / build_attn for a K-only cache), Q from
    one projection, dense FFNs; build_attn_mha with v_mla (the V up-projection after the attention)."""
    g, s, T = c.g, c.s, c.T
    kvl, rope, nope, v_head = s.mla
    k_mla = nope + rope
    tokens = g.input("i32", T, name="inp_tokens")
    embd_in = g.input("f32", s.n_embd, T, name="inp_embd")
    x = g.get_rows(c.w(s.n_embd, s.n_vocab), tokens)
    g.expand(x)
    g.expand(embd_in)
    pos = g.input("i32", T, name="inp_pos")
    cache = c.caches["full"]
    k_idxs = g.input("i64", T, name="k_idxs")
    mask = g.input("f16" if c.flash else "f32", cache.cells, T // c.n_stream, 1, c.n_stream, name="kq_mask")
    out_ids = g.input("i32", c.n_outputs, name="inp_out_ids")
    inpL = x
    f32 = TYPES["f32"][1]
    for il in range(s.n_layer):
        nh = s.n_head[il]
        inpSA = inpL
        cur = _norm(c, inpL)
        q = g.reshape(g.mul_mat(c.w(s.n_embd, nh * k_mla), cur), k_mla, nh, T)
        kv_pe = g.mul_mat(c.w(s.n_embd, kvl + rope), cur)
        row = (kvl + rope) * f32
        kv_cmpr = g.view_nd(kv_pe, (kvl, T), (row,))
        k_pe = g.view_nd(kv_pe, (rope, 1, T), (row, row), offset=kvl * f32)
        k_pe = g.new("ROPE", "f32", k_pe.ne, k_pe, pos)
        kv_cmpr = _norm(c, kv_cmpr)
        q_nope = g.view_nd(q, (nope, nh, T), (q.nb[1], q.nb[2]))
        q_pe = g.view_nd(q, (rope, nh, T), (q.nb[1], q.nb[2]), offset=nope * f32)
        q_pe = g.new("ROPE", "f32", q_pe.ne, q_pe, pos)
        q_nope = g.permute(q_nope, 0, 2, 1, 3)
        absorbed = g.permute(g.mul_mat(c.w(nope, kvl, nh), q_nope), 0, 2, 1, 3)
        q_cur = g.concat(absorbed, q_pe)
        kv_cmpr = g.reshape(kv_cmpr, kvl, 1, T)
        k_cur = g.concat(kv_cmpr, k_pe)
        v_cur = kv_cmpr
        for t in (q_cur, v_cur, k_cur):
            g.expand(t)
        k_cache = c._cache_tensors.get(("full", il))
        if k_cache is None:
            k_cache = Tensor(_shape(kvl + rope, cache.cells, cache.streams), cache.type_k, external=True)
            c._cache_tensors[("full", il)] = k_cache
        kc = k_cache if cache.streams == 1 else g.reshape(k_cache, kvl + rope, cache.cells * cache.streams)
        g.expand(g.set_rows(kc, g.view_nd(k_cur, (kvl + rope, T), (k_cur.nb[2],)), k_idxs))
        krow = _row(cache.type_k, kvl + rope)
        k = g.view_nd(k_cache, (kvl + rope, 1, cache.cells, cache.streams), (krow, krow, krow * cache.cells))
        v = g.view_nd(k, (kvl, 1, cache.cells, cache.streams), (k.nb[1], k.nb[2], k.nb[3]))
        # build_attn_mha
        qv = g.view_nd(q_cur, (q_cur.ne[0], q_cur.ne[1], T // c.n_stream, c.n_stream),
                       (q_cur.nb[1], q_cur.nb[2], q_cur.nb[2] * (T // c.n_stream)))
        qv = g.permute(qv, 0, 2, 1, 3)
        k = g.permute(k, 0, 2, 1, 3)
        v = g.permute(v, 0, 2, 1, 3)
        v_mla = c.w(kvl, v_head, nh)
        if c.flash:
            if k.type == "f32":
                k = g.cast(k, "f16")
            if v.type == "f32":
                v = g.cast(v, "f16")
            cur = g.new("FLASH_ATTN_EXT", "f32", (v.ne[0], qv.ne[2], qv.ne[1], qv.ne[3]), qv, k, v, mask)
            cur = g.permute(cur, 0, 2, 1, 3)
            cur = g.mul_mat(v_mla, cur)
            cur = g.permute(cur, 0, 2, 1, 3)
            cur = g.cont(cur)
            cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            kq = g.mul_mat(k, qv)
            kq = g.new("SOFT_MAX", "f32", kq.ne, kq, mask)
            v = g.cont(g.transpose(v))
            kqv = g.mul_mat(v, kq)
            kqv = g.mul_mat(v_mla, kqv)
            cur = g.permute(kqv, 0, 2, 1, 3)
            cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        g.expand(cur)
        cur = g.mul_mat(c.w(nh * v_head, s.n_embd), cur)
        if il == s.n_layer - 1:
            cur = g.get_rows(cur, out_ids)
            inpSA = g.get_rows(inpSA, out_ids)
        ffn_inp = g.new("ADD", "f32", cur.ne, cur, inpSA)
        cur = _ffn(c, _norm(c, ffn_inp), s.n_ff[il])
        inpL = g.new("ADD", "f32", cur.ne, cur, ffn_inp)
    cur = _norm(c, inpL)
    cur.is_output = True  # h_nextn, result_norm
    logits = g.mul_mat(c.w(s.n_embd, s.n_vocab), cur)
    logits.is_output = True
    g.expand(logits)
    return g


SUPPORTED = frozenset({"llama", "gemma3", "qwen2", "qwen3"})


def graph_shape(model) -> GraphShape | None:
    """The graph-relevant shape of a ``kvscope.core.model.gguf.GgufModel`` (None: an architecture whose graph is not replayed)."""
    n = model.n_layer
    mla = None
    if model.arch == "deepseek2":
        names = {t.name for t in model.tensors}
        # the graph replayed: MLA with Q from one projection (q_lora_rank 0) and dense FFNs (no expert router)
        if not model.is_mla or model.q_lora_rank or any(name.endswith("ffn_gate_inp.weight") for name in names):
            return None
        mla = (model.kv_lora_rank, model.n_rot, model.head_k_mla - model.n_rot, model.head_v_mla)
    elif model.arch not in SUPPORTED or model.is_mla:
        return None
    names = {t.name for t in model.tensors}
    if any(".ffn_gate_inp." in name or ".attn_qkv." in name for name in names):
        return None  # experts (MoE) or a fused QKV projection: graphs not replayed
    biases = tuple(all(f"blk.{il}.{t}.bias" in names for il in range(n))
                   for t in ("attn_q", "attn_k", "attn_v", "attn_output"))
    if any(any(f"blk.{il}.{t}.bias" in names for il in range(n)) != b
           for t, b in zip(("attn_q", "attn_k", "attn_v", "attn_output"), biases)):
        return None  # biases on some layers only
    if any(name.startswith("blk.") and name.endswith(".bias") and not any(f".{t}.bias" in name for t in
           ("attn_q", "attn_k", "attn_v", "attn_output")) for name in names):
        return None  # other biases (FFN): not replayed
    qk_norm = model.arch == "qwen3"
    return GraphShape(model.arch, n, model.n_embd, tuple(model.n_head[:n]), tuple(model.n_head_kv[:n]),
                      tuple(model.head_k_of(il) for il in range(n)), tuple(model.head_v_of(il) for il in range(n)),
                      tuple(model.n_ff[:n]), model.n_vocab, tuple(model.is_swa[:n]),
                      tuple(model.has_kv(il) for il in range(n)), mla=mla, qkv_bias=biases, qk_norm=qk_norm)


def _period(shape: GraphShape) -> int:
    """The smallest P for which every layer's shape repeats P layers later."""
    rows = list(zip(shape.n_head, shape.n_head_kv, shape.head_k, shape.head_v, shape.n_ff, shape.swa, shape.has_kv))
    for p in range(1, len(rows) + 1):
        if all(rows[i] == rows[i - p] for i in range(p, len(rows))):
            return p
    return len(rows)


def truncated(shape: GraphShape, n: int) -> GraphShape:
    """The model with ``n`` layers: its first period of layers, then its last n - period (the same layers last)."""
    p, total = _period(shape), shape.n_layer
    if n >= total:
        return shape
    cut = lambda t: t[:p] + t[total - (n - p):]  # noqa: E731
    return GraphShape(shape.arch, n, shape.n_embd, cut(shape.n_head), cut(shape.n_head_kv), cut(shape.head_k),
                      cut(shape.head_v), cut(shape.n_ff), shape.n_vocab, cut(shape.swa), cut(shape.has_kv),
                      mla=shape.mla, qkv_bias=shape.qkv_bias, qk_norm=shape.qk_norm)


def _mark(shape: GraphShape, n_tokens: int, n_seqs: int, n_outputs: int, flash: bool, unified: bool,
          caches: dict[str, CacheGeom]) -> int:
    ctx = _Ctx(shape, n_tokens, n_seqs, n_outputs, flash, unified, caches)
    return gallocr_high_water(_build_mla(ctx) if shape.mla else _build_decoder(ctx))


def _converged_mark(shape: GraphShape, *args) -> int:
    """The high-water mark of a deep graph without replaying every layer: the allocator's state at a layer boundary
    settles once the layers repeat (a few periods in), after which more repeated layers add nothing. So the mark is
    taken on models of 1, 2, 3... periods (with the real last layers) until three in a row agree, or on the whole
    model if it is not deeper than that. Only a speed-up (an 80-layer graph in a few milliseconds):
    tests/test_llamacpp_compute.py checks it against the whole graph on generated shapes, and against the real
    llama.cpp on deep tiny models."""
    p, total = _period(shape), shape.n_layer
    n = p + total % p
    seen: list[int] = []
    while n < total:
        seen.append(_mark(truncated(shape, n), *args))
        if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]:
            return seen[-1]
        n += p
    return _mark(shape, *args)


def reserve_graphs(shape: GraphShape, n_tokens: int, n_seqs: int, n_outputs_max: int, flash: bool, unified: bool,
                   caches: dict[str, CacheGeom], shorten: bool = True) -> list[tuple[str, int]]:
    """llama_context::sched_reserve's graphs and each one's high-water mark: (label, bytes)."""
    pp_tokens = n_tokens
    if pp_tokens % n_seqs:  # graph_reserve: n_tokens rounded up to a multiple of n_seqs
        pp_tokens = (pp_tokens + n_seqs - 1) // n_seqs * n_seqs
    pp_outputs = min(n_tokens, n_outputs_max)
    out = []
    for label, t, o in (("prompt", pp_tokens, pp_outputs), ("token", n_seqs, n_seqs)):
        args = (t, n_seqs, o, flash, unified, caches)
        out.append((label, _converged_mark(shape, *args) if shorten else _mark(shape, *args)))
    return out


def output_buffer_bytes(n_vocab: int, n_seq_max: int, n_embd: int = 0, embeddings: bool = False) -> int:
    """llama_context::output_reserve(n_seq_max) at creation: logits (and embeddings) for n_seq_max outputs, f32."""
    return (n_vocab + (n_embd if embeddings else 0)) * n_seq_max * 4


@dataclass(frozen=True)
class ComputeEstimate:
    """The compute buffer llama.cpp reserves (None where KV Scope does not replay the graph, with the reason)."""

    bytes: int | None
    graphs: tuple[tuple[str, int], ...] = ()  # (graph, its high-water mark)
    why_not: str = ""


def shape_of_spec(spec) -> GraphShape | None:
    """A config's spec as llama.cpp's graph of the same model would see it (llama-family and gemma3 only)."""
    arch = {"llama": "llama", "mistral": "llama", "gemma3": "gemma3", "gemma3_text": "gemma3", "qwen2": "qwen2",
            "qwen3": "qwen3"}.get(spec.model_type)
    if arch is None or spec.is_mla or spec.layer_kv is not None:
        return None
    n = spec.num_layers
    window = bool(spec.sliding_window)
    config = spec.config if isinstance(spec.config, dict) else {}
    # Qwen2 has Q/K/V biases (its attention always), others where the config says attention_bias
    bias = arch == "qwen2" or bool(config.get("attention_bias"))
    return GraphShape(arch, n, spec.hidden_size, (spec.num_query_heads,) * n, (spec.num_kv_heads,) * n,
                      (spec.head_dim,) * n, (spec.v_head_dim or spec.head_dim,) * n, (spec.intermediate_size,) * n,
                      spec.vocab_size, tuple(window and t == "sliding_attention" for t in spec.layer_types),
                      (True,) * n, qkv_bias=(bias, bias, bias, bias and arch != "qwen2"), qk_norm=arch == "qwen3")


def estimate(shape: GraphShape | None, *, n_ubatch: int, n_batch: int, n_seq_max: int, flash: bool, unified: bool,
             caches: dict[str, CacheGeom], why_not: str = "") -> ComputeEstimate:
    """``sched_reserve``'s compute buffer for the CPU backend: the largest high-water mark of its graphs."""
    if shape is None:
        return ComputeEstimate(None, (), why_not or "this architecture's graph is not replayed by KV Scope yet")
    if not all(shape.has_kv):
        return ComputeEstimate(None, (), "layers that reuse another layer's K/V are not replayed yet")
    graphs = _graphs(shape, n_ubatch, n_batch, n_seq_max, flash, unified, tuple(sorted(caches.items())))
    return ComputeEstimate(max(b for _, b in graphs), graphs)


@functools.lru_cache(maxsize=4096)
def _graphs(shape: GraphShape, n_ubatch: int, n_batch: int, n_seq_max: int, flash: bool, unified: bool,
            caches: tuple) -> tuple[tuple[str, int], ...]:
    """Memoised: the calculator asks again for the same context as a slider moves and a search narrows."""
    rotated = {name: _with_rotation(shape, name, c) for name, c in caches}
    return tuple(reserve_graphs(shape, n_ubatch, n_seq_max, n_batch, flash, unified, rotated))


def _with_rotation(shape: GraphShape, which: str, c: CacheGeom) -> CacheGeom:
    """llama_kv_cache's constructor: a quantized K (V) cache whose layers share one head size, with the model's head
    size a multiple of 64, is Hadamard-rotated (attn_rot_k / attn_rot_v; LLAMA_ATTN_ROT_DISABLE turns it off): K by
    the largest power of two from 64 up that divides the head size, V by 64."""
    from dataclasses import replace

    layers = [il for il in range(shape.n_layer) if shape.swa[il] == (which == "swa")]
    full = [il for il in range(shape.n_layer) if not shape.swa[il]] or [0]
    heads_k = {shape.head_k[il] for il in layers}
    heads_v = {shape.head_v[il] for il in layers}
    rot_k = rot_v = 0
    if TYPES[c.type_k][0] > 1 and len(heads_k) == 1 and shape.head_k[full[0]] % 64 == 0:
        (n,) = heads_k
        rot_k = 64
        while n % (rot_k * 2) == 0:
            rot_k *= 2
    if TYPES[c.type_v][0] > 1 and len(heads_v) == 1 and shape.head_v[full[0]] % 64 == 0:
        rot_v = 64
    return replace(c, rot_k=rot_k, rot_v=rot_v)
