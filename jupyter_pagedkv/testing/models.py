"""Models built in code (no download) and transformers' own greedy decoding as the oracle.

The test suite and the GPU check share these, so the architectures checked on a CPU are exactly
the ones checked on a GPU: tiny random configs of several families, and random-weight models with
the shapes of SmolLM2-135M and Llama-3-8B (speed does not depend on the weights' values).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

TINY_ARCHS = ("llama", "qwen3", "qwen2", "mistral", "phi3")

# Real models' shapes (config.json of each), without their weights.
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
}


def _sharpen(model) -> None:
    """Random init leaves tiny logit gaps; a steeper output layer keeps greedy paths apart."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)


def _steepen_attention(model, factor: float):
    """Random init leaves attention scores near 0 (|s| < 0.2 here); scaling the query and key
    projections by `factor` multiplies them by its square, so a soft-cap has scores to cap."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    return model


def tiny_model(arch: str, vocab: int = 256, seed: int = 0):
    """A small random-initialised causal LM of one family (fp32, CPU, eval mode)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    gqa64 = {**common, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64}
    builders = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None)),
        # a window long prompts cross many times (not in TINY_ARCHS: a variant, not a family)
        "mistral-window48": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=48)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**{**common, "num_key_value_heads": 4})),
        # SmolLM2's attention shape (heads of 64, 3 query heads per KV head), the one the C++
        # prefill kernel serves, with and without a window
        "llama-gqa64": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**gqa64)),
        "mistral-window48-gqa64": lambda: tf.MistralForCausalLM(tf.MistralConfig(**gqa64, sliding_window=48)),
        # logit soft-capping that bites (scores up to ~5, capped at +-2; `_steepen_attention`) on a
        # sliding layer and a full one
        "gemma2-softcap": lambda: _steepen_attention(tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
            attn_logit_softcapping=2.0, final_logit_softcapping=None)), 6.0),
    }
    if arch not in builders:
        raise ValueError(f"unknown tiny architecture {arch!r}: one of {sorted(builders)}")
    torch.manual_seed(seed)
    model = builders[arch]()
    _sharpen(model)
    return model.eval()


def byte_tokenizer():
    """A 256-token byte-level tokenizer built in code (one token per byte, no merges) with a small
    chat template, so tests reach text and chat prompts on a tiny model without a download. Ids
    1 and 2 are BOS and EOS, as in `tiny_model`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=alphabet[0], bos_token=alphabet[1],
                                  eos_token=alphabet[2])
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


def shaped_model(shape: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 num_layers: int | None = None, seed: int = 0, sharpen: bool = False):
    """A Llama-architecture model with a real model's shapes and random weights, built directly
    on `device` in `dtype` (an 8B model never exists in fp32 or on the host). `num_layers`
    shortens it (smoke runs)."""
    import transformers as tf

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: one of {sorted(SHAPES)}")
    config = tf.LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = tf.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    if sharpen:
        _sharpen(model)
    return model.eval()


@contextlib.contextmanager
def attention(model, name: str):
    """Run `model` with another registered attention implementation for a while."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool) -> list[int]:
    """Transformers' own greedy `generate` with SDPA, one prompt at a time (no padding) on the
    model's device: the oracle every engine output is compared with."""
    device = next(model.parameters()).device
    with attention(model, "sdpa"):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False,
                             eos_token_id=model.config.eos_token_id if stop_at_eos else [],
                             pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_beams(model, prompt: list[int], beam_width: int, max_tokens: int, length_penalty: float = 1.0,
             early_stopping: bool | str = False, ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """Transformers' own beam search on one unpadded prompt: (generated tokens, score), best first."""
    device = next(model.parameters()).device
    with attention(model, "sdpa"):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             num_beams=beam_width, num_return_sequences=beam_width, do_sample=False,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             # No EOS: an empty list, with pad id 1 (its beam padding reads
                             # `pad or eos[0]`, and 0 is falsy).
                             eos_token_id=[] if ignore_eos else model.generation_config.eos_token_id,
                             pad_token_id=1 if ignore_eos else (model.generation_config.pad_token_id or 0),
                             return_dict_in_generate=True, output_scores=True,
                             temperature=None, top_p=None, top_k=None)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


@dataclass(frozen=True)
class Agreement:
    """How an output compares with the oracle's: identical, or first differing at `index`
    where the oracle's top-2 logit gap was `gap` (a near-tie when below the threshold)."""

    identical: bool
    index: int | None = None
    gap: float | None = None
    top: float | None = None          # the oracle's top logit there (a bf16 tie is relative to it)

    def near_tie(self, threshold: float) -> bool:
        return self.identical or (self.gap is not None and self.gap < threshold)


@torch.inference_mode()
def compare_with_oracle(model, prompt: list[int], ours: list[int], ref: list[int]) -> Agreement:
    """Where `ours` first leaves the oracle's `ref`, and the oracle's top-2 gap there.

    Reduction order may legitimately flip a true near-tie; the caller decides the threshold."""
    if ours == ref:
        return Agreement(True)
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if i >= len(ours) or i >= len(ref):
        return Agreement(False, i, None)      # lengths differ without a token difference
    device = next(model.parameters()).device
    with attention(model, "sdpa"):
        logits = model(torch.tensor([prompt + ref[:i]], device=device)).logits[0, -1].float()
    top2 = logits.topk(2).values
    return Agreement(False, i, float(top2[0] - top2[1]), float(top2[0]))


def random_prompts(n: int, vocab: int, seed: int, lo: int = 1, hi: int = 60) -> list[list[int]]:
    """`n` seeded prompts of random token ids (ids 0-2 are left to pad, BOS and EOS)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]
