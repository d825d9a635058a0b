"""The architecture matrix (docs/architectures.md) holds: every architecture the table lists as
"exact" is token-identical to transformers' `generate` on prompts that cross its sliding window,
every one listed as "refused" is refused at load with the reason the table gives, and no
architecture transformers ships is missing from the table. The table is read from the docs, so the
docs cannot claim what the engine does not do.

The refusals are detected (worker/compat.py probes the model), not listed by hand: the last tests
break a supported model in the ways the probe looks for and check each is refused.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from jupyter_pagedkv import Engine
from jupyter_pagedkv.gpucheck.architectures import causal_lm_types, run_case
from jupyter_pagedkv.worker.compat import UnsupportedModelError

TABLE = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
ROWS = {m.group(1): (m.group(2), m.group(3).strip())
        for m in re.finditer(r"^\| `?([\w.-]+)`? \| (exact|refused|not built) \| (.*?) \|$", TABLE.read_text(), re.M)}
TESTED = sorted(t for t, (status, _) in ROWS.items() if status != "not built")


def test_the_table_lists_every_causal_lm_transformers_ships():
    import transformers
    shipped = set(causal_lm_types())
    assert shipped <= set(ROWS), (f"transformers {transformers.__version__} ships causal LMs the table does "
                                  f"not list: {sorted(shipped - set(ROWS))}: run `python -m "
                                  f"jupyter_pagedkv.bench architectures` and update docs/architectures.md")
    assert len(TESTED) >= 100


@pytest.mark.parametrize("model_type", TESTED)
def test_each_architecture_is_exact_or_refused_as_the_table_says(model_type):
    status, why = ROWS[model_type]
    outcome = run_case(model_type)
    assert outcome.status == status, f"{model_type}: {outcome.status} ({outcome.detail}), table says {status}"
    if status == "refused":
        assert why and why in outcome.detail, (why, outcome.detail)


class DropsKwargs(torch.nn.Module):
    """A decoder layer that calls its attention without passing keyword arguments on."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        kept = {k: v for k, v in kwargs.items() if k in ("attention_mask", "position_ids", "position_embeddings")}
        return self.layer(hidden_states, *args, **kept)


def test_a_layer_that_would_bypass_the_cache_is_detected_and_refused():
    model = tiny_model("llama", seed=9)
    layer = model.model.layers[1]
    model.model.layers[1] = DropsKwargs(layer)
    with pytest.raises(UnsupportedModelError, match="layer 1 does not pass the engine's step metadata"):
        Engine(model, None, block_size=4, kv_cache_memory="4MiB")
    model.model.layers[1] = layer
    # A layer whose attention never reaches the interface (its own state, e.g. a recurrent layer).
    attn = layer.self_attn
    layer.self_attn.forward = lambda hidden_states, **kw: (torch.zeros_like(hidden_states), None)
    with pytest.raises(UnsupportedModelError, match="only 1 of its 2 layers use attention"):
        Engine(model, None, block_size=4, kv_cache_memory="4MiB")
    del attn.forward
    Engine(model, None, block_size=4, kv_cache_memory="4MiB").stop()       # whole again: accepted


def test_a_model_with_its_own_mask_or_extra_attention_inputs_is_refused():
    model = tiny_model("llama", seed=9)
    attn = model.model.layers[0].self_attn
    original = attn.forward

    def with_bias(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        bias = torch.zeros(1, 1, hidden_states.shape[1], hidden_states.shape[1])
        return original(hidden_states, position_embeddings, bias - 0.5, **kwargs)

    attn.forward = with_bias
    with pytest.raises(UnsupportedModelError, match="layer 0 passes a mask of its own"):
        Engine(model, None, block_size=4, kv_cache_memory="4MiB")
    attn.forward = lambda *a, **kw: original(*a, **kw, s_aux=torch.zeros(4))
    with pytest.raises(UnsupportedModelError, match="layer 0 passes s_aux to attention"):
        Engine(model, None, block_size=4, kv_cache_memory="4MiB")
