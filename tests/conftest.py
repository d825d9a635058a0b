"""Shared fixtures: tiny random models of several architectures, the embedded model, HF references."""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import pytest  # noqa: E402
import torch  # noqa: E402  (importing torch does not import triton)

# Without CUDA the Triton kernels run in Triton's interpreter; the switch must be set before
# anything imports triton, so it is set for the whole session (nothing else uses Triton on a CPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def tiny_model(arch: str, vocab: int = 256, seed: int = 0):
    """A small random-initialised causal LM built in code (no download)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    builders = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**{**common, "num_key_value_heads": 4})),
    }
    torch.manual_seed(seed)
    model = builders[arch]()
    # Random init has tiny logit gaps; sharpen the output layer so greedy paths are well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


@contextlib.contextmanager
def attention(model, name: str):
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool) -> list[int]:
    """Transformers' own greedy generate, one prompt at a time (no padding): the oracle."""
    with attention(model, "sdpa"):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False,
                             eos_token_id=model.config.eos_token_id if stop_at_eos else [],
                             pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def assert_same_or_near_tie(model, prompt: list[int], ours: list[int], ref: list[int]) -> bool:
    """Token-identical, or the first difference is a true near-tie (top-2 logit gap < 1e-4).

    Returns True when identical. fp32 reduction order may legitimately flip a near-tie; anything
    else is a bug.
    """
    if ours == ref:
        return True
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    assert i < len(ours) and i < len(ref), (
        f"lengths differ without a token difference: ours {len(ours)}, reference {len(ref)}")
    with attention(model, "sdpa"):
        logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-4, f"token {i} differs ({ours[i]} vs {ref[i]}) but the top-2 gap is {gap:.3g}"
    return False


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct: (model, tokenizer), loaded once per session."""
    from jupyter_pagedkv.loader import load_model

    loaded = load_model(None, torch.float32, torch.device("cpu"))
    return loaded.model, loaded.tokenizer


@pytest.fixture
def make_engine():
    """Build engines and check the invariants of every one of them when the test ends."""
    from jupyter_pagedkv import Engine

    engines = []

    def make(model, tokenizer=None, **kwargs):
        kwargs.setdefault("kv_cache_memory", "64MiB")
        engine = Engine(model, tokenizer, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()
        engine.check_invariants()
