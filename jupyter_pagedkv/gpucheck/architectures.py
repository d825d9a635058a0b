"""The architecture matrix: every causal LM transformers ships, as a tiny random model built in code,
served by the engine and checked against transformers' own greedy `generate`.

Each case ends one of three ways: "exact" (token-identical, or a checked near-tie), "refused" (the
engine would not load it, and says why in one line: worker/compat.py detects what it cannot serve),
or "not built" (no tiny config of it could be made here, so nothing was tested). A fourth, "WRONG",
is a bug: loaded and not exact. Sliding windows are set to 8 tokens and prompts are 40 long (5
windows), so windows and soft-capping are crossed.

`python -m jupyter_pagedkv.bench architectures [--device cuda] [TYPE ...]` prints the table.
"""
from __future__ import annotations

import argparse
import logging
import time
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)
WINDOW = 8
PROMPT_LEN = 5 * WINDOW
NEW_TOKENS = 12
# Set on every config that has the attribute: a model of ~0.1-2M parameters.
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False, sliding_window=WINDOW, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             rotary_dim=8, use_sliding_window=True, max_window_layers=1)
ALWAYS = {"head_dim": 16}           # set even where the config computes it
MAX_PARAMS = 8_000_000


@dataclass
class Outcome:
    model_type: str
    status: str          # "exact", "refused", "not built", "WRONG"
    detail: str = ""
    seconds: float = 0.0


def tiny_config(model_type: str):
    """A small config of `model_type`, or raise: the defaults shrunk through the names most
    configs share (and the text config's, for multimodal ones)."""
    import transformers as tf

    config = tf.AutoConfig.for_model(model_type)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, value in {**SMALL, **ALWAYS}.items():
        if hasattr(text, key) or key in ALWAYS:
            try:
                setattr(text, key, value)
            except (AttributeError, TypeError, ValueError):
                pass
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        try:   # the first layers' pattern, cut to the new depth (keeps sliding and full layers)
            text.layer_types = (list(layer_types) * 2)[:text.num_hidden_layers]
        except (AttributeError, TypeError, ValueError):
            pass
    return config


def oracle(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate: SDPA, or eager where the model refuses SDPA (soft-capping)."""
    from ..testing.models import attention, hf_greedy

    try:
        return hf_greedy(model, prompt, new_tokens, stop_at_eos=False)
    except ValueError:
        with torch.inference_mode(), attention(model, "eager"):
            ids = torch.tensor([prompt], device=next(model.parameters()).device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=[], pad_token_id=0)
        return out[0, len(prompt):].tolist()


def run_case(model_type: str, device: str = "cpu", seed: int = 0, backend: str = "auto") -> Outcome:
    """Build, serve and compare one architecture (see the module docstring for the outcomes)."""
    import transformers as tf

    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine
    from ..worker.compat import UnsupportedModelError
    from ..testing.models import _sharpen, compare_with_oracle, random_prompts

    t0 = time.perf_counter()
    done = lambda status, detail="": Outcome(model_type, status, detail, time.perf_counter() - t0)  # noqa: E731
    try:
        config = tiny_config(model_type)
        if getattr(config, "is_encoder_decoder", False):
            return done("refused", "encoder-decoder")
        with torch.device("meta"):
            size = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            return done("not built", f"its tiny config still has {size / 1e6:.0f}M parameters")
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config).eval()
        _sharpen(model)
        model.to(device)
        with torch.inference_mode():    # the tiny model must run on its own before it tests anything
            model(input_ids=torch.tensor([[3, 4, 5, 6]], device=device), use_cache=False)
    except Exception as err:  # noqa: BLE001  (a config we cannot build tests nothing: say so)
        logger.debug("%s: tiny model not built", model_type, exc_info=True)
        return done("not built", f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}")
    try:
        engine = Engine(model, None, block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=24,
                        attention_backend=backend)
    except UnsupportedModelError as err:
        return done("refused", str(err))
    try:
        vocab = model.config.get_text_config().vocab_size
        prompts = random_prompts(2, vocab, seed=seed + 1, lo=PROMPT_LEN, hi=PROMPT_LEN + 1)
        try:
            refs = [oracle(model, p, NEW_TOKENS) for p in prompts]
        except Exception as err:  # noqa: BLE001
            logger.debug("%s: transformers' generate failed", model_type, exc_info=True)
            return done("not built", f"transformers' own generate fails: {type(err).__name__}")
        outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        engine.check_invariants()
        for prompt, out, ref in zip(prompts, outs, refs):
            found = compare_with_oracle(model, prompt, out.outputs[0].token_ids, ref)
            if not found.identical and (found.gap is None or found.gap >= 1e-4):
                return done("WRONG", f"token {found.index} differs (top-2 gap {found.gap})")
        return done("exact")
    finally:
        engine.stop()


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench architectures",
                                     description="the architecture matrix against transformers' generate")
    parser.add_argument("types", nargs="*", help="model types (default: every causal LM transformers ships)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {args.device}")
    print("| architecture | outcome | why / detail |\n|---|---|---|")
    wrong = 0
    for model_type in args.types or causal_lm_types():
        o = run_case(model_type, args.device)
        wrong += o.status == "WRONG"
        print(f"| {o.model_type} | {o.status} | {o.detail} |", flush=True)
    return 1 if wrong else 0


# The GPU check's part (`python -m jupyter_pagedkv.bench gpu`): the README's exact architectures on
# the device with the Triton kernels (in the CPU rehearsal, in Triton's interpreter), where
# soft-capped models are refused.
GPU_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite",
             "gpt_neox", "starcoder2", "cohere", "cohere2", "mixtral", "qwen2_moe")
SMOKE_TYPES = ("llama", "gemma2", "qwen3")


def gpu_part(report, smoke: bool) -> None:
    from .report import device

    dev = device()
    types = SMOKE_TYPES if smoke else GPU_TYPES
    report.line(f"tiny random models on {dev}, Triton attention; {PROMPT_LEN}-token prompts "
                f"(5 sliding windows), {NEW_TOKENS} new tokens, against transformers generate on the device")
    report.line("")
    report.line("| architecture | outcome | detail | s |\n|---|---|---|---:|")
    rows = []
    for model_type in types:
        o = run_case(model_type, str(dev), backend="triton")
        rows.append({"type": o.model_type, "status": o.status, "detail": o.detail, "seconds": round(o.seconds, 1)})
        report.row("architectures", rows[-1])
        report.line(f"| {o.model_type} | {o.status} | {o.detail} | {o.seconds:.1f} |")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report.finish(bool(rows) and not any(r["status"] == "WRONG" for r in rows))


PARTS = {"architectures": gpu_part}
