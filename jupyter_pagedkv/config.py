"""EngineConfig: every engine option once, with its default, its check and its help.

`Engine(model, config=None, **options)`, `Engine.from_pretrained(...)` and `%pagedkv load` all
derive from the fields below; the magic's flags, defaults and help text are generated from them
(`load_arguments`), so an option added here is an option everywhere.
"""
from __future__ import annotations

import dataclasses
import re
import reprlib
from dataclasses import dataclass, field, fields
from typing import Any

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 40


def show(value: Any) -> str:
    """A value as an error quotes it: short, on one line (core.sampling_params.show's twin; config
    sits beside core and may not import it)."""
    return " ".join(_SHORT.repr(value).split())


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)


def parse_size(size: str | int) -> int:
    """'512MiB', '1GiB', '1.5GB' or an int of bytes -> bytes."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"a size is text like '512MiB' or a number of bytes, got {show(size)}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a size cannot be negative, got {size}")
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"cannot read size {size!r}: write it like '512MiB' or '2GiB'")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB': the inverse of `parse_size`, for status lines."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def option(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
           metavar: str | None = None, loading: bool = False) -> Any:
    """A config field with what the magic needs: its flag (default `--field-name`; a `--no-...`
    flag turns a boolean off), choices, metavar, and whether only loading uses it."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                            "metavar": metavar, "loading": loading})


@dataclass
class EngineConfig:
    """How an engine is built. Defaults are what `%pagedkv load` with no option gives."""

    device: str = option("auto", "cpu, cuda, cuda:1 ... (auto: CUDA when available)", loading=True)
    dtype: str = option("auto", "float32, bfloat16, float16 (auto: the checkpoint's dtype on a GPU, bf16 "
                                "for fp32 weights; on a CPU bf16 where it computes bf16 natively, AMX or "
                                "AVX-512 BF16, else fp32)", loading=True)
    revision: str | None = option(None, "hub revision: a branch, tag or commit (default: main)",
                                  metavar="REV", loading=True)
    trust_remote_code: bool = option(False, "run the model repo's own Python code (only for repos "
                                            "you trust)", flag="--trust-remote-code", loading=True)
    weights: str = option("dense", "a GGUF model's weights: dense = dequantized into the dtype (the exact "
                                   "reference); packed = kept in the file's Q4_0/Q4_1/Q8_0 blocks and computed "
                                   "from them (about the file's size in memory): in fp32 on the CPU, in bf16, "
                                   "fp16 or fp32 on CUDA (a Triton GEMM)",
                          choices=("dense", "packed"), loading=True)
    block_size: int = option(16, "tokens per KV block", metavar="N")
    num_blocks: int | None = option(None, "KV blocks to allocate, instead of a KV memory (default: "
                                          "from the KV memory)", metavar="N")
    kv_cache_memory: str | int | None = option(
        None, "KV memory instead of a block count, e.g. 512MiB (CPU default 1GiB; CUDA 90 percent of "
              "the memory free after the weights, less 1 GiB for activations)", metavar="SIZE")
    kv_cache_dtype: str = option(
        "auto", "how K and V are stored: auto = the model's dtype (exact); fp8_e4m3 or int8 = one byte per "
                "element with a float16 scale per token and KV head, about twice the blocks in the same "
                "memory (bench kvquant measures the cost)", choices=("auto", "fp8_e4m3", "int8"))
    max_num_seqs: int = option(64, "most sequences running at once", metavar="N")
    max_num_batched_tokens: int = option(2048, "most tokens computed in one step", metavar="N")
    enable_prefix_caching: bool = option(True, "reuse cached prompt prefixes",
                                         flag="--no-prefix-caching")
    prefix_cache_scope: str = option("global", "whose cached prefixes a request may hit: everyone's "
                                     "(global, vLLM's default) or its own tenant's only (tenant)",
                                     choices=("global", "tenant"))
    scheduling_policy: str = option("fcfs", "whose work goes next: first come, first served, priority "
                                    "ordering the queue only (fcfs); weighted fair share of the KV pool "
                                    "(fair; engine.set_tenant sets weights and caps); or preemptive "
                                    "priority, lower runs first and may preempt higher (priority)",
                                    choices=("fcfs", "fair", "priority"))
    preemption_mode: str = option("recompute", "what to do when blocks run out",
                                  flag="--preemption", choices=("recompute", "swap"))
    swap_space: str | int | None = option(None, "host memory for swapped-out blocks (default 1GiB)",
                                          metavar="SIZE")
    allocator: str = option("paged", "paged blocks, or the contiguous baseline",
                            choices=("paged", "contiguous"))
    max_model_len: int | None = option(None, "longest sequence (default: the model's context)",
                                       metavar="N")
    attention_backend: str = option("auto", "auto: Triton on CUDA, torch elsewhere",
                                    choices=("auto", "triton", "torch"))
    seed: int | None = option(None, "seed of the engine's sampler (requests may bring their own)",
                              metavar="S")
    speculative: Any = option(None, "speculative decoding for every request: n-gram lookup or a "
                                    "draft model", metavar="ngram|MODEL")
    num_speculative_tokens: int = option(4, "most draft tokens verified per step", metavar="K")
    pack_weights: bool | None = option(
        None, "plain torch GEMMs on the CPU (saves a packed copy of the weights; slower)",
        flag="--no-pack-weights")
    keep_plain_weights: bool | None = option(
        None, "keep each layer's plain weight beside its packed copy (twice the weight memory; the "
              "default only for a model passed to Engine(), whose owner may still run it)",
        flag="--keep-plain-weights")
    step_loop: str = option(
        "auto", "how CPU steps run a Llama-shaped model: auto = decode steps in C++ and the rest in "
                "the lean Python loop where each is proven exact, else the model's own forward; native "
                "and lean insist; model = always the model's own forward", choices=("auto", "native", "lean", "model"))
    prefill_attention: str = option(
        "auto", "attention of prefill chunks on the CPU: auto = the C++ kernel where the CPU has AVX-512 "
                "(bf16: AVX-512 BF16), else torch's SDPA; native insists; torch = always SDPA",
        choices=("auto", "native", "torch"))
    decode_attention: str = option(
        "auto", "how CPU decode rows attend: auto = a C++ kernel reading each sequence's blocks in place "
                "where it builds, else SDPA over gathered blocks; native insists; torch = always SDPA",
        choices=("auto", "native", "torch"))
    pad_decode: bool = option(False, "pad decode-only steps to bucket sizes in static buffers (what "
                                     "CUDA graphs replay; implied by CUDA graphs)", flag="--pad-decode")
    cuda_graphs: bool | None = option(
        None, "decode steps as CUDA graphs: on by default on CUDA with the Triton backend, each bucket "
              "verified against the eager step at warm-up (a mismatch or capture error logs one line and "
              "stays eager); True insists, --no-cuda-graphs turns them off", flag="--no-cuda-graphs")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Reject a bad option with one line that says what to pass instead: first its type, read
        from the field's annotation (a bool is not an int), then its choices and bounds."""
        for f in fields(self):
            if not _has_type(getattr(self, f.name), f.type):
                raise ValueError(f"{f.name} must be {_TYPE_WORDS[f.type]}, got {show(getattr(self, f.name))}")
        for f in fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                names = [repr(c) for c in choices]
                listed = ", ".join(names[:-1]) + f" or {names[-1]}"
                raise ValueError(f"{f.name} must be {listed}, got {getattr(self, f.name)!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("kv_cache_memory", "swap_space"):
            if getattr(self, name) is not None:
                try:
                    parse_size(getattr(self, name))
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from None
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed}")

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with some options changed; an unknown option is a TypeError naming it."""
        unknown = set(options) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))} "
                            f"(known: {', '.join(f.name for f in fields(self))})")
        return dataclasses.replace(self, **options)


# What each annotation used above accepts, and how an error names it ("Any": checked elsewhere).
_TYPES: dict[str, tuple] = {
    "int": (int,), "int | None": (int, None), "str": (str,), "str | None": (str, None),
    "bool": (bool,), "bool | None": (bool, None), "str | int | None": (str, int, None), "Any": (object,),
}
_TYPE_WORDS = {"int": "an integer", "int | None": "an integer or None", "str": "text",
               "str | None": "text or None", "bool": "True or False", "bool | None": "True, False or None",
               "str | int | None": "a size such as '512MiB', a number of bytes, or None", "Any": "anything"}


def _has_type(value: Any, annotation: str) -> bool:
    kinds = _TYPES[annotation]
    if object in kinds:
        return True
    if value is None:
        return None in kinds
    if isinstance(value, bool):
        return bool in kinds
    return any(k is not None and k is not bool and isinstance(value, k) for k in kinds)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def choices_of(name: str) -> tuple:
    """An option's choices, for a command line that passes it on to an engine (a benchmark)."""
    return next(f.metadata["choices"] for f in fields(EngineConfig) if f.name == name)


def load_arguments() -> list[tuple[tuple, dict]]:
    """(args, kwargs) for `argparse.add_argument` / IPython's `argument`, one per option."""
    out = []
    for f in fields(EngineConfig):
        flag, meta = _flag(f), f.metadata
        if flag.startswith("--no-") or f.default is False or f.type == "bool | None":
            out.append(((flag,), {"action": "store_true", "help": f"load: {meta['help']}"}))
            continue
        kind = int if f.type in ("int", "int | None") else None
        kwargs: dict[str, Any] = {"default": f.default, "help": f"load: {meta['help']} (default {f.default})"}
        if kind is not None:
            kwargs["type"] = kind
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        out.append(((flag,), kwargs))
    return out


def dest(f: dataclasses.Field) -> str:
    """The argparse attribute name of an option's flag."""
    return _flag(f).lstrip("-").replace("-", "_")


def from_arguments(args: Any) -> dict[str, Any]:
    """Engine options from a parsed namespace: only those the user changed from the default."""
    options = {}
    for f in fields(EngineConfig):
        value = getattr(args, dest(f))
        if _flag(f).startswith("--no-"):
            if value:
                options[f.name] = False
        elif f.default is False or f.type == "bool | None":
            if value:
                options[f.name] = True
        elif value != f.default:
            options[f.name] = value
    return options


def changed_flags(args: Any) -> list[str]:
    """The load flags a parsed namespace set (for 'only applies to load' errors)."""
    changed = from_arguments(args)
    return [_flag(f) for f in fields(EngineConfig) if f.name in changed]
