"""Which models the paged cache can serve exactly, found by looking, not by a list of names.

The engine replaces attention through transformers' `AttentionInterface` and keeps each layer's K
and V in its blocks; anything a model keeps elsewhere (a state-space layer's state, a convolution's
window, attention sinks, a layer that reads another layer's cache) would be silently lost between
steps; and a layer that does not pass keyword arguments on would attend without the cache. So
before an engine is built, `check_servable` runs the model once on a few tokens with a probe
registered as its attention: every decoder layer must call it exactly once, with one `layer_idx`
of its own, the engine's `paged=` metadata received, keys and values of the same head size, and no
keyword our attention would ignore. Anything else is refused with one line that names what is missing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PROBE = "jupyter_pagedkv_probe"
# Keywords transformers' attention layers pass that paged attention honours (or that carry nothing
# it needs: dropout is 0 in eval, the mask and positions come from the step's metadata).
HONOURED = {"scaling", "dropout", "sliding_window", "softcap", "position_ids", "is_causal",
            "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "output_attentions",
            "use_cache", "cache_position", "past_key_values", "paged", "attention_type",
            # flags some models forward to every submodule; attention has nothing to do with them
            "output_router_logits", "output_hidden_states", "return_dict"}


# The few architectures the probe passes but the matrix (docs/architectures.md) found inexact; listed
# so they are refused rather than served wrong, until someone finds why.
KNOWN_INEXACT = {
    "moshi": "transformers' own cached generate disagrees with its uncached forward for it, so "
             "exactness cannot be checked",
    "xlm-roberta-xl": "transformers' own cached generate disagrees with its uncached forward for it, so "
                      "exactness cannot be checked",
    "phimoe": "its outputs differ from transformers' generate (mixture-of-experts routing; not yet explained)",
    "zaya": "its outputs differ from transformers' generate (mixture-of-experts routing; not yet explained)",
}


class UnsupportedModelError(ValueError):
    """The model cannot be served exactly by the paged cache: the message names what is missing."""


@dataclass(frozen=True)
class AttentionShape:
    """What the probe saw every layer hand to attention: the cache's shape, and whether logits
    are soft-capped (which the Triton kernels do not do)."""

    num_kv_heads: int
    head_dim: int
    softcap: bool


@dataclass
class ProbeRecord:
    calls: list[tuple[int, object, tuple, tuple, frozenset]] = field(default_factory=list)


_RECORD: ProbeRecord | None = None


_MARK = object()


def _causal(mask, q_len: int, k_len: int) -> bool:
    """Whether `mask` (None, boolean, or additive 0 / -inf) is the plain causal mask, the only one
    paged attention applies (with a sliding window, which the probe's few tokens never reach)."""
    if mask is None:
        return True
    visible = mask if mask.dtype == torch.bool else mask == 0
    if not mask.dtype == torch.bool and not torch.all((mask == 0) | torch.isinf(mask)):
        return False                    # a bias of real values: not a mask at all
    keys = torch.arange(k_len, device=mask.device)
    causal = keys.view(1, -1) <= torch.arange(k_len - q_len, k_len, device=mask.device).view(-1, 1)
    return bool(torch.all(visible.reshape(-1, *visible.shape[-2:]) == causal))


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    kwargs["paged"] = "received" if kwargs.get("paged") is _MARK else None
    if _RECORD is not None:
        keys = {k for k, v in kwargs.items() if v is not None}
        if not _causal(attention_mask, query.shape[-2], key.shape[-2]):
            keys.add("a mask of its own")
        _RECORD.calls.append((id(module), getattr(module, "layer_idx", None), tuple(key.shape),
                              tuple(value.shape), frozenset(keys)))
    kwargs.pop("softcap", None)             # sdpa cannot apply it; the probe only needs the call
    kwargs.pop("paged")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


AttentionInterface.register(PROBE, _probe_attention)


def _num_layers(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def check_servable(model, name: str = "this model") -> AttentionShape:
    """Raise UnsupportedModelError unless every layer's attention goes through our cache; return
    the shape of what it stores."""
    global _RECORD
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type in KNOWN_INEXACT:
        raise UnsupportedModelError(f"{name} ({model_type}) is not served: {KNOWN_INEXACT[model_type]}")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model: the engine serves decoder-only "
                                    f"causal LMs")
    old = config._attn_implementation
    try:
        model.set_attn_implementation(PROBE)
    except (ValueError, ImportError, AttributeError) as err:
        raise UnsupportedModelError(f"{name}: its attention cannot be replaced through transformers' "
                                    f"AttentionInterface ({str(err).splitlines()[0][:120]})") from err
    _RECORD = record = ProbeRecord()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([[3, 4, 5, 6]], device=device)
        with torch.inference_mode():
            # `paged=` is how the engine hands each layer its step metadata: it must arrive.
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, paged=_MARK)
    except Exception as err:  # noqa: BLE001  (any failure of the probe is a refusal, said in one line)
        raise UnsupportedModelError(f"{name}: a forward pass with our attention failed "
                                    f"({type(err).__name__}: {str(err).splitlines()[0][:120]})") from err
    finally:
        _RECORD = None
        model.set_attn_implementation(old)
    return _judge(record, _num_layers(model), name)


def _judge(record: ProbeRecord, num_layers: int, name: str) -> AttentionShape:
    calls = record.calls
    if not calls:
        raise UnsupportedModelError(f"{name}: no layer calls attention through transformers' "
                                    f"AttentionInterface, so the paged cache would never see its keys")
    modules = {c[0] for c in calls}
    indices = [c[1] for c in calls]
    if len(calls) != len(modules):
        raise UnsupportedModelError(f"{name}: a layer calls attention more than once per step")
    if len(modules) < num_layers:
        raise UnsupportedModelError(
            f"{name}: only {len(modules)} of its {num_layers} layers use attention; the others keep a "
            f"state outside the KV cache (state-space, linear-attention or convolution layers)")
    if any(i is None for i in indices) or sorted(indices) != list(range(num_layers)):
        raise UnsupportedModelError(f"{name}: its attention layers do not each own one KV cache slot "
                                    f"(layer indices {sorted(set(map(str, indices)))}: shared or "
                                    f"cross-layer KV)")
    for _, idx, kshape, vshape, keys in calls:
        if "paged" not in keys:
            raise UnsupportedModelError(f"{name}: layer {idx} does not pass the engine's step metadata on to "
                                        f"attention (its layers drop extra keyword arguments), so it would "
                                        f"attend without the cache")
        if kshape[-1] != vshape[-1]:
            raise UnsupportedModelError(f"{name}: layer {idx} has keys of size {kshape[-1]} and values of "
                                        f"size {vshape[-1]} (latent attention); the cache holds one size")
        unknown = keys - HONOURED
        if unknown:
            raise UnsupportedModelError(f"{name}: layer {idx} passes {', '.join(sorted(unknown))} to "
                                        f"attention, which the paged kernels do not implement")
    heads = {c[2][1] for c in calls}
    if len(heads) > 1 or len({c[2][-1] for c in calls}) > 1:
        raise UnsupportedModelError(f"{name}: its layers differ in KV heads or head size; the cache "
                                    f"holds one shape for every layer")
    return AttentionShape(calls[0][2][1], calls[0][2][-1], any("softcap" in c[4] for c in calls))
