"""Weights held once: a packed layer's plain weight is dropped, its values live in the packed copy.

Why: packing keeps a second copy of every weight (+100% of the model's memory; an 8B model in bf16
would need 32 GB instead of 16). A layer whose engine owns the model needs only the packed copy:
its parameter keeps its object, shape and dtype (so `model.parameters()`, `model.dtype`, parameter
counts and tied-weight bookkeeping stay right) but points at one element of storage.

The values come back exactly when asked: a GEMM of the identity with the packed weight gives
`I @ W^T = W^T`, every output one product w * 1 summed with zeros, so bit for bit the original
(`unpack`). `model.state_dict()` of a held model is unpacked that way (a hook), and releasing
the last engine of a model it does not own restores every weight the same way. A weight that is not
finite is never held (inf * 0 would poison the identity GEMM), nor one another module also reads
(a tied embedding: the embedding needs the plain rows, so such a layer is not packed at all when
weights are held once).
"""
from __future__ import annotations

import torch
from torch import nn


def placeholder(weight: torch.Tensor) -> torch.Tensor:
    """The weight's shape and dtype over one element of storage: what a held parameter points at.
    Writing into it fails loudly (torch refuses in-place writes to expanded tensors)."""
    return weight.new_zeros(()).expand(weight.shape)


def is_placeholder(weight: torch.Tensor) -> bool:
    return weight.numel() > 1 and weight.untyped_storage().nbytes() == weight.element_size()


def unpack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The plain `[out, in]` weight a oneDNN-packed copy was made from, bit for bit."""
    with torch.no_grad():
        eye = torch.eye(in_features, dtype=packed.dtype)  # host: oneDNN packs CPU weights only
        return torch.ops.mkldnn._linear_pointwise(eye, packed, None, "none", [], "").t().contiguous()


def can_hold(weight: torch.Tensor) -> bool:
    """Whether a weight's plain copy may be dropped: only a finite one comes back exactly from the
    identity GEMM. (Shared weights are never packed when holding: see `shared_weights`.)"""
    return bool(torch.isfinite(weight).all())


def shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters that more than one module owns (tied input and output embeddings)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, n in owners.items() if n > 1}


def own_storage(model: nn.Module) -> None:
    """Copy every parameter and buffer a held model still reads in place (embeddings, norms) into
    memory of its own. Why: a checkpoint loaded in its own dtype is a memory map of the file, and
    any one tensor left on it keeps the whole mapping, dropped weights included, resident."""
    with torch.inference_mode(False), torch.no_grad():    # normal tensors, usable with autograd later
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and not is_placeholder(tensor) and tensor.numel():
                tensor.data = tensor.data.clone()


def _state_dict_hook(module: nn.Linear, state_dict: dict, prefix: str, local_metadata) -> None:
    """Put the exact plain weight into a held layer's state dict instead of its placeholder."""
    plain = module.__dict__.get("_pagedkv_plain")
    if plain is not None and module.__dict__.get("_pagedkv_held"):
        state_dict[prefix + "weight"] = plain()


def hold(module: nn.Linear, plain) -> None:
    """Drop `module`'s plain weight; `plain()` must rebuild it exactly (from the packed copy)."""
    with torch.inference_mode(False), torch.no_grad():
        module.weight.data = placeholder(module.weight)
    module._pagedkv_held = True
    module._pagedkv_plain = plain
    module._pagedkv_hook = module.register_state_dict_post_hook(_state_dict_hook)


def restore(module: nn.Linear, weight: torch.Tensor | None) -> None:
    """Give a held layer its plain weight back (`weight`), or, with None, leave it unusable: its
    engine owned the model and dropped it, so any later call fails with a one-line reason."""
    hook = module.__dict__.pop("_pagedkv_hook", None)
    if hook is not None:
        hook.remove()
    module.__dict__.pop("_pagedkv_plain", None)
    module.__dict__.pop("_pagedkv_held", None)
    if weight is not None:
        with torch.inference_mode(False), torch.no_grad():
            module.weight.data = weight.clone() if weight.is_inference() else weight
    else:
        module.forward = _unloaded


def _unloaded(*args, **kwargs):
    raise RuntimeError("this model was unloaded from its engine, which held its weights packed and "
                       "dropped them: load the model again")
