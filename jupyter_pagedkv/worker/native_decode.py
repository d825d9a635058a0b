"""NativeDecode: decode-only steps of Llama-shaped layers as one C++ call (native_decode.cpp).

Why: the lean loop (lean_forward.py) already calls only the ops a layer needs, but each call still
goes through the Python interpreter, ~45 of them a layer. The C++ loop calls the very same ATen ops
with the same arguments, so its results are bit for bit the lean loop's; what it removes is the
Python between them. On the embedded model (2-core Xeon, bf16) that made decode steps 1.5x faster
at batch 1 and 1.25x at batch 32 (docs/benchmarks.md, issue #21).

What it serves: decode-only steps (every chunk one token, no prefill) on the torch backend, of a
model whose every q/k/v and gate/up are packed groups and o/down packed layers (oneDNN-packed, or
GGUF blocks stacked at load under weights="packed": quant_gemm.cpp), with SiLU and no
logit soft-capping. Anything else runs the lean loop. Its attention is decode_attention.cpp, which
reads each sequence's blocks in place (sliding windows included); the runner hands that kernel to
every step of the engine (PagedMetadata.decode_kernel), so decode rows are attended by the same
code whichever loop runs them. The first step it serves runs both and compares them (`prove`): a mismatch
turns it off for the engine, with a log line, and the lean loop's result is used.

Building: `torch.utils.cpp_extension` compiles the source once per machine (~30-60 s, g++ and
ninja) into its cache directory; later processes load it in a fraction of a second.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .lean_forward import ATEN, Elementwise
from .paged_metadata import PagedMetadata
from .native_build import LazyModule, NativeBuildError
from .native_switch import native_disabled
from .packed_linear import PackedLinears
from .quant_linear import DENSE_FROM_ROWS, QuantLinear, QuantStack

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(n) for n in ("native_decode.cpp", "decode_attention.cpp", "kv_quantize.cpp",
                                                    "quant_gemm.cpp", "quant_dot.cpp")]
# -O3 vectorises the attention kernel's loops; no fused multiply-adds, so each of its ISA variants
# rounds exactly as the others do; OpenMP, or at::parallel_for (a header template) runs on one thread.
_EXTENSION = LazyModule("jupyter_pagedkv_native_decode", SOURCES, "the C++ step loop", "step_loop='lean'",
                        ["-O3", "-ffp-contract=off", "-fopenmp"], ["-fopenmp"])


def load_extension():
    """The compiled module (built on first use, then cached by torch for every later process);
    raises NativeBuildError with one line on why not."""
    return _EXTENSION.load()


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's modules, as the C++ loop takes them."""

    norm1: nn.Module
    norm2: nn.Module
    qkv: tuple[nn.Linear, nn.Linear, nn.Linear]
    o: nn.Linear
    gate_up: tuple[nn.Linear, nn.Linear]
    down: nn.Linear


class NativeDecode:
    """The C++ loop for one model; `serves(paged)` says whether a step may use it."""

    def __init__(self, model, packed: PackedLinears, scaling: list[float], windows: list[int | None],
                 module) -> None:
        self.model, self.packed, self.module = model, packed, module
        self.scaling = scaling
        self.windows = [w or 0 for w in windows]     # each layer's sliding window, 0 for none
        self.layers = [_Layer(l.input_layernorm, l.post_attention_layernorm,
                              (l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), l.self_attn.o_proj,
                              (l.mlp.gate_proj, l.mlp.up_proj), l.mlp.down_proj) for l in model.model.layers]
        attn = model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.intermediate = model.model.layers[0].mlp.gate_proj.out_features
        self.proven = False
        self.enabled = True
        self._kept: tuple[list[list], list[int], list] | None = None   # _weight_args, when GGUF blocks

    @classmethod
    def plan(cls, model, packed: PackedLinears, scaling: list[float], windows: list[int | None],
             softcaps: list[float | None], decode_kernel, required: bool) -> tuple[NativeDecode | None, str]:
        """A NativeDecode for a model the lean loop serves, or None and why. `required` raises
        instead (step_loop='native'). `decode_kernel` is the engine's decode attention: the C++
        loop calls that very kernel, so it runs only where the engine's other steps do too."""
        problem = native_disabled() or _problem(model, packed, softcaps)
        if problem is None and decode_kernel is None:
            problem = "decode rows attend through SDPA (decode_attention='torch')"
        module = None
        if problem is None:
            try:
                module = load_extension()
            except NativeBuildError as err:
                problem = str(err)
        if problem is not None:
            if required:
                raise ValueError(f"step_loop='native' cannot run this model: {problem}")
            return None, problem
        return cls(model, packed, scaling, windows, module), "the C++ decode loop"

    @property
    def attention(self):
        """The paged decode attention kernel the C++ loop calls: the runner gives it to every
        step's metadata, so the lean loop and the model's forward attend decode rows with it too."""
        return self.module.paged_decode_attention

    def serves(self, paged: PagedMetadata | None, tokens: int) -> bool:
        return (self.enabled and paged is not None and not paged.prefills and paged.num_decode == tokens
                and paged.backend == "torch" and paged.all_slots_valid
                and paged.decode_kernel is self.attention and paged.decode_block_tables is not None)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, paged: PagedMetadata) -> torch.Tensor:
        """h after the last layer, as the lean loop's layers compute it."""
        weights, kinds = self._weight_args()
        kv = paged.kv_cache
        return self.module.decode_layers(
            h, cos, sin, *weights, kv.k, kv.v, paged.slot_mapping,
            paged.decode_block_tables, paged.seq_lens, self.heads, self.kv_heads, self.head_dim,
            self.intermediate, self.scaling, self.windows, kinds, DENSE_FROM_ROWS,
            kv.k_scale, kv.v_scale)

    def elementwise_ops(self) -> tuple[Elementwise | None, str]:
        """The C++ loops for the lean loop's elementwise steps (steps this loop does not serve:
        every prefill), if they give ATen's very values here, else None; and why, in words.

        Why: a prefill's rows pass through ~20 ATen elementwise ops a layer (the RMS norm alone is
        eight passes, each allocating its result); the loops make one or two passes. Proven here,
        once per engine, on the model's own norm weights and rotary tables with seeded random rows
        (300 of them: more than one thread's share), against the reference ops (lean_forward.ATEN)."""
        m = self.module
        native = Elementwise(norm=lambda norm, h: m.norm_rows(h, norm.weight, float(norm.variance_epsilon)),
                             rotate=m.rotate_rows, gated=lambda mlp, gate_up, i: m.gated_rows(gate_up, i))
        base = self.model.model
        with torch.inference_mode():     # the activations' dtype, as the embedding (dense or GGUF blocks) gives it
            dtype = base.embed_tokens(torch.zeros(1, 1, dtype=torch.long)).dtype   # host: this loop is CPU-only
        generator = torch.Generator().manual_seed(0)    # host: seeded rows, on the CPU this loop runs on
        tokens, rotated, mlp = 300, self.heads + self.kv_heads, base.layers[0].mlp

        def draw(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * 3).to(dtype)    # host: as above

        h = draw(tokens, base.norm.weight.numel())
        qkv, gate_up = draw(tokens, rotated + self.kv_heads, self.head_dim), draw(tokens, 2 * self.intermediate)
        with torch.inference_mode():
            cos, sin = base.rotary_emb(h, torch.arange(4000, 4000 + tokens).view(1, -1))   # host: as above
            cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
            checks = [(native.norm(n, h), ATEN.norm(n, h), "RMS norm")
                      for l in self.layers for n in (l.norm1, l.norm2)] + [
                (native.norm(base.norm, h), ATEN.norm(base.norm, h), "final norm"),
                (native.rotate(qkv, rotated, cos, sin), ATEN.rotate(qkv, rotated, cos, sin), "rotary embedding"),
                (native.gated(mlp, gate_up, self.intermediate), ATEN.gated(mlp, gate_up, self.intermediate),
                 "gated MLP product")]
        for got, want, what in checks:
            if not torch.equal(got, want):
                logger.warning("the C++ %s differs from ATen's here: prefill rows keep ATen's ops", what)
                return None, f"the C++ {what} differs from ATen's here"
        return native, "prefill rows' elementwise steps in C++"

    def _weight_args(self) -> tuple[list[list], list[int]]:
        """The norms' and projections' arguments of `decode_layers`, and each projection's kind.

        Looking them up took ~0.4 ms a step on the embedded model (nn.Module attribute lookups),
        ~3% of a packed decode step. So where every projection is GGUF blocks (packed once at load)
        they are kept, with a guard per tensor taken: the module's own parameter, buffer or
        attribute dict still holding that very object (a reassigned weight or bias, a new norm
        weight, is seen and the arguments are looked up again; ~0.1 ms). oneDNN-packed projections
        are looked up every step: `packed_weight` re-packs a weight changed in place."""
        if self._kept is not None and all(held.get(name) is obj for held, name, obj in self._kept[2]):
            return self._kept[0], self._kept[1]
        weights: dict[str, list] = {k: [] for k in ("qkv", "bqkv", "o", "bo", "gu", "bgu", "down", "bdown")}
        kinds: list[int] = []
        guards: list[tuple[dict, str, object]] = []
        for layer in self.layers:
            for key, linears in (("qkv", layer.qkv), ("o", (layer.o,)), ("gu", layer.gate_up), ("down", (layer.down,))):
                w, b, kind = _projection(self.packed, linears)
                weights[key].append(w)
                weights["b" + key].append(b)
                kinds.append(kind)
                guards += [g for m in linears for name in ("blocks", "bias") for g in _guards(m, name)]
            guards += [g for norm in (layer.norm1, layer.norm2) for g in _guards(norm, "weight")]
        args = [[l.norm1.weight for l in self.layers], [float(l.norm1.variance_epsilon) for l in self.layers],
                [l.norm2.weight for l in self.layers], [float(l.norm2.variance_epsilon) for l in self.layers],
                weights["qkv"], weights["bqkv"], weights["o"], weights["bo"], weights["gu"], weights["bgu"],
                weights["down"], weights["bdown"]]
        self._kept = (args, kinds, guards) if all(k != 0 for k in kinds) else None
        return args, kinds

    def prove(self, native: torch.Tensor, lean: torch.Tensor) -> None:
        """The first served step: keep the C++ loop only if it gave the lean loop's very values."""
        if torch.equal(native, lean):
            self.proven = True
            logger.info("the C++ decode loop matches the lean loop bit for bit: decode steps use it")
        else:
            self.enabled = False
            logger.warning("the C++ decode loop differs from the lean loop on this model (max |diff| %.3g): "
                           "the lean loop runs instead", (native.float() - lean.float()).abs().max().item())


def _guards(module: nn.Module, name: str) -> list[tuple[dict, str, object]]:
    """(dict, name, object) triples that all hold (`dict.get(name) is object`) exactly while
    `module.name` is the object it is now: the dict torch keeps it in (a parameter, a buffer or a
    plain attribute) still holds it, and where it is a plain attribute or absent, no parameter or
    buffer of that name has been registered since (which would take precedence)."""
    for held in (module._parameters, module._buffers):
        if name in held:
            return [(held, name, held[name])]
    return [(module.__dict__, name, module.__dict__.get(name)), (module._parameters, name, None),
            (module._buffers, name, None)]


def _problem(model, packed: PackedLinears, softcaps: list[float | None]) -> str | None:
    """Why the C++ loop cannot serve this model (beyond the lean loop's own checks), or None."""
    if any(s is not None for s in softcaps):
        return "it soft-caps attention logits"
    if next(model.parameters()).device.type != "cpu":
        return "it is not on the CPU"
    for layer in model.model.layers:
        act = layer.mlp.act_fn
        if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
            return f"its MLP activation is {type(act).__name__}, not SiLU"
        attn, mlp = layer.self_attn, layer.mlp
        for linears in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
                        (mlp.down_proj,)):
            if _projection(packed, linears) is None:
                return ("its projections are not packed for oneDNN (packing is off, or not in this dtype) "
                        "nor stacked GGUF blocks (a stack takes layers of whole groups of eight output features)")
    return None


def _projection(packed: PackedLinears, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """(weight, bias, kind) of the one GEMM computing `linears` in the C++ loop: a oneDNN-packed
    weight (kind 0), or GGUF blocks (their GGML type; weights="packed"); None if neither. Called
    for every projection of every decode step: a plain nn.Linear goes straight to the oneDNN
    lookup (asking it for a QuantStack's `stack` would raise and catch an AttributeError in
    nn.Module.__getattr__, 120 times a step on the embedded model)."""
    if isinstance(linears[0], QuantLinear):
        if len(linears) == 1:
            return linears[0].blocks, linears[0].bias, linears[0].kind
        stack = QuantStack.of(linears)
        if stack is not None:
            return stack.blocks, None, stack.kind
    found = packed.packed_weight(linears)
    return None if found is None else (*found, 0)
