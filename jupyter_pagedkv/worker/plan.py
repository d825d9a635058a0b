"""ExecutionPlan: which code runs an engine's steps, decided once, when the engine is built.

Why one place: the attention backend, how decode-only steps run (flat, padded buckets, CUDA
graphs), how every step runs (the model's own forward, the lean loop, its C++ decode twin) and
which kernel attends decode rows and prefill chunks depend on one another; deciding each where it
is used spread them over five modules. Here each is a `Decision` (what, and why in words), made in
order, each reading the ones before; `info()` prints them. The switches feed it and nothing else:
EngineConfig's fields (`PlanOptions`), $JUPYTER_PAGEDKV_BACKEND, $JUPYTER_PAGEDKV_NATIVE=0
(native_switch.py) and TRITON_INTERPRET=1 (Triton on the CPU, for tests). An option that insists
(`"native"`, `"triton"`, `cuda_graphs=True`) where it cannot run is a one-line error, never a
silent fallback.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Callable

import torch

from . import lean_forward
from . import prefill_attention as prefill_kernel
from .compat import UnsupportedModelError
from .kernels_bridge import triton_available
from .lean_forward import LeanForward
from .native_build import NativeBuildError
from .native_decode import NativeDecode, load_extension
from .native_switch import native_disabled
from .packed_linear import PackedLinears, packed_gemms

logger = logging.getLogger(__name__)

BACKEND_ENV = "JUPYTER_PAGEDKV_BACKEND"     # "auto" (default), "triton" or "torch"
BACKENDS = ("auto", "triton", "torch")
KERNEL_MODES = ("auto", "native", "torch")
# The KV cache dtypes (kv_quant.py) each attention kernel reads; torch's SDPA path reads all of
# them, dequantizing what it gathers. A kernel that learns a format adds it here, and nowhere else.
KERNEL_KV_DTYPES: dict[str, tuple[str, ...]] = {
    "triton": ("auto", "fp8_e4m3", "int8"),     # kernels/paged_attention.py, kernels/cache_ops.py
    "native decode": ("auto", "fp8_e4m3", "int8"),      # decode_attention.cpp
    "native prefill": ("auto", "fp8_e4m3", "int8"),     # prefill_attention.cpp
    "native step": ("auto", "fp8_e4m3", "int8"),        # native_decode.cpp (writes the cache too)
    "sdpa": ("auto", "fp8_e4m3", "int8"),
}
# Triton has an e4m3 type from sm_89 (Ada, Hopper) on: an older GPU reads int8 caches only.
TRITON_FP8_MIN_CAPABILITY = (8, 9)


def kv_dtype_problem(kernel: str, kv_cache_dtype: str, device: torch.device | None = None) -> str | None:
    """Why `kernel` cannot read a cache of `kv_cache_dtype` (on `device`), naming what it reads, or None."""
    reads = KERNEL_KV_DTYPES[kernel]
    if kernel == "triton" and kv_cache_dtype == "fp8_e4m3" and device is not None and device.type == "cuda" \
            and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < TRITON_FP8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        reads = tuple(r for r in reads if r != "fp8_e4m3")
        return (f"the triton kernel reads kv_cache_dtype 'fp8_e4m3' from sm_89 on (this GPU is sm_{major}{minor}), "
                f"so {' or '.join(map(repr, reads))} only")
    if kv_cache_dtype in reads:
        return None
    return f"the {kernel} kernel reads kv_cache_dtype {' or '.join(map(repr, reads))} only, not {kv_cache_dtype!r}"


@dataclass(frozen=True, slots=True)
class Decision:
    """One choice of the plan and the reason for it, in words."""

    choice: str
    reason: str

    def __str__(self) -> str:
        return f"{self.choice} ({self.reason})"


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The EngineConfig fields that steer the plan ("auto" lets it choose)."""

    attention_backend: str = "auto"
    cuda_graphs: bool | None = None
    pad_decode: bool = False
    step_loop: str = "auto"
    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, config) -> PlanOptions:
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """What runs an engine's steps; frozen: decided once, read by the runner and by `info()`."""

    backend: Decision             # "triton" | "torch"
    decode_steps: Decision        # "graphs" | "padded" | "flat" (decode-only steps like any other)
    decode_attention: Decision    # "triton" | "native" (decode_attention.cpp) | "sdpa"
    prefill_attention: Decision   # "triton" | "native" (prefill_attention.cpp) | "sdpa"
    forward: Decision             # "model" | "lean" | "native" (lean loop, decode steps in C++)

    @property
    def pads_decode(self) -> bool:
        return self.decode_steps.choice != "flat"

    def lines(self) -> tuple[str, ...]:
        """One line per decision, as `%pagedkv status` prints them."""
        return tuple(f"{f.name.replace('_', ' ')}: {getattr(self, f.name)}" for f in fields(self))


@dataclass(frozen=True, slots=True)
class Kernels:
    """What the plan chose, loaded: the runner hands these to every step."""

    decode: Callable | None = None          # C++ paged decode attention (None: not "native")
    prefill: ModuleType | None = None       # C++ prefill attention module (None: not "native")
    lean: LeanForward | None = None         # the lean loop (with its C++ twin in `lean.native`)
    # A quantized cache's write in C++ (native_decode.cpp's write_quantized: kv_quant's codes bit for
    # bit, fp8's scale search ~25x faster than its ATen ops), from the module the decode kernel is in.
    kv_write: Callable | None = None


def plan_execution(options: PlanOptions, model, device: torch.device, dtype: torch.dtype, head_dim: int | None,
                   packed: PackedLinears, soft_caps: bool = False, name: str = "this model"
                   ) -> tuple[ExecutionPlan, Kernels]:
    """Decide every choice for `model` on `device`, in dependency order; `packed` is the model's
    packed GEMMs (learned: the lean loop is proven under them), `soft_caps` whether its attention
    soft-caps logits (the Triton kernels do not)."""
    kv = options.kv_cache_dtype
    backend = decide_backend(device, options.attention_backend, kv)
    if soft_caps and backend.choice == "triton":
        raise UnsupportedModelError(f"{name} soft-caps its attention logits, which the Triton kernels do not: "
                                    f"load it with attention_backend='torch' (--attention-backend torch)")
    steps = decide_decode_steps(options.cuda_graphs, options.pad_decode, device, backend.choice)
    decode, decode_fn = decide_decode_attention(options.decode_attention, device, backend.choice, kv)
    prefill, prefill_module = decide_prefill_attention(options.prefill_attention, device, backend.choice,
                                                       dtype, head_dim, kv)
    forward, lean = decide_forward(options.step_loop, model, device, backend.choice, packed, decode_fn, kv)
    plan = ExecutionPlan(backend, steps, decode, prefill, forward)
    logger.info("execution plan: %s", "; ".join(plan.lines()))
    kv_write = load_extension().write_quantized if decode_fn is not None and kv != "auto" else None
    return plan, Kernels(decode_fn, prefill_module, lean, kv_write)


def decide_backend(device: torch.device | str, requested: str | None = None, kv_cache_dtype: str = "auto") -> Decision:
    """`requested` (or $JUPYTER_PAGEDKV_BACKEND, default "auto"): "auto" is Triton on CUDA and
    torch elsewhere (or where the Triton kernels cannot read the KV cache's dtype); forcing Triton
    where it cannot run is an error, not a silent fallback."""
    choice = (requested if requested not in (None, "auto") else None) or os.environ.get(BACKEND_ENV) or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {choice!r}")
    device = torch.device(device)
    kv_problem = kv_dtype_problem("triton", kv_cache_dtype, device)
    if choice == "triton" and kv_problem:
        raise ValueError(f"attention_backend='triton' cannot run here: {kv_problem}; "
                         f"use attention_backend='torch' (reads {', '.join(KERNEL_KV_DTYPES['sdpa'])}) or kv_cache_dtype='auto'")
    if choice == "auto":
        if device.type == "cuda" and kv_problem and triton_available(device):
            return Decision("torch", f"auto: torch, as {kv_problem}")
        if device.type == "cuda" and triton_available(device):
            return Decision("triton", "auto: the Triton kernels on CUDA")
        return Decision("torch", f"auto: torch on {device.type}" + (" (no Triton)" if device.type == "cuda" else ""))
    if choice == "triton" and not triton_available(device):
        raise RuntimeError(f"the Triton backend cannot run on {device} (no CUDA, or no Triton; "
                           "on the CPU set TRITON_INTERPRET=1 before importing triton)")
    source = "asked for" if requested not in (None, "auto") else f"${BACKEND_ENV}"
    return Decision(choice, source)


def resolve_backend(device: torch.device | str, requested: str | None = None) -> str:
    """The backend's name alone (for callers that need no reason)."""
    return decide_backend(device, requested).choice


def decide_decode_steps(cuda_graphs: bool | None, pad_decode: bool, device: torch.device, backend: str) -> Decision:
    """CUDA graphs by default where they can run (CUDA, Triton: the torch path reads lengths on
    the host); `True` insists (PaddedDecode refuses what cannot run), `False` is off. Graphs imply
    padded buckets; `pad_decode` asks for buckets without graphs."""
    graphs = device.type == "cuda" and backend == "triton" if cuda_graphs is None else cuda_graphs
    if graphs:
        return Decision("graphs", "asked for" if cuda_graphs else "default on CUDA with the Triton backend")
    if pad_decode:
        return Decision("padded", "pad_decode=True")
    if device.type != "cuda":
        return Decision("flat", f"no CUDA graphs on {device.type}")
    return Decision("flat", "cuda_graphs=False" if cuda_graphs is False
                    else "the torch attention backend reads lengths on the host")


def decide_decode_attention(mode: str, device: torch.device, backend: str,
                            kv_cache_dtype: str = "auto") -> tuple[Decision, Callable | None]:
    """The C++ kernel (decode_attention.cpp, blocks read in place) on the CPU's torch backend
    where it builds, else SDPA over gathered blocks; the Triton backend has its own kernel."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"decode_attention must be 'auto', 'native' or 'torch', got {mode!r}")
    if mode == "native" and (backend == "triton" or device.type != "cpu"):
        raise ValueError(f"decode_attention='native' runs on the CPU with the torch attention backend "
                         f"only (this engine: {device.type}, {backend}): use 'auto'")
    if backend == "triton":
        return Decision("triton", "the Triton backend's paged attention kernel"), None
    if mode == "torch":
        return Decision("sdpa", "decode_attention='torch'"), None
    problem = (kv_dtype_problem("native decode", kv_cache_dtype) or native_disabled()
               or (None if device.type == "cpu" else f"the C++ kernel is for the CPU, not {device.type}"))
    return _native_or_sdpa("decode_attention", mode, problem, lambda: (load_extension().paged_decode_attention, None),
                           "decode_attention.cpp reads each sequence's blocks in place", "use 'auto'")


def decide_prefill_attention(mode: str, device: torch.device, backend: str, dtype: torch.dtype,
                             head_dim: int | None, kv_cache_dtype: str = "auto") -> tuple[Decision, ModuleType | None]:
    """The C++ kernel (prefill_attention.cpp) where the CPU serves it, else torch's SDPA;
    'native' raises instead of falling back; the Triton backend has its own kernel."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"prefill_attention must be 'auto', 'native' or 'torch', got {mode!r}")
    if backend == "triton" and mode != "native":
        return Decision("triton", "the Triton backend's paged attention kernel"), None
    if mode == "torch":
        return Decision("sdpa", "prefill_attention='torch'"), None

    def load() -> tuple[ModuleType | None, str | None]:
        module = prefill_kernel.load_kernel()
        if module.supports(torch.empty(0, dtype=dtype)):  # host: a CPU kernel's dtype probe
            return module, None
        return None, f"this CPU lacks AVX-512{' BF16' if dtype == torch.bfloat16 else ''}"
    problem = (kv_dtype_problem("native prefill", kv_cache_dtype) or native_disabled()
               or prefill_kernel.problem(device, backend, dtype, head_dim))
    return _native_or_sdpa("prefill_attention", mode, problem, load, "prefill_attention.cpp, on this CPU's AVX-512",
                           "use 'auto' or 'torch'")


def _native_or_sdpa(option: str, mode: str, problem: str | None, load: Callable[[], tuple[object, str | None]],
                    chosen: str, hint: str) -> tuple[Decision, object | None]:
    """A C++ kernel, loaded (`load()` may raise NativeBuildError or answer why not), unless there
    is a `problem`; then SDPA, or under mode 'native' a one-line refusal that ends in `hint`."""
    loaded = None
    if problem is None:
        try:
            loaded, problem = load()
        except NativeBuildError as err:
            problem = str(err)
    if problem is not None:
        if mode == "native":
            raise ValueError(f"{option}='native' cannot run here: {problem}; {hint}")
        return Decision("sdpa", problem), None
    return Decision("native", chosen), loaded


def decide_forward(step_loop: str, model, device: torch.device, backend: str, packed: PackedLinears,
                   decode_kernel: Callable | None, kv_cache_dtype: str = "auto") -> tuple[Decision, LeanForward | None]:
    """Steps through one plain loop over the model's modules where that is proven exact
    (lean_forward.py), decode steps through its C++ twin where that builds (native_decode.py).
    Measured on the CPU only, so a GPU keeps the model's own forward."""
    if step_loop == "model":
        return Decision("model", "step_loop='model'"), None
    if device.type != "cpu" or backend != "torch":
        if step_loop != "auto":
            raise ValueError(f"step_loop={step_loop!r} runs on the CPU with the torch attention backend "
                             f"only (this engine: {device.type}, {backend}): use 'auto'")
        return Decision("model", "the lean loop is measured on the CPU's torch backend only"), None
    if packed.layers and not packed.learned:
        return Decision("model", "the packed GEMMs are learned on the first step"), None
    with packed_gemms(packed):
        lean, why = lean_forward.plan(model, packed)
    if lean is None:
        if step_loop != "auto":
            raise ValueError(f"step_loop={step_loop!r} cannot run this model, which keeps {why}: "
                             f"use 'auto' or 'model'")
        return Decision("model", why.removeprefix("the model's own forward (").removesuffix(")")), None
    why = why.removeprefix("the lean loop (").removesuffix(")")
    if step_loop not in ("auto", "native"):
        return Decision("lean", why), lean
    if (problem := kv_dtype_problem("native step", kv_cache_dtype)) is not None:
        if step_loop == "native":
            raise ValueError(f"step_loop='native' cannot run here: {problem}; use 'auto' or 'lean'")
        return Decision("lean", f"{why}; decode steps stay in Python: {problem}"), lean
    calls = lean.attention
    native, problem = NativeDecode.plan(model, packed, [c.scaling for c in calls], [c.window for c in calls],
                                       [c.softcap for c in calls], decode_kernel, required=step_loop == "native")
    lean.native = native
    if native is None:
        return Decision("lean", f"{why}; decode steps stay in Python: {problem}"), lean
    ops, said = native.elementwise_ops()
    if ops is not None:
        lean.elementwise = ops
    else:
        said = f"prefill rows keep ATen's elementwise ops: {said}"
    return Decision("native", f"{why}; decode steps in C++, native_decode.py; {said}"), lean
