"""Loading what a user names: a hub id (downloaded through the hub client, replaced here: no test
reaches the hub), a local folder, a `.gguf` file, the embedded model; and one clear line for every
way that can fail (gated, missing, wrong revision, offline, no network, remote code, bad paths)."""
from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from unittest import mock

import httpx2
import pytest
import torch
from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from conftest import hf_greedy, tiny_model
from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.worker import hub
from jupyter_pagedkv.worker.loader import ModelNotFoundError, embedded_gguf, load_model

PROMPT = list(range(5, 30))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _http_error(cls, message: str):
    response = httpx2.Response(404, request=httpx2.Request("GET", "http://hub.invalid/"))
    return cls(message, response=response)


class FakeHub:
    """`snapshot_download` over a folder of repos (`root/<org>/<name>`), as the hub client behaves:
    it copies the files matching `allow_patterns` (minus `ignore_patterns`) into a cache snapshot
    and returns that folder; `local_files_only` serves only what was fetched before."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache, self.calls = root, cache, []

    def __call__(self, repo_id, revision=None, allow_patterns=(), ignore_patterns=(), local_files_only=False):
        self.calls.append({"repo_id": repo_id, "revision": revision, "allow": list(allow_patterns),
                           "local_files_only": local_files_only})
        snapshot = self.cache / repo_id.replace("/", "--") / (revision or "main")
        if local_files_only:
            if not snapshot.exists():
                raise LocalEntryNotFoundError("not in the cache")
            return str(snapshot)
        source = self.root / repo_id
        if not source.exists():
            raise _http_error(RepositoryNotFoundError, "404 repo")
        if revision not in (None, "main", "v1"):
            raise _http_error(RevisionNotFoundError, "404 revision")
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in source.rglob("*"):
            rel = str(f.relative_to(source))
            if (f.is_file() and any(fnmatch.fnmatch(rel, p) for p in allow_patterns)
                    and not any(fnmatch.fnmatch(rel, p) for p in ignore_patterns)):
                shutil.copy(f, snapshot / rel)
        return str(snapshot)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=3)


@pytest.fixture
def fake_hub(tmp_path, tiny, monkeypatch):
    root = tmp_path / "hub"
    tiny.save_pretrained(root / "org" / "tiny", safe_serialization=True)
    (root / "org" / "tiny" / "consolidated.safetensors").write_bytes(b"the same weights again")
    # An older repo: PyTorch weights only (transformers no longer writes them, so torch.save does).
    tiny.config.save_pretrained(root / "org" / "tiny-bin")
    torch.save(tiny.state_dict(), root / "org" / "tiny-bin" / "pytorch_model.bin")
    (root / "org" / "gguf-only").mkdir(parents=True)
    (root / "org" / "gguf-only" / "model.Q4.gguf").write_bytes(b"GGUF")
    fake = FakeHub(root, tmp_path / "cache")
    monkeypatch.setattr(hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)       # conftest sets it for every other test
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return fake


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and len(text) < 300, text
    return text


def test_a_hub_id_downloads_at_the_revision_asked_and_runs_exactly(fake_hub, tiny, make_engine):
    engine = Engine.from_pretrained("org/tiny", device="cpu", dtype="float32", revision="v1",
                                    kv_cache_memory="16MiB")
    try:
        assert engine.name == "org/tiny"
        out = engine.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
        assert out == hf_greedy(tiny, PROMPT, 12, stop_at_eos=False)
        engine.check_invariants()
    finally:
        engine.stop()
    first = fake_hub.calls[0]
    assert first["repo_id"] == "org/tiny" and first["revision"] == "v1" and not first["local_files_only"]
    assert "*.safetensors" in first["allow"] and "*.bin" not in first["allow"] and "*.py" not in first["allow"]
    snapshot = Path(fake_hub.cache / "org--tiny" / "v1")
    assert not (snapshot / "consolidated.safetensors").exists()        # one copy of the weights


def test_a_repo_without_safetensors_falls_back_to_its_pytorch_weights(fake_hub, tiny):
    loaded = load_model("org/tiny-bin", torch.float32, torch.device("cpu"))
    assert loaded.source == "hub" and [c["allow"][-1] for c in fake_hub.calls][-1] == "*.bin.index.json"
    assert torch.equal(loaded.model.lm_head.weight, tiny.lm_head.weight)


def test_offline_serves_the_cache_and_says_why_it_cannot_download(fake_hub, monkeypatch):
    load_model("org/tiny", torch.float32, torch.device("cpu"))               # fetched once, online
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("org/tiny", torch.float32, torch.device("cpu"))
    assert loaded.source == "hub" and fake_hub.calls[-1]["local_files_only"]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        load_model("org/tiny-bin", torch.float32, torch.device("cpu"))
    assert "TRANSFORMERS_OFFLINE forbid downloading" in one_line(err.value)


@pytest.mark.parametrize("raised, message", [
    (lambda: _http_error(GatedRepoError, "403 gated"), "org/tiny is gated: accept its licence"),
    (lambda: _http_error(RepositoryNotFoundError, "404"), "org/tiny is not a model on the hub"),
    (lambda: LocalEntryNotFoundError("connection refused"), "cannot reach the hub to download org/tiny"),
])
def test_hub_failures_are_one_line_each(fake_hub, monkeypatch, raised, message):
    monkeypatch.setattr(hub, "snapshot_download", mock.Mock(side_effect=raised()))
    with pytest.raises(ModelNotFoundError) as err:
        load_model("org/tiny", torch.float32, torch.device("cpu"))
    assert message in one_line(err.value)


def test_missing_repos_and_revisions_say_so(fake_hub):
    with pytest.raises(ModelNotFoundError) as err:
        load_model("org/nothing-here", torch.float32, torch.device("cpu"))
    assert "org/nothing-here is not a model on the hub" in one_line(err.value)
    with pytest.raises(ModelNotFoundError) as err:
        load_model("org/tiny", torch.float32, torch.device("cpu"), revision="no-such-branch")
    assert "has no revision 'no-such-branch'" in one_line(err.value)
    with pytest.raises(ModelNotFoundError) as err:
        load_model("org/gguf-only", torch.float32, torch.device("cpu"))
    assert "has no config.json" in one_line(err.value) and ".gguf" in str(err.value)


def test_a_local_folder_loads_in_the_dtype_asked(tmp_path, tiny):
    tiny.save_pretrained(tmp_path / "m", safe_serialization=True)
    loaded = load_model(tmp_path / "m", torch.bfloat16, torch.device("cpu"))
    assert loaded.source == "folder" and loaded.model.dtype == torch.bfloat16
    assert torch.equal(loaded.model.lm_head.weight, tiny.lm_head.weight.to(torch.bfloat16))


def test_weights_go_straight_to_the_device_without_a_host_copy_first(tmp_path, tiny):
    """from_pretrained gets the target device as its device map (accelerate places each tensor as
    it is read); the model is never built on the host and moved after."""
    tiny.save_pretrained(tmp_path / "m", safe_serialization=True)
    from transformers import AutoModelForCausalLM
    real = AutoModelForCausalLM.from_pretrained
    with mock.patch.object(AutoModelForCausalLM, "from_pretrained", side_effect=real) as spy, \
            mock.patch.object(torch.nn.Module, "to", side_effect=AssertionError("moved after loading")):
        load_model(tmp_path / "m", torch.float32, torch.device("cpu"))
    assert spy.call_args.kwargs["device_map"] == {"": "cpu"}
    assert spy.call_args.kwargs["dtype"] == torch.float32


def test_remote_code_is_refused_unless_asked(tmp_path, tiny):
    folder = tmp_path / "custom"
    tiny.save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="pagedkv_custom", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'pagedkv_custom'\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    with pytest.raises(ModelNotFoundError) as err:
        load_model(folder, torch.float32, torch.device("cpu"))
    assert "runs its own Python code" in one_line(err.value) and "--trust-remote-code" in str(err.value)
    loaded = load_model(folder, torch.float32, torch.device("cpu"), trust_remote_code=True)
    assert type(loaded.model).__name__ == "CustomForCausalLM"
    assert torch.equal(loaded.model.lm_head.weight, tiny.lm_head.weight)


def test_bad_paths_and_unknown_architectures_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    cases = [(tmp_path / "missing.gguf", "no GGUF file at"), (tmp_path / "empty", "has no config.json"),
             ("./no/such/folder", "no model folder at ./no/such/folder"),
             (tmp_path / "odd", "does not know its architecture (no_such_architecture)")]
    for name, message in cases:
        with pytest.raises(ModelNotFoundError) as err:
            load_model(name, torch.float32, torch.device("cpu"))
        assert message in one_line(err.value), (name, str(err.value))


def test_a_gguf_file_loads_as_llama_cpp_users_have_it(embedded):
    """The embedded model's own GGUF file, loaded from its path (transformers de-quantises it):
    the same weights as the converted copy the embedded model uses, and a greedy run identical."""
    model, _ = embedded
    loaded = load_model(str(embedded_gguf()), torch.float32, torch.device("cpu"))
    assert loaded.source == "gguf" and loaded.tokenizer is not None
    assert loaded.model.config.model_type == "llama"
    for (name, ours), (_, theirs) in zip(loaded.model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(ours, theirs), name
