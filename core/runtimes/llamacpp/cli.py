"""The llama.cpp runtime as the user reaches it, without importing llama.cpp: its command-line flags (llama-server's
spellings, on ``run`` and ``calc``), the options they give (``LlamaCppOptions``), its Source list entry and the
request the window's form makes. The registry (``kvscope.core.runtimes``) hands these out; nothing else names them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvscope.core.model.attention import SettingsError
from kvscope.core.model.request import RunForm, RunRequest
from kvscope.core.runtimes.base import SourceEntry

if TYPE_CHECKING:
    from kvscope.core.prediction.llamacpp import LlamaCppOptions

# The GGUF reader and llama.cpp's rules (kvscope.core.prediction.llamacpp: 0.3 s of imports) load when a llama.cpp
# request is made, not when ``run``'s or ``calc``'s parser gets these flags.

NAME = "llama.cpp"
#: ``-c`` when neither the command line nor the window's Max context (nor the model's store) sets it.
DEFAULT_CONTEXT = 4096
_MAX_COUNT = 2**31 - 1


def add_flags(parser: Any, command: str) -> dict[str, tuple[float, float, str]]:
    """llama.cpp's context options, spelled as llama-server's flags (``--runtime llama.cpp``): the KV types, flash
    attention, sequences, batches, offload; ``run`` also ``--context/-c``, ``calc`` ``--fit-target``, ``--no-dry-run``.
    Returns the whole-number flags' ranges."""
    g = parser.add_argument_group("--runtime llama.cpp (llama-server's flags)")
    if command == "run":
        g.add_argument("--context", "-c", default=None, metavar="N",
                       help="the context llama.cpp allocates, as llama-server's -c (default 4096; 0: the file's "
                            "trained context)")
    g.add_argument("--cache-type-k", "-ctk", default="f16", help="K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, "
                                                              "iq4_nl, q5_0, q5_1 (default f16)")
    g.add_argument("--cache-type-v", "-ctv", default="f16", help="V cache type, as --cache-type-k; quantized V needs "
                                                              "flash attention (default f16)")
    g.add_argument("--flash-attn", "-fa", default="auto", help="on | off | auto (default auto)")
    g.add_argument("--parallel", "-np", type=int, default=1, help="parallel sequences (default 1)")
    g.add_argument("--kv-unified", action="store_true", help="one KV buffer shared by all sequences")
    g.add_argument("--swa-full", action="store_true", help="full-size cache for sliding-window layers")
    g.add_argument("--ubatch-size", "-ub", type=int, default=512, help="physical batch size (default 512)")
    g.add_argument("--batch-size", "-b", type=int, default=2048, help="logical batch size (default 2048)")
    g.add_argument("--n-gpu-layers", "-ngl", type=int, default=-1, help="layers on the GPU (default: all)")
    g.add_argument("--no-kv-offload", action="store_true", help="keep the KV cache in system memory")
    ranges = {"parallel": (1, 256, "parallel sequences; llama.cpp's LLAMA_MAX_SEQ is 256"),
              "ubatch_size": (1, _MAX_COUNT, "tokens of llama.cpp's physical batch"),
              "batch_size": (1, _MAX_COUNT, "tokens of llama.cpp's logical batch"),
              "n_gpu_layers": (-1, _MAX_COUNT, "layers on the GPU; -1: all of them")}
    if command == "calc":
        g.add_argument("--fit-target", type=int, default=1024, metavar="MiB",
                       help="--gpu-memory: memory llama.cpp's --fit leaves free (default 1024, llama.cpp's)")
        g.add_argument("--no-dry-run", action="store_true",
                       help="KV Scope's replay only, without llama.cpp's own dry run of the GGUF (no_alloc, in a child "
                            "process; on by default where llama.cpp is installed)")
        ranges["fit_target"] = (0, 1 << 24, "MiB llama.cpp's --fit leaves free")
    return ranges


def options_from_args(args: Any, n_ctx: int) -> "LlamaCppOptions":
    """llama.cpp's context options from the command line's llama-server flags (``run`` and ``calc``)."""
    from kvscope.core.prediction.llamacpp import LlamaCppOptions

    return LlamaCppOptions(n_ctx=n_ctx, n_seq_max=args.parallel, kv_unified=args.kv_unified, type_k=args.cache_type_k,
                           type_v=args.cache_type_v, flash_attn=args.flash_attn, swa_full=args.swa_full,
                           n_batch=args.batch_size, n_ubatch=args.ubatch_size, n_gpu_layers=args.n_gpu_layers,
                           offload_kqv=not args.no_kv_offload)


def cli_options(args: Any) -> "LlamaCppOptions":
    """The options of ``run --runtime llama.cpp``'s own flags: the model must be a GGUF (or the embedded model,
    converted); ``-c`` defaults to 4096, and 0 is the file's trained context (llama-server's)."""
    from kvscope.core.model.gguf import is_gguf_source
    from kvscope.core.model.spec import parse_tokens

    if args.model != "embedded" and not is_gguf_source(args.model):
        raise SettingsError(f"--runtime llama.cpp runs a .gguf file, and {args.model} is not one (convert a "
                            "transformers model with llama.cpp's convert_hf_to_gguf.py, or leave --model out for the "
                            "embedded model)")
    if args.max_context:
        raise SettingsError("--max-context is for transformers runs, not --runtime llama.cpp (llama.cpp's context "
                            "is --context)")
    if args.context is None:
        n_ctx = DEFAULT_CONTEXT
    else:  # -c 0, as llama-server takes it: the file's trained context
        n_ctx = 0 if str(args.context).strip() == "0" else parse_tokens(args.context)
    return options_from_args(args, n_ctx)


def source_entries() -> tuple[SourceEntry, ...]:
    """The Source list's "llama.cpp (GGUF)": the embedded model as a GGUF, or a .gguf file; installed GGUFs too."""
    return (SourceEntry(key="llamacpp", label="llama.cpp (GGUF)",
                        tooltip="llama.cpp: the embedded model as a GGUF, or a .gguf file, in the real llama.cpp "
                                "(its KV cache is reserved whole at load).",
                        file_field=True, placeholder="embedded model \u00b7 or /path/to/model.gguf",
                        file_filter="GGUF models (*.gguf);;All files (*)", installed_kinds=("gguf",),
                        kind_labels=(("gguf", "GGUF file"),), saved_as="gguf"),)  # the file chosen, as saved before


def form_request(form: RunForm) -> RunRequest:
    """A llama.cpp run of the form's GGUF (the embedded model converted where none is given): -c from Max context
    (else the model's store's, else 4096, as llama-server's), the K and V type from the Cache combo where it names
    one (else f16)."""
    from kvscope.core.prediction.llamacpp import CACHE_TYPES, LlamaCppOptions

    kv = form.cache if form.cache in CACHE_TYPES else "f16"
    options = LlamaCppOptions(n_ctx=form.max_context or form.store_context or DEFAULT_CONTEXT, type_k=kv, type_v=kv)
    common = {**form.common(), "source": form.source or "embedded"}
    return RunRequest(**common, runtime=NAME, options={NAME: options})


#: Tokens the embedded model's GGUF decodes in ``kvscope --self-test``, where llama.cpp is installed (the bundle has it).
SELF_TEST_TOKENS = 4


def self_test() -> tuple[RunRequest, Any]:
    """``kvscope --self-test``'s llama.cpp part: the embedded model's GGUF for a few tokens, the way ``run --runtime
    llama.cpp`` runs it, and the check of its decoded samples: llama.cpp's allocation at load (observed) equals the
    prediction at every token and the cells holding tokens grow with each (ValueError: the one line why not)."""
    from kvscope.core.prediction.llamacpp import LlamaCppOptions

    request = RunRequest(source="embedded", runtime=NAME, options={NAME: LlamaCppOptions(n_ctx=512)},
                         max_new_tokens=SELF_TEST_TOKENS, device="cpu")

    def check(decoded: list) -> str:
        used = [s.kv_bytes_held for s in decoded]
        for sample, held in zip(decoded, used):
            if sample.kv_bytes_reserved is None or sample.kv_bytes_reserved != sample.kv_bytes_predicted:
                raise ValueError(f"{NAME} token {sample.token}: KV reserved {sample.kv_bytes_reserved} B "
                                 f"!= predicted {sample.kv_bytes_predicted} B")
            if held is None or not 0 < held <= sample.kv_bytes_reserved:
                raise ValueError(f"{NAME} token {sample.token}: KV used {held} B is not within the "
                                 f"{sample.kv_bytes_reserved:,} B reserved")
        if any(b <= a for a, b in zip(used, used[1:])):
            raise ValueError(f"{NAME}'s used KV bytes did not grow with each token: {used}")
        return (f"{NAME} {len(decoded)} tokens, KV {decoded[-1].kv_bytes_reserved:,} B reserved == predicted, "
                f"{used[-1]:,} B used")
    return request, check
