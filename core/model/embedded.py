"""The embedded demo model: a small Llama trained on text about the KV cache, shipped with KV Scope.

KV Scope must run with no download and no user action. The demo model ships as a recipe and a
weights file: ``assets/presets/embedded.json`` (the architecture), ``assets/embedded/corpus.txt``
(English about KV caches, attention and memory, written for the project: the byte-level BPE
tokenizer is trained on it here, in about a second) and ``assets/embedded/model.safetensors`` (fp16
weights that ``scripts/train_embedded.py`` trained on the same corpus, once, offline).
``embedded_model_dir`` turns them into an ordinary Hugging Face model folder (``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json`` ...) in the user's cache,
once, deterministically: the same recipe gives byte-identical files on every machine, so the folder
name is a hash of it.

The weights file is checked against ``WEIGHTS_SHA256`` (and its safetensors header against the
preset's parameter names and shapes). When it is missing or damaged the build falls back to seeded
random weights, the model's label says "(random weights)" and ``EmbeddedBuild.note`` says why in
one line, which the loader reports; the memory figures are the same, only the text is nonsense.

The random weights' scale is chosen so that the nonsense is varied: with the usual tiny
initialisation (std 0.02 everywhere) a model with tied embeddings just echoes its last input token
forever, because the residual stream is dominated by that token's embedding and the output head is
the same matrix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvscope.core.base.errors import UNAVAILABLE, KVScopeError
from kvscope.core.base.longlived import collector_paused
from kvscope.core.model.spec import ASSETS, EMBEDDED_PRESET, PRESETS_DIR, _cache_dir

#: Bump when the build changes in a way the files would show (init scheme, tokenizer options...).
BUILDER_VERSION = 2
EMBEDDED_LABEL = "embedded demo model"
RANDOM_WEIGHTS_LABEL = "embedded demo model (random weights)"
PRESET_PATH = PRESETS_DIR / f"{EMBEDDED_PRESET}.json"
CORPUS_PATH = ASSETS / "embedded" / "corpus.txt"
#: The trained weights (fp16, tied head stored once), written by scripts/train_embedded.py.
WEIGHTS_PATH = ASSETS / "embedded" / "model.safetensors"
#: SHA-256 of the shipped WEIGHTS_PATH: any other bytes are damage, and the build falls back to random weights.
WEIGHTS_SHA256 = "f27f37857cd62f80fae2d70dcbcbfcf656f24d3c54c8f30faf9564ca715a7cc0"
SEED = 0

# Special tokens in id order; their ids must equal pad/bos/eos in the preset (checked at build).
PAD, BOS, EOS = "<pad>", "<s>", "</s>"

# Init scale (see module docstring). Embeddings are small and every linear layer has std
# gain/sqrt(fan_in), so each block adds O(1) per element to the residual: after 4 layers the input
# embedding is a few percent of the stream and no longer decides the next token. The final norm's
# weight then sets the logit spread (std about 2.5 over the vocabulary), so sampling at
# temperature 1 is neither uniform nor greedy. Measured with greedy decoding of 64 tokens from 12
# random prompts: 58-63 distinct tokens (the usual 0.02 init gives 1).
EMBED_STD = 0.02
LINEAR_GAIN = 2.0
FINAL_NORM_WEIGHT = 8.0

#: A ``.build-*`` folder older than this (seconds) is a leftover, whoever made it.
STALE_BUILD_S = 600.0
_BUILD_NAME = re.compile(r"^\.build-(?P<pid>\d+)@(?P<host>[A-Za-z0-9._]+)-[^-]*$")

# Files a finished folder holds; a folder missing any of them is rebuilt.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "kvscope_recipe.json")


class EmbeddedBuildError(KVScopeError, RuntimeError):
    """The embedded model could not be built (unwritable cache, missing recipe). Message is for the user."""

    category = UNAVAILABLE


def _read_corpus() -> str:
    # Normalise line endings so a Windows checkout (autocrlf) builds the same tokenizer and hash.
    return CORPUS_PATH.read_bytes().decode("utf-8").replace("\r\n", "\n")


def _read_preset() -> dict:
    return json.loads(PRESET_PATH.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class EmbeddedBuild:
    """A built embedded model folder and what its weights are.

    ``note`` is None for the trained weights; otherwise one line for the user saying why the
    weights are random (the shipped file is missing or damaged)."""

    folder: Path
    trained: bool
    label: str
    note: str | None = None


def _weights_name() -> str:
    try:
        return WEIGHTS_PATH.relative_to(ASSETS.parent).as_posix()
    except ValueError:
        return str(WEIGHTS_PATH)


def weights_problem() -> str | None:
    """Why the shipped trained weights cannot be used (missing, unreadable, wrong SHA-256), or None.

    Reads the whole file (6.9 MB, a few milliseconds). The header is checked when the folder is built."""
    try:
        data = WEIGHTS_PATH.read_bytes()
    except FileNotFoundError:
        return f"{_weights_name()} is missing"
    except OSError as exc:
        return f"{_weights_name()} cannot be read ({exc.strerror or exc})"
    if hashlib.sha256(data).hexdigest() != WEIGHTS_SHA256:
        return f"{_weights_name()} is damaged (its SHA-256 is not the shipped one)"
    return None


def fallback_note(problem: str) -> str:
    """The one line a load reports when the embedded model runs on random weights."""
    return (f"note: the trained weights {problem}: the embedded demo model runs on random weights, so its "
            "text is nonsense (the memory figures are unchanged); reinstall KV Scope to get them back")


def recipe_digest(trained: bool | None = None) -> str:
    """Hex digest (16 chars) of everything the build depends on: preset, corpus, weights (or the
    random init), builder and library versions. ``trained`` None: whether the shipped weights are usable now."""
    import safetensors
    import tokenizers
    import transformers

    if trained is None:
        trained = weights_problem() is None
    recipe = {
        "builder": BUILDER_VERSION,
        "config": _read_preset(),
        "corpus_sha256": hashlib.sha256(_read_corpus().encode("utf-8")).hexdigest(),
        "weights": WEIGHTS_SHA256 if trained else "random",
        "init": None if trained else [SEED, EMBED_STD, LINEAR_GAIN, FINAL_NORM_WEIGHT],
        # config.json and tokenizer files carry library versions, so a new version is a new folder.
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def embedded_cache_root() -> Path:
    """Folder that holds built embedded models: ``$KVSCOPE_CACHE/embedded`` or ``~/.cache/kvscope/embedded``."""
    return _cache_dir() / "embedded"


def _is_complete(folder: Path) -> bool:
    return folder.is_dir() and all((folder / f).is_file() for f in REQUIRED_FILES)


def embedded_model_dir(progress: Callable[[str], None] | None = None) -> Path:
    """Path of the built embedded demo model folder, building it first if needed (see ``embedded_build``)."""
    return embedded_build(progress).folder


def embedded_build(progress: Callable[[str], None] | None = None) -> EmbeddedBuild:
    """The built embedded demo model folder, building it first if needed, and what its weights are.

    The trained weights when ``WEIGHTS_PATH`` is intact, else seeded random weights (with a note).
    The build is offline and takes about a second once torch and transformers are imported;
    the folder is 13.1 MiB (3.43 M fp32 parameters). Two processes
    building at once are safe: each builds in its own temporary folder and renames it into place;
    the loser discards its copy. A build killed half-way (SIGKILL, power loss) leaves its
    ``.build-*`` folder behind; the next call removes such folders (see ``remove_stale_builds``).
    Raises EmbeddedBuildError if the cache cannot be written.
    """
    problem = weights_problem()
    if problem is None:
        problem = _header_problem()
    trained = problem is None
    root = embedded_cache_root()
    final = root / f"llama-4x256-{recipe_digest(trained)}"
    result = EmbeddedBuild(final, trained, EMBEDDED_LABEL if trained else RANDOM_WEIGHTS_LABEL,
                           None if trained else fallback_note(problem))
    remove_stale_builds(root)
    if _is_complete(final):
        return result
    if progress:
        progress("building embedded model…")
    try:
        _build_cached(root, final, trained)
    except EmbeddedBuildError as exc:  # a full or read-only HOME: this run's own copy, in the temporary folder
        return _temporary_build(result, trained, str(exc))
    return result


def _is_write_failure(exc: BaseException) -> bool:
    """An OSError, or safetensors' own error for one (``SafetensorError: ... No space left on device``)."""
    return isinstance(exc, OSError) or "SafetensorError" in type(exc).__name__


def _temporary_build(result: EmbeddedBuild, trained: bool, why: str) -> EmbeddedBuild:
    """The embedded model built in the system's temporary folder for this process only (removed at its exit),
    when the cache cannot be written; EmbeddedBuildError, one line, when that cannot be written either."""
    import atexit

    try:
        tmp = Path(tempfile.mkdtemp(prefix="kvscope-embedded-"))
    except OSError as exc:
        raise EmbeddedBuildError(f"{why}; nor in {tempfile.gettempdir()}: {exc.strerror or exc} - free some space "
                                 "or set KVSCOPE_CACHE to a writable folder") from None
    try:
        build_into(tmp, trained=trained)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_write_failure(exc):
            raise
        raise EmbeddedBuildError(f"{why}; nor in {tempfile.gettempdir()}: {getattr(exc, 'strerror', None) or exc} - "
                                 "free some space or set KVSCOPE_CACHE to a writable folder") from None
    atexit.register(shutil.rmtree, tmp, True)
    note = f"{why}: built the embedded model in {tmp} for this run only"
    return EmbeddedBuild(tmp, result.trained, result.label, f"{result.note}; {note}" if result.note else note)


def _build_cached(root: Path, final: Path, trained: bool) -> None:
    """Build into a temporary folder of ``root`` and rename it to ``final``; EmbeddedBuildError when the cache
    cannot be written (no space, read-only, no permission)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_build_prefix(), dir=root))
    except OSError as exc:
        raise EmbeddedBuildError(f"cannot write the KV Scope cache at {root}: {exc.strerror or exc} "
                                 "(set KVSCOPE_CACHE to a writable folder)") from exc
    try:
        try:
            build_into(tmp, trained=trained)
        except Exception as exc:
            if not _is_write_failure(exc) or isinstance(exc, OSError):
                raise
            raise OSError(28, str(exc)) from exc  # safetensors' words for the disk's error
        if final.exists() and not _is_complete(final):
            # A half-deleted folder from an older crash or a user's cleanup: replace it.
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (rename onto a non-empty folder fails everywhere).
            if not _is_complete(final):
                raise
    except OSError as exc:
        raise EmbeddedBuildError(f"cannot build the embedded model in {root}: {exc.strerror or exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _build_prefix() -> str:
    """``.build-<pid>@<host>-``: whose build a temporary folder is, for ``remove_stale_builds``."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"
    return f".build-{os.getpid()}@{host}-"


def _build_owner_gone(name: str) -> bool:
    """Whether the process that made the build folder ``name`` is known to be gone (same host, pid not running)."""
    m = _BUILD_NAME.match(name)
    if m is None:
        return False  # an older name without its owner: only its age tells
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"
    if m.group("host") != host:
        return False  # a build on another machine sharing this cache: its pid means nothing here
    import psutil

    pid = int(m.group("pid"))
    if pid == os.getpid():
        return False
    try:
        return not psutil.pid_exists(pid)
    except (OSError, ValueError):
        return False


def remove_stale_builds(root: Path, *, max_age_s: float = STALE_BUILD_S) -> list[Path]:
    """Delete leftover ``.build-*`` folders in ``root``; return those removed.

    A folder is stale when the process named in it (``.build-<pid>@<host>-...``) is no longer
    running on this host, or, whoever made it, when it was last changed more than ``max_age_s``
    ago (a build takes about a second; this also covers a reused pid and folders from before
    names carried their owner). A build still in progress in another process is left alone.
    """
    removed: list[Path] = []
    try:
        entries = list(Path(root).glob(".build-*"))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            if not entry.is_dir() or entry.is_symlink():
                continue
            old = now - entry.stat().st_mtime > max_age_s
        except OSError:
            continue
        if old or _build_owner_gone(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


def _train_tokenizer(vocab_size: int):
    """Byte-level BPE with exactly ``vocab_size`` entries, ids 0/1/2 = <pad>/<s>/</s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: decode(encode(text)) gives back text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
        show_progress=False,
    )
    tok.train_from_iterator(_read_corpus().splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama tokenizers: encode() starts a sequence with <s>.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return tok


def _random_state_dict(config) -> dict:
    """Seeded random weights for every parameter of ``LlamaForCausalLM(config)`` (tied head stored once)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # names and shapes only; no memory, no transformers init
        skeleton = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    # Sorted names: the draw order (hence the bytes) does not depend on module registration order.
    for name, param in sorted(skeleton.named_parameters()):
        if param.ndim == 1:  # RMSNorm weights
            value = torch.full(param.shape, FINAL_NORM_WEIGHT if name == "model.norm.weight" else 1.0)
        elif "embed_tokens" in name:
            value = torch.randn(param.shape, generator=gen) * EMBED_STD
            # pad/bos/eos rows zero: their logits are exactly 0 through the tied head, below the
            # top of the other 1021, so greedy decoding never stops early on </s>.
            value[[config.pad_token_id, config.bos_token_id, config.eos_token_id]] = 0.0
        else:
            value = torch.randn(param.shape, generator=gen) * (LINEAR_GAIN / param.shape[1] ** 0.5)
        tensors[name] = value.to(torch.float32).contiguous()
    return tensors


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``LlamaForCausalLM(config)`` (tied head once), from the meta device."""
    import torch
    from transformers import LlamaForCausalLM

    with collector_paused(), torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    return {name: tuple(p.shape) for name, p in skeleton.named_parameters()}


def _header_problem() -> str | None:
    """Why the weights file's safetensors header does not describe the preset's model, or None.

    Reached only when the SHA-256 matched, so this catches a shipped file that no longer fits the
    preset (retrain with scripts/train_embedded.py) rather than damage."""
    from safetensors import SafetensorError, safe_open
    from transformers import LlamaConfig

    try:
        with safe_open(str(WEIGHTS_PATH), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        return f"{_weights_name()} is not valid safetensors ({exc})"
    want = _expected_shapes(LlamaConfig(**_read_preset()))
    if shapes != want:
        return f"{_weights_name()} does not fit assets/presets/embedded.json (other tensors or shapes)"
    return None


def _trained_state_dict() -> dict:
    """The shipped fp16 weights as float32 tensors (the build's dtype), by name."""
    import torch
    from safetensors.torch import load

    return {name: t.to(torch.float32).contiguous() for name, t in sorted(load(WEIGHTS_PATH.read_bytes()).items())}


def build_into(folder: Path, trained: bool = False) -> None:
    """Write the embedded model's files into ``folder`` (which must exist). Deterministic bytes.

    ``trained``: the weights from WEIGHTS_PATH (checked by the caller), else seeded random ones."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    folder = Path(folder)
    preset = _read_preset()
    label = EMBEDDED_LABEL if trained else RANDOM_WEIGHTS_LABEL
    # The label travels in config.json (the spec's display name): random weights say so everywhere.
    preset["_kvscope"] = {**preset.get("_kvscope", {}), "display_name": label}
    config = LlamaConfig(**preset)
    tok = _train_tokenizer(config.vocab_size)
    ids = (tok.token_to_id(PAD), tok.token_to_id(BOS), tok.token_to_id(EOS))
    if tok.get_vocab_size() != config.vocab_size or ids != (config.pad_token_id, config.bos_token_id,
                                                            config.eos_token_id):
        raise EmbeddedBuildError(f"tokenizer does not fit the preset: vocab {tok.get_vocab_size()} "
                                 f"(want {config.vocab_size}), pad/bos/eos ids {ids}")

    weights = _trained_state_dict() if trained else _random_state_dict(config)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=config.max_position_embeddings)
    fast.save_pretrained(folder)
    # tokenizer_class: without it AutoTokenizer would pick LlamaTokenizer from config.json, which
    # rebuilds a SentencePiece-style pipeline instead of our byte-level one.
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # Written last: its presence (with the others) marks a complete build.
    (folder / "kvscope_recipe.json").write_text(json.dumps({
        "builder_version": BUILDER_VERSION, "seed": SEED, "digest": recipe_digest(trained),
        "label": label, "weights": "trained" if trained else "random",
    }, indent=2) + "\n", encoding="utf-8")


def folder_bytes(folder: Path) -> int:
    """Total size in bytes of the files in ``folder`` (not recursive)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


_WORD = re.compile(r"[a-z]+")


def corpus_words() -> frozenset[str]:
    """The lower-case words (runs of ASCII letters) of the corpus: the vocabulary the trained model learnt."""
    return frozenset(_WORD.findall(_read_corpus().lower()))


def corpus_word_share(text: str, words: frozenset[str] | None = None) -> tuple[float, int]:
    """Share (0-1) of the words of ``text`` that are words of the corpus, and how many words it has.

    A word is a run of ASCII letters, lower-cased; digits and punctuation are not counted. The
    trained model scores close to 1; random weights write byte-level fragments ("iesprll") and
    score far lower. An empty text scores 0.0."""
    found = _WORD.findall(text.lower())
    if not found:
        return 0.0, 0
    words = corpus_words() if words is None else words
    return sum(w in words for w in found) / len(found), len(found)
