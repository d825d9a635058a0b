"""LeanForward: a Llama-shaped model's engine step as one plain loop over its own modules.

Why: on the CPU a decode step of a small model pays for every Python call between its ops. A
transformers forward walks ~13 modules per layer, each through `nn.Module.__call__`, keyword
plumbing, decorators and the attention interface; the ops themselves are few and small. This loop
calls the same weights and the same torch ops in the same order (so the results are bit for bit
the model's own), with sibling projections as one packed GEMM, rotary applied to queries and keys
in one go, and the paged attention called directly.

Which models: found by looking, then proven per model. A model qualifies when its decoder layers
hold exactly the Llama parts (two RMS norms, q/k/v/o projections, a gated MLP) and nothing else;
then, at engine build, this loop and the model's own forward run the same few tokens and must give
identical logits, which also catches what structure cannot show (a scaled embedding, residual
multipliers, another norm formula). What each layer passes to attention (scale, sliding window,
soft-cap) is recorded from the model's own forward in that probe, not guessed. A model that fails
any of it keeps its own forward: `plan()` says why, and the engine reports which forward it runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .attention import paged_attention
from .paged_metadata import PagedMetadata
from .packed_linear import PackedLinears
from .quant_linear import QuantLinear

if TYPE_CHECKING:
    from .native_decode import NativeDecode     # which imports this module's Elementwise

logger = logging.getLogger(__name__)

RECORDER = "jupyter_pagedkv_lean_probe"
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj"}
_PROBE_TOKENS = 7
# Projections the loop calls as they are: plain linears, and packed GGUF blocks (weights="packed").
_PROJECTIONS = (nn.Linear, QuantLinear)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What a layer's own forward hands attention, as recorded in the probe."""

    scaling: float
    window: int | None
    softcap: float | None


@dataclass(frozen=True, slots=True)
class Elementwise:
    """The lean loop's elementwise steps. ATEN (below) is the reference: transformers' own ops,
    op for op. native_decode.py offers the same steps as C++ loops (fewer passes over a prefill's
    rows), proven equal to these on the model's weights before the loop uses them."""

    norm: Callable[[nn.Module, torch.Tensor], torch.Tensor]                 # (norm, h) -> normed h
    rotate: Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]   # (qkv, heads, cos, sin)
    gated: Callable[[nn.Module, torch.Tensor, int], torch.Tensor]           # (mlp, gate_up, I) -> act(gate) * up


class LeanForward:
    """`lean(input_ids, position_ids, logits_to_keep, paged)` -> logits `[rows, vocab]`, the same
    values as `model(...).logits[0]` for the same step."""

    def __init__(self, model, attention: list[LayerAttention], packed: PackedLinears) -> None:
        self.model = model
        self.attention = attention
        self.packed = packed
        base = model.model
        self.layers = list(base.layers)
        self.head_dim = self.layers[0].self_attn.head_dim
        self.probe_calls: list[dict] | None = None    # set while proving: the model's own calls
        self.native: NativeDecode | None = None        # decode-only steps in C++, where planned
        self.elementwise = ATEN                          # the other steps' elementwise ops (C++ where proven)
        # What the model's own forward would honour and this loop would not see: hooks, a forward
        # replaced on an instance after the probe (the packed layers' own is recorded), and a
        # module swapped for another (an adapter injected around a projection, say).
        # Held as the very dicts a hook, a forward or a child is registered into (each module's
        # own, mutated in place), so the check each step reads no module attribute.
        self._watched = [(m._forward_hooks, m._forward_pre_hooks, m.__dict__, m.__dict__.get("forward"),
                          m._modules, dict(m._modules)) for m in model.modules()]
        self._diverted = False

    def usable(self) -> bool:
        """False while a module has forward hooks, a replaced forward, or the module tree differs
        from the one proven: the model's own forward runs those steps (checked every step: 44 us
        for the embedded model's 397 modules, 208 us when it read each module's attributes)."""
        from torch.nn.modules import module as nn_module

        plain = not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks) and all(
            not hooks and not pre_hooks and attrs.get("forward") is f and modules == children
            for hooks, pre_hooks, attrs, f, modules, children in self._watched)
        if plain == self._diverted:
            self._diverted = not plain
            logger.info("the model %s: engine steps run %s", "has hooks, a replaced forward or module" if
                        self._diverted else "is plain again", "its own forward" if self._diverted else "the lean loop")
        return plain

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 paged: PagedMetadata | None) -> torch.Tensor:
        base = self.model.model
        h = base.embed_tokens(input_ids)[0]                    # [T, hidden]
        cos, sin = base.rotary_emb(h, position_ids)            # [1, T, head_dim]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)    # [T, 1, head_dim]: over heads
        native = self.native
        if native is not None and native.serves(paged, h.shape[0]):
            out = native.run(h, cos, sin, paged)
            if not native.proven:     # its first step: the lean loop, on ATen's ops, computes it too, and decides
                lean = self._layers(h, cos, sin, paged, ATEN)
                native.prove(out, lean)
                out = lean
            h = out
        else:
            h = self._layers(h, cos, sin, paged, self.elementwise)
        h = self.elementwise.norm(base.norm, h)
        return self.model.lm_head(h[logits_to_keep])

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                paged: PagedMetadata | None, ops: Elementwise) -> torch.Tensor:
        """Every decoder layer, in Python: on ATEN, the reference the C++ decode loop must equal."""
        tokens, d = h.shape[0], self.head_dim
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = ops.norm(layer.input_layernorm, h)
            qkv = self.packed.fused((attn.q_proj, attn.k_proj, attn.v_proj), x).view(tokens, -1, d)
            heads, kv_heads = attn.q_proj.out_features // d, attn.k_proj.out_features // d
            qk = ops.rotate(qkv, heads + kv_heads, cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
            o = self._attend(i, attn, q, k, v, paged)
            h = h + attn.o_proj(o.reshape(tokens, -1))
            x = ops.norm(layer.post_attention_layernorm, h)
            gate_up = self.packed.fused((mlp.gate_proj, mlp.up_proj), x)
            h = h + mlp.down_proj(ops.gated(mlp, gate_up, mlp.gate_proj.out_features))
        return h

    def _attend(self, i: int, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                paged: PagedMetadata | None) -> torch.Tensor:
        call = self.attention[i]
        if paged is not None:
            return paged_attention(i, q, k, v, paged, call.scaling, call.window, call.softcap)
        # Proving: the very attention call the model's own forward made, on our q/k/v.
        seen = dict(self.probe_calls[i])
        mask = seen.pop("attention_mask")
        out, _ = sdpa_attention_forward(module, q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                        v.transpose(0, 1).unsqueeze(0), mask, **seen)
        return out[0]


def _rms_norm(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op: fp32 variance, scale, back to the input dtype, weight."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(h.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x [T, heads, d]`, as transformers' `apply_rotary_pos_emb` (elementwise,
    so queries and keys rotated together give the same values as rotated apart)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _gated(mlp: nn.Module, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The gated MLP's input to down_proj: act(gate) * up, gate and up side by side in `gate_up`."""
    gate, up = gate_up.split((intermediate, gate_up.shape[-1] - intermediate), dim=-1)
    return mlp.act_fn(gate) * up


ATEN = Elementwise(norm=_rms_norm, rotate=lambda qkv, rotated, cos, sin: _rotate(qkv[:, :rotated], cos, sin),
                   gated=_gated)


def _shape_problem(model) -> str | None:
    """Why the model is not Llama-shaped, or None."""
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or any(not hasattr(base, p) for p in parts) or type(getattr(model, "lm_head", None)) not in _PROJECTIONS:
        return "not a decoder with embed_tokens, layers, norm, rotary_emb and an lm_head"
    config = model.config
    if len(base.layers) != getattr(config, "num_hidden_layers", -1):
        return "it runs a different number of layers than it holds"
    for layer in base.layers:
        children = {name for name, _ in layer.named_children()}
        if children != _LAYER_PARTS:
            return f"its layers hold {sorted(children)}, not exactly the Llama parts"
        attn, mlp = layer.self_attn, layer.mlp
        if {n for n, _ in attn.named_children()} != _ATTENTION_PARTS or not hasattr(attn, "head_dim"):
            return "its attention has parts beyond q/k/v/o projections"
        if not _MLP_PARTS <= {n for n, _ in mlp.named_children()} or not callable(getattr(mlp, "act_fn", None)):
            return "its MLP is not a gated gate/up/down MLP"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
                return "its norms are not RMS norms with a weight"
        if any(type(m) not in _PROJECTIONS for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                       mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "a projection is neither a plain nn.Linear nor a QuantLinear (adapted, or quantised otherwise)"
    if not hasattr(base.norm, "variance_epsilon"):
        return "its final norm is not an RMS norm"
    return None


def _record_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The probe's attention: SDPA, plus a note of exactly how this layer called it."""
    kwargs.pop("paged", None)
    _CALLS.append({"layer": module.layer_idx, "attention_mask": attention_mask, "scaling": scaling,
                   "dropout": dropout, **kwargs})
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


_CALLS: list[dict] = []
AttentionInterface.register(RECORDER, _record_attention)


def plan(model, packed: PackedLinears) -> tuple[LeanForward | None, str]:
    """A proven LeanForward for `model`, or None; and the reason, in words. Runs under the caller's
    `packed_gemms`, so both forwards use the same GEMMs."""
    problem = _shape_problem(model)
    if problem is not None:
        return None, f"the model's own forward ({problem})"
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)  # host: the same probe ids on every device
    ids = torch.randint(0, model.config.vocab_size, (1, _PROBE_TOKENS), generator=generator).to(device)
    positions = torch.arange(_PROBE_TOKENS, device=device).view(1, -1)
    keep = torch.arange(_PROBE_TOKENS, device=device)
    old = model.config._attn_implementation
    _CALLS.clear()
    try:
        model.set_attn_implementation(RECORDER)
        with torch.inference_mode():
            expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        calls = sorted(_CALLS, key=lambda c: c["layer"])
        if [c["layer"] for c in calls] != list(range(len(model.model.layers))):
            return None, "the model's own forward (its layers did not each call attention once)"
        attention = []
        for c in calls:
            c.pop("layer")
            window = c.get("sliding_window") or getattr(model.model.layers[len(attention)].self_attn,
                                                        "sliding_window", None)
            scaling = c["scaling"] if c["scaling"] is not None else model.model.layers[0].self_attn.head_dim ** -0.5
            attention.append(LayerAttention(scaling, window, c.get("softcap")))
        lean = LeanForward(model, attention, packed)
        lean.probe_calls = calls
        with torch.inference_mode():
            got = lean(ids, positions, keep, None)
    except Exception as err:  # noqa: BLE001  (any failure means: keep the model's own forward)
        logger.info("lean loop: the probe failed (%s: %s); the model's own forward runs", type(err).__name__, err)
        return None, f"the model's own forward (the lean loop failed on it: {type(err).__name__}: {err})"
    finally:
        _CALLS.clear()
        model.set_attn_implementation(old)
    lean.probe_calls = None
    if got.shape != expected.shape or not torch.equal(got, expected):
        return None, "the model's own forward (the lean loop's logits differ from it on a probe)"
    return lean, "the lean loop (Llama-shaped layers, proven identical on a probe)"
