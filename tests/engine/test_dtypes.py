"""dtype="auto" chooses as documented (without depending on this machine's CPU), and bf16 on the CPU
is exact against transformers' own bf16 `generate`, up to bf16's own rounding: where the outputs
part, the oracle's top two logits must be within two bf16 steps of each other."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.testing.models import compare_with_oracle, hf_greedy, random_prompts
from jupyter_pagedkv.worker import loader
from jupyter_pagedkv.worker.loader import checkpoint_dtype, choose_dtype


@pytest.mark.parametrize("amx, avx512_bf16, want, why", [
    (True, True, torch.bfloat16, "natively (AMX)"),
    (False, True, torch.bfloat16, "natively (AVX-512 BF16)"),
    (False, False, torch.float32, "no native bf16"),
])
def test_auto_on_a_cpu_is_bf16_only_where_the_cpu_computes_it(monkeypatch, amx, avx512_bf16, want, why):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    choice = choose_dtype("cpu", "auto")
    assert choice.dtype == want and why in choice.reason and choice.reason.startswith("auto: ")


def test_auto_on_a_gpu_is_the_checkpoints_dtype_and_asked_dtypes_win(tmp_path):
    assert choose_dtype("cuda", "auto").dtype is None
    assert choose_dtype("cpu", "bfloat16").dtype == torch.bfloat16
    assert choose_dtype("cuda", "float32") == loader.DtypeChoice(torch.float32, "asked for")
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        choose_dtype("cpu", "float13")
    for recorded, want in (('"float16"', torch.float16), ('"float32"', torch.bfloat16), ("null", torch.bfloat16)):
        (tmp_path / "config.json").write_text(f'{{"dtype": {recorded}}}')
        assert checkpoint_dtype(tmp_path) == want


@pytest.mark.parametrize("native", [True, False])
def test_bf16_asked_for_on_a_cpu_without_it_says_it_is_emulated(monkeypatch, make_engine, native):
    """bench dtypes measured bf16 at 0.18x fp32 on an AVX2-only CPU: asking for it there is
    allowed, and the status line says what it costs."""
    monkeypatch.setattr(loader, "native_bf16", lambda: "AMX" if native else None)
    choice = choose_dtype("cpu", "bfloat16")
    assert choice.dtype == torch.bfloat16 and (choice.reason == "asked for") == native
    assert choose_dtype("cpu", "float32").reason == choose_dtype("cuda", "bfloat16").reason == "asked for"
    engine = make_engine(tiny_model("llama").to(torch.bfloat16), block_size=4, dtype_reason=choice.reason)
    assert engine.info().summary.endswith("" if native else "; bfloat16 as asked, but this CPU has no native "
                                          "bf16 (no AMX or AVX-512 BF16), so torch emulates it, about 5x slower "
                                          "than float32 (bench dtypes)")
    assert ("as asked" in engine.info().summary) != native


def test_the_status_line_says_why_auto_chose(make_engine):
    engine = make_engine(tiny_model("llama"), block_size=4)
    assert "because" not in engine.info().summary                   # built from a model: its own dtype
    told = make_engine(tiny_model("llama"), block_size=4, dtype_reason="auto: this CPU computes bf16 natively (AMX)")
    assert told.info().summary.endswith("; float32 because this CPU computes bf16 natively (AMX)")


def bf16_step(logit: float) -> float:
    """The spacing of bf16 numbers around `logit` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(logit))) - 7) if logit else 2.0 ** -133


def check_bf16(model, prompts, outs, new_tokens: int) -> int:
    """Token-identical to transformers' bf16 generate, or parting at a bf16 near-tie; returns how
    many were identical."""
    same = 0
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(model, prompt, new_tokens, stop_at_eos=False)
        found = compare_with_oracle(model, prompt, out.outputs[0].token_ids, ref)
        if found.identical:
            same += 1
            continue
        assert found.gap is not None, "lengths differ without a token difference"
        assert found.gap <= 2 * bf16_step(found.top), (
            f"token {found.index} differs with a top-2 gap of {found.gap} at logit {found.top}: more than "
            f"two bf16 steps ({bf16_step(found.top)})")
    return same


def test_bf16_tiny_models_match_transformers_bf16(make_engine):
    for arch in ("llama", "qwen3", "mistral"):
        model = tiny_model(arch).to(torch.bfloat16)
        prompts = random_prompts(6, 256, seed=13, lo=20, hi=120)
        engine = make_engine(model, block_size=4, max_num_batched_tokens=64)
        outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        assert check_bf16(model, prompts, outs, 24) >= 3, arch


@pytest.mark.slow
def test_bf16_embedded_model_matches_transformers_bf16():
    """As users load it: `from_pretrained` in bf16, the engine's own copy held once, packed (bf16
    GEMMs through oneDNN where it has them); the oracle is a second, stock copy of the model."""
    from jupyter_pagedkv import Engine

    loaded = loader.load_model(None, torch.bfloat16, torch.device("cpu"))
    model, tok = loaded.model, loaded.tokenizer
    texts = ["Name three rivers in Europe.", "Write a short poem about the sea.", "What is a prime number?",
             "List four colours of the rainbow.", "Explain paging in operating systems."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for t in texts]
    prompts += random_prompts(3, model.config.vocab_size, seed=3, lo=100, hi=300)
    engine = Engine.from_pretrained(None, dtype="bfloat16", kv_cache_memory="256MiB")
    assert engine.dtype == torch.bfloat16 and engine._hold_weights == engine._pack_weights
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        engine.check_invariants()
    finally:
        engine.shutdown()
    assert check_bf16(model, prompts, outs, 24) >= 3
