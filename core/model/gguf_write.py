"""Write GGUF files with llama.cpp's own ``gguf`` package: the embedded model as a GGUF, and tiny models of any layout.

Two uses, one writer:

- ``embedded_gguf()``: the embedded demo model (a 4-layer Llama, ``kvscope.core.model.embedded``) converted to a GGUF file
  in the user's cache, so ``run --runtime llama.cpp`` and the window's llama.cpp source work with no download.
  The conversion is what llama.cpp's ``convert_hf_to_gguf.py`` does for a Llama: tensor names from
  ``gguf.TensorNameMap``, Q and K rows permuted for llama.cpp's rotary layout, 1-D norms in F32, the
  byte-level BPE vocabulary as a ``gpt2`` tokenizer with its merges.
- ``write_gguf()``: any architecture's metadata and tensors, for the tests that load tiny GQA, sliding-window
  and MLA models into the real llama.cpp.

A GGUF is written to a temporary name in the target folder and renamed into place, so a reader never sees
half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from kvscope.core.model.embedded import embedded_model_dir
from kvscope.core.model.spec import _cache_dir

#: Bump when the embedded model's GGUF would change (names, types, metadata).
GGUF_EXPORT_VERSION = 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half Q/K rows to llama.cpp's interleaved rotary layout (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, metadata: Mapping[str, Any], tensors: Iterable[tuple[str, np.ndarray]],
               vocab: "GgufVocab | None" = None, quant: Mapping[str, str] | None = None) -> Path:
    """Write ``path``: ``metadata`` keys without the ``{arch}.`` prefix (``block_count``, ``attention.head_count``;
    ``general.*`` and ``tokenizer.*`` keys are written as given), ``tensors`` as (GGUF name, array); arrays of float16/float32 are stored as such,
    ``quant`` maps a tensor name to a ggml type name (``q8_0``...) to quantize it with ``gguf.quants``."""
    import gguf

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        for key, value in metadata.items():
            full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
            _add(writer, full, value)
        if vocab is not None:
            vocab.write(writer)
        for name, array in tensors:
            qtype = (quant or {}).get(name)
            if qtype:
                kind = gguf.GGMLQuantizationType[qtype.upper()]
                data = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), kind)
                writer.add_tensor(name, data, raw_dtype=kind)
            else:
                writer.add_tensor(name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, path)
    return path


def _add(writer, key: str, value: Any) -> None:
    import gguf

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if 0 <= value < 2**32 else writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        items = list(value)
        if items and all(isinstance(v, bool) for v in items):
            writer.add_key_value(key, items, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
        elif all(isinstance(v, int) for v in items):
            writer.add_key_value(key, items, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            writer.add_array(key, items)
    else:
        raise TypeError(f"GGUF metadata {key}: cannot write a {type(value).__name__}")


class GgufVocab:
    """A byte-level BPE vocabulary as llama.cpp's ``gpt2`` tokenizer (tokens in id order, merges, specials)."""

    def __init__(self, tokens: list[str], merges: list[str], special: Mapping[int, str], bos: int, eos: int,
                 pad: int | None = None):
        self.tokens, self.merges, self.special = tokens, merges, dict(special)
        self.bos, self.eos, self.pad = bos, eos, pad

    @classmethod
    def from_tokenizer_json(cls, path: Path, bos: int, eos: int, pad: int | None = None) -> "GgufVocab":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        model = data["model"]
        vocab: dict[str, int] = dict(model["vocab"])
        special = {}
        for added in data.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
            if added.get("special"):
                special[added["id"]] = added["content"]
        tokens = [""] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            tokens[i] = text
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        return cls(tokens, merges, special, bos, eos, pad)

    @classmethod
    def tiny(cls, size: int) -> "GgufVocab":
        """``size`` byte-level tokens and three merges: enough for llama.cpp to load and generate (tests)."""
        from tokenizers import pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        specials = ["<pad>", "<s>", "</s>"]
        tokens = specials + alphabet
        tokens += [f"<extra_{i}>" for i in range(max(0, size - len(tokens)))]
        merges = ["Ġ t", "h e", "Ġ a"]  # llama.cpp's gpt2 vocabulary needs merges, and these pairs are in the alphabet
        return cls(tokens[:size], merges, {0: "<pad>", 1: "<s>", 2: "</s>"}, bos=1, eos=2, pad=0)

    def write(self, writer) -> None:
        import gguf

        types = [gguf.TokenType.CONTROL if i in self.special else gguf.TokenType.NORMAL for i in range(len(self.tokens))]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(self.tokens)
        writer.add_token_types(types)
        if self.merges:
            writer.add_token_merges(self.merges)
        writer.add_bos_token_id(self.bos)
        writer.add_eos_token_id(self.eos)
        if self.pad is not None:
            writer.add_pad_token_id(self.pad)
        writer.add_add_bos_token(True)


def export_llama_folder(folder: Path, out: Path, name: str = "", outtype: str = "f16") -> Path:
    """A Llama-architecture Hugging Face folder (config.json, model.safetensors, tokenizer.json) as a GGUF:
    matrices in ``outtype`` (f16 or f32, as convert_hf_to_gguf.py --outtype), 1-D tensors in F32."""
    import gguf
    from safetensors.numpy import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{folder}: only Llama folders convert here (model_type {cfg.get('model_type')!r})")
    layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    state = load_file(str(folder / "model.safetensors"))

    def tensors():
        for hf_name in sorted(state):
            array = state[hf_name]
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if hf_name.endswith("q_proj.weight"):
                array = _permute(array, heads)
            elif hf_name.endswith("k_proj.weight"):
                array = _permute(array, kv_heads)
            new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ValueError(f"{folder}: no GGUF name for tensor {hf_name}")
            yield new, array.astype(np.float32 if array.ndim == 1 or outtype == "f32" else np.float16)

    metadata = {
        "general.name": name or folder.name,
        "context_length": int(cfg.get("max_position_embeddings") or 4096),
        "embedding_length": hidden,
        "block_count": layers,
        "feed_forward_length": int(cfg["intermediate_size"]),
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": head_dim,
        "rope.freq_base": float(cfg.get("rope_theta") or 10000.0),
        "attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps") or 1e-5),
        "vocab_size": int(cfg["vocab_size"]),
    }
    vocab = GgufVocab.from_tokenizer_json(folder / "tokenizer.json", bos=int(cfg.get("bos_token_id", 1)),
                                          eos=int(cfg.get("eos_token_id", 2)), pad=cfg.get("pad_token_id"))
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(out, "llama", metadata, tensors(), vocab)


def embedded_gguf(progress=None) -> Path:
    """The embedded demo model as a GGUF in the cache (built once, named by a hash of what it is made from)."""
    folder = embedded_model_dir(progress)
    digest = hashlib.sha256()
    for part in ("config.json", "model.safetensors", "tokenizer.json"):
        digest.update((folder / part).read_bytes())
    digest.update(f"gguf-export-{GGUF_EXPORT_VERSION}".encode())
    out = _cache_dir() / "gguf" / f"embedded-{digest.hexdigest()[:16]}.gguf"
    if not out.is_file():
        if progress:
            progress("converting the embedded model to GGUF")
        export_llama_folder(folder, out, name="embedded demo model")
    return out
