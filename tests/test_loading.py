"""Loading models from every source, devices, dtypes, attention kernels, and each named load failure.

Every model here is real: tiny Llama/BERT checkpoints written to tmp folders with save_pretrained
(random init, fixed seed), carrying the embedded model's tokenizer. The hub is forced offline, so
no test touches the network.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

from kvscope.core.model.embedded import embedded_model_dir
from kvscope.core.runtimes.transformers.loading import (EMBEDDED_HINT, LoadError, _translate_hub_error, load_model,
                                                        resolve_device, resolve_dtype)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module", autouse=True)
def offline_cache(tmp_path_factory):
    """Private KVSCOPE_CACHE; hub offline (huggingface_hub reads HF_HUB_OFFLINE once, at import)."""
    root = tmp_path_factory.mktemp("kvscope-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSCOPE_CACHE", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield root


@pytest.fixture(scope="module")
def embedded_dir(offline_cache) -> Path:
    return embedded_model_dir()


def _tiny_config(**overrides) -> LlamaConfig:
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=1024, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded_dir) -> Path:
    """A real tiny GQA Llama saved with save_pretrained (safetensors) plus a tokenizer."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_config()).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(embedded_dir / name, folder / name)
    return folder


def _copy_model(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load_error(source, **kw) -> LoadError:
    with pytest.raises(LoadError) as info:
        load_model(str(source), device="cpu", **kw)
    err = info.value
    assert "\n" not in str(err)
    return err


def _assert_offers_embedded(err: LoadError) -> None:
    assert err.offer_embedded is True
    assert str(err).endswith(EMBEDDED_HINT)


# --------------------------------------------------------------------------------------------
# Loading that works


def test_local_folder_loads_on_cpu(tiny_dir):
    messages: list[str] = []
    lm = load_model(str(tiny_dir), device="cpu", progress=messages.append)
    assert (lm.device, lm.dtype, lm.label, lm.source) == ("cpu", "float32", "tiny-llama", str(tiny_dir))
    assert (lm.spec.num_layers, lm.spec.num_query_heads, lm.spec.num_kv_heads, lm.spec.head_dim) == (2, 4, 2, 16)
    assert lm.spec.num_parameters == sum(p.numel() for p in lm.model.parameters())
    assert not lm.model.training
    assert lm.model.config._attn_implementation == "sdpa"
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}
    assert any("loading weights" in m for m in messages) and messages[-1].startswith("ready")
    ids = lm.tokenizer("hello", return_tensors="pt").input_ids
    assert lm.model(ids).logits.shape == (1, ids.shape[1], 1024)


@pytest.mark.parametrize(("name", "expected"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_dtypes_load_on_cpu(tiny_dir, name, expected):
    lm = load_model(str(tiny_dir), device="cpu", dtype=name)
    assert {p.dtype for p in lm.model.parameters()} == {expected}
    assert lm.dtype == str(expected).removeprefix("torch.")


def test_embedded_loads_by_default_with_progress(embedded_dir):
    messages: list[str] = []
    lm = load_model(device="cpu", progress=messages.append)
    assert lm.source == "embedded" and lm.label == "embedded demo model"
    assert lm.spec.num_kv_heads == 8
    assert messages[0] == "reading config…"  # already built by the fixture: no build message


# --------------------------------------------------------------------------------------------
# Devices and dtypes


def test_auto_device_follows_hardware():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto") == expected
    assert resolve_device("CPU") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_missing_cuda_is_explained(name):
    with pytest.raises(LoadError, match=rf"device {name} is not available: (this torch build has no CUDA|no CUDA GPU)") as info:
        resolve_device(name)
    assert info.value.offer_embedded is False


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_missing_mps_is_explained():
    with pytest.raises(LoadError, match="device mps is not available"):
        resolve_device("mps")


def test_unknown_device():
    with pytest.raises(LoadError, match="unknown device 'tpu'; use auto, cpu, cuda, cuda:N or mps"):
        resolve_device("tpu")


def test_device_error_from_load_model_does_not_offer_embedded(tiny_dir):
    with pytest.raises(LoadError) as info:
        load_model(str(tiny_dir), device="quantum")
    assert info.value.offer_embedded is False


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu", "bfloat16") == torch.float32  # CPU: fp32 whatever the model says
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("fp16", "cpu") == torch.float16  # allowed, slow
    assert resolve_dtype("BF16", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32
    with pytest.raises(LoadError, match="unknown dtype 'fp12'"):
        resolve_dtype("fp12", "cpu")
    with pytest.raises(LoadError, match="load as fp32, fp16 or bf16"):
        resolve_dtype("int4", "cpu")


# --------------------------------------------------------------------------------------------
# Attention implementation


# --------------------------------------------------------------------------------------------
# Model source failures (issue 7, "Model source")


def test_unknown_hub_id_offline_never_touches_network():
    err = _load_error("no-such-org/no-such-model-kvscope")
    assert "no-such-org/no-such-model-kvscope: not in the local Hugging Face cache" in str(err)
    assert "cannot be reached" in str(err)
    _assert_offers_embedded(err)


def test_invalid_hub_id():
    err = _load_error("not a model!!")
    assert "'not a model!!' is neither a local model folder nor a hub id" in str(err)
    _assert_offers_embedded(err)


def test_missing_local_folder(tmp_path):
    err = _load_error(tmp_path / "nowhere")
    assert str(err).startswith(f"no such folder: {tmp_path / 'nowhere'}")
    _assert_offers_embedded(err)


def test_online_hub_errors_have_specific_messages():
    """What the hub raises online (cannot be produced offline): the real exception classes, translated."""
    import httpx2  # huggingface_hub's HTTP client; its errors carry the response
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    def response(status: int):
        return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))

    gated = _translate_hub_error(OSError("You are trying to access a gated repo."), "meta-llama/Llama-3-8B")
    assert "is gated: accept its licence" in str(gated) and gated.offer_embedded
    cause = GatedRepoError("403 Client Error", response=response(403))
    wrapped = OSError("cannot access")
    wrapped.__cause__ = cause
    assert "is gated" in str(_translate_hub_error(wrapped, "org/gated"))
    missing = OSError("org/x is not a local folder and is not a valid model identifier listed on "
                      "'https://huggingface.co/models'")
    assert "no such model on the Hugging Face hub" in str(_translate_hub_error(missing, "org/x"))
    wrapped = OSError("whatever")
    wrapped.__cause__ = RepositoryNotFoundError("404 Client Error", response=response(404))
    assert "no such model on the Hugging Face hub" in str(_translate_hub_error(wrapped, "org/x"))


def test_folder_without_config(tmp_path):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    err = _load_error(folder)
    assert "has no config.json" in str(err)
    _assert_offers_embedded(err)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-bert"
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    BertForMaskedLM(cfg).save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdef")))
    return folder


def test_encoder_is_not_a_causal_lm(bert_dir):
    err = _load_error(bert_dir)
    assert "tiny-bert is BertForMaskedLM, not a causal language model: an encoder" in str(err)
    _assert_offers_embedded(err)


def test_encoder_without_architectures_is_still_refused(bert_dir, tmp_path):
    """transformers maps BertConfig to BertLMHeadModel, so the architectures field must not be the only check."""
    folder = _copy_model(bert_dir, tmp_path / "bare-bert")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architectures"]
    (folder / "config.json").write_text(json.dumps(cfg))
    err = _load_error(folder)
    assert "bare-bert (bert) is an encoder" in str(err)
    _assert_offers_embedded(err)


REMOTE_CONFIG_PY = '''
from pathlib import Path
from transformers import LlamaConfig

Path({marker!r}).write_text("ran")  # leave a mark so the test can tell this code ran


class KvscopeRemoteConfig(LlamaConfig):
    model_type = "kvscope-remote-test"
'''
REMOTE_MODELING_PY = '''
from transformers import LlamaForCausalLM
from .configuration_kvscope_remote import KvscopeRemoteConfig


class KvscopeRemoteForCausalLM(LlamaForCausalLM):
    config_class = KvscopeRemoteConfig
'''


@pytest.fixture
def remote_dir(tiny_dir, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A model whose classes live in its own folder (auto_map), as hub repos with custom code do."""
    # transformers copies the repository code to HF_MODULES_CACHE, which tests/conftest.py points
    # at one folder per session (the `transformers_modules` package is imported once, from one path).
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = _copy_model(tiny_dir, tmp_path / "remote-model")
    marker = tmp_path / "remote-code-ran"
    (folder / "configuration_kvscope_remote.py").write_text(REMOTE_CONFIG_PY.format(marker=str(marker)))
    (folder / "modeling_kvscope_remote.py").write_text(REMOTE_MODELING_PY)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="kvscope-remote-test", architectures=["KvscopeRemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_kvscope_remote.KvscopeRemoteConfig",
        "AutoModelForCausalLM": "modeling_kvscope_remote.KvscopeRemoteForCausalLM",
    })
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def test_remote_code_refused_without_opt_in(remote_dir):
    folder, marker = remote_dir
    err = _load_error(folder)
    assert "needs Python code from the model's own repository" in str(err)
    assert "'kvscope-remote-test' is not part of transformers" in str(err)
    assert "--trust-remote-code" in str(err)
    assert not marker.exists()  # the repository's code never ran
    _assert_offers_embedded(err)


def test_remote_code_runs_with_opt_in(remote_dir):
    folder, marker = remote_dir
    lm = load_model(str(folder), device="cpu", trust_remote_code=True)
    assert marker.read_text() == "ran"
    assert type(lm.model).__name__ == "KvscopeRemoteForCausalLM"
    assert lm.spec.num_kv_heads == 2


@pytest.fixture(scope="module")
def pickle_dir(tiny_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "pickle-only"
    folder.mkdir()
    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_dir / name, folder / name)
    return folder


def test_pickle_weights_refused_without_opt_in(pickle_dir):
    err = _load_error(pickle_dir)
    assert "weights only in pickle format (pytorch_model.bin)" in str(err) and "--allow-pickle" in str(err)
    _assert_offers_embedded(err)


def test_pickle_weights_load_with_opt_in(pickle_dir, tiny_dir):
    lm = load_model(str(pickle_dir), device="cpu", allow_pickle=True)
    reference = load_model(str(tiny_dir), device="cpu")
    for (name, a), (_, b) in zip(lm.model.state_dict().items(), reference.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_weights_with_other_shapes_than_config(tiny_dir, tmp_path):
    folder = _copy_model(tiny_dir, tmp_path / "shape-mismatch", intermediate_size=96)
    err = _load_error(folder)
    assert "the weights do not match config.json - some tensors have other shapes" in str(err)
    assert "mlp.down_proj.weight is [64, 128] in the weights, [64, 96] by the config" in str(err)
    _assert_offers_embedded(err)


def test_weights_missing_layers_the_config_declares(tiny_dir, tmp_path):
    folder = _copy_model(tiny_dir, tmp_path / "too-few-weights", num_hidden_layers=3)
    err = _load_error(folder)
    assert "9 tensor(s) the config needs are missing (e.g. model.layers.2." in str(err)
    _assert_offers_embedded(err)


def test_weights_with_layers_the_config_lacks(tiny_dir, tmp_path):
    folder = _copy_model(tiny_dir, tmp_path / "too-many-weights", num_hidden_layers=1)
    err = _load_error(folder)
    assert "9 stored tensor(s) have no place in the model" in str(err)
    _assert_offers_embedded(err)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tiny_dir, tmp_path, damage):
    folder = _copy_model(tiny_dir, tmp_path / f"{damage}-weights")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 + data[64:] if damage == "garbage" else data[: len(data) // 2])
    err = _load_error(folder)
    assert "model.safetensors is not a valid safetensors file" in str(err)
    assert "truncated or corrupt" in str(err)
    _assert_offers_embedded(err)


def test_folder_without_weights(tiny_dir, tmp_path):
    folder = _copy_model(tiny_dir, tmp_path / "no-weights")
    (folder / "model.safetensors").unlink()
    err = _load_error(folder)
    assert "has no weights" in str(err)
    _assert_offers_embedded(err)


def test_folder_without_tokenizer(tiny_dir, tmp_path):
    folder = _copy_model(tiny_dir, tmp_path / "no-tokenizer")
    for name in TOKENIZER_FILES:
        (folder / name).unlink()
    err = _load_error(folder)
    assert "has no tokenizer" in str(err)
    _assert_offers_embedded(err)


def test_a_file_instead_of_a_folder(tiny_dir):
    err = _load_error(tiny_dir / "config.json")
    assert "is a file; give the model folder" in str(err)
    _assert_offers_embedded(err)


def test_calculator_preset_is_not_loadable_but_points_to_the_hub():
    err = _load_error("llama-3-8b")
    assert "llama-3-8b is a calculator preset (config only, no weights)" in str(err)
    assert "meta-llama/Meta-Llama-3-8B" in str(err)
    _assert_offers_embedded(err)
