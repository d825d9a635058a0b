"""The embedded SmolLM2-135M-Instruct: exact greedy output, prefix caching, fast cached loading."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import assert_same_or_near_tie, hf_greedy
from jupyter_pagedkv import SamplingParams

pytestmark = pytest.mark.slow

TOPICS = ["the moon", "bread", "a lighthouse", "tea", "rivers", "chess", "bees", "snow",
          "volcanoes", "libraries", "trains", "owls", "glass", "maps", "clocks", "salt"]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i, topic in enumerate(TOPICS[:n]):
        detail = " Mention one surprising fact, and say why it matters." * (i % 4)
        msgs = [{"role": "user", "content": f"Tell me about {topic} in one short paragraph.{detail}"}]
        prompts.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    return prompts


def test_sixteen_mixed_prompts_match_hf_generate(embedded, make_engine):
    model, tokenizer = embedded
    prompts = chat_prompts(tokenizer, 16)
    assert len({len(p) for p in prompts}) >= 4
    params = SamplingParams(max_tokens=24, temperature=0.0)
    engine = make_engine(model, tokenizer)
    outs = engine.generate(prompts, params)
    refs = [hf_greedy(model, p, 24, stop_at_eos=True) for p in prompts]
    identical = [assert_same_or_near_tie(model, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(identical) >= 15


def test_generates_to_its_own_eos_and_stops_there(embedded, make_engine):
    """No ignore_eos, no stop list, room for 40 tokens: the model ends its answer itself (the
    oracle's last token is EOS, well before the limit), and so does the engine: finish reason
    "stop", the EOS id last in token_ids, and not in the text."""
    model, tokenizer = embedded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2? Answer with the number only."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = hf_greedy(model, prompt, 40, stop_at_eos=True)
    assert ref[-1] == tokenizer.eos_token_id and len(ref) < 40
    out = make_engine(model, tokenizer).generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason is None
    assert out.token_ids == ref
    assert out.text == tokenizer.decode(ref[:-1]) and tokenizer.eos_token not in out.text


def test_shared_200_token_prefix_is_served_from_cache(embedded, make_engine):
    model, tokenizer = embedded
    passage = ("The harbour town woke slowly. Fishing boats rocked against the pier while gulls "
               "argued over scraps, and the baker opened his shutters to the smell of rain. ") * 6

    def ask(question):
        msgs = [{"role": "system", "content": passage}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)

    a, b = ask("Who opened the shutters?"), ask("What were the gulls doing?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared >= 200
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine = make_engine(model, tokenizer)
    first = engine.generate([a], params)[0]
    hits_before = engine.stats().prefix_cache_hits
    second = engine.generate([b], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 192
    assert engine.stats().prefix_cache_hits - hits_before == second.num_cached_tokens
    assert_same_or_near_tie(model, b, second.token_ids, hf_greedy(model, b, 8, stop_at_eos=True))


def test_evicted_prefix_is_recomputed_correctly(embedded, make_engine):
    model, tokenizer = embedded
    prompt = tokenizer("Once upon a time in a quiet valley, " * 8).input_ids
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine = make_engine(model, tokenizer, num_blocks=12)
    before = engine.generate([prompt], params)[0].token_ids
    evictions = engine._pool.num_evictions
    # Another long prompt takes every block and evicts the cached prefix.
    other = tokenizer("Rain fell on the old stone bridge. " * 30).input_ids[:11 * 16 - 3]
    engine.generate([other], params)
    assert engine._pool.num_evictions > evictions
    again = engine.generate([prompt], params)[0]
    assert again.num_cached_tokens < len(prompt) // 16 * 16
    assert again.token_ids == before


def test_a_second_load_in_a_new_process_reads_the_converted_cache(embedded):
    """The session fixture has converted the GGUF once; a fresh process loads the cached
    safetensors and converts nothing (how long that takes is the demo's business, not a test's)."""
    from jupyter_pagedkv.worker.loader import embedded_model_dir

    cached = embedded_model_dir() / "model.safetensors"
    stamp = cached.stat().st_mtime_ns
    code = textwrap.dedent("""
        import torch
        from jupyter_pagedkv.worker.loader import load_model
        loaded = load_model(None, torch.float32, torch.device("cpu"))
        print(loaded.source, loaded.name)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["cache", "SmolLM2-135M-Instruct"], out.stdout
    assert cached.stat().st_mtime_ns == stamp                    # nothing was converted again


def test_chat_applies_the_template_and_answers(embedded, make_engine):
    model, tokenizer = embedded
    engine = make_engine(model, tokenizer)
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.prompt_token_ids[:3] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True, return_dict=False)[:3]


def test_the_simulator_reproduces_the_embedded_models_schedule(embedded, make_engine):
    """Offline batch under memory pressure: the simulator, fed the real prompts and outputs,
    schedules every step, preemption and completion exactly as the engine did."""
    from jupyter_pagedkv.sim.serve import TimedPrompt
    from jupyter_pagedkv.sim.validate import offline_check

    model, tokenizer = embedded
    prompts = chat_prompts(tokenizer, 6)
    timed = [TimedPrompt(f"e{i}", 0.0, p, SamplingParams(max_tokens=8 + 2 * i, temperature=0.0))
             for i, p in enumerate(prompts)]
    # 16 blocks: the six prompts share their system-prompt block from the first step, and 20
    # blocks no longer forced a preemption.
    engine = make_engine(model, tokenizer, num_blocks=16)
    check, _ = offline_check(engine, timed)
    assert check.identical, check.line()
    assert check.real_preemptions > 0


def test_benchmark_conversations_carry_their_own_history(embedded, make_engine):
    """bench tail's real workload: each request's earlier turns answered by the model itself."""
    from jupyter_pagedkv.sim.workload import FOLLOW_UPS, chat_requests, with_history

    engine = make_engine(*embedded, num_blocks=64)
    requests = chat_requests(2, seed=0)
    conversations = with_history(engine, requests, turns=2, reply_tokens=8)
    for i, (conv, req) in enumerate(zip(conversations, requests)):
        assert conv[0] == req.messages[0]
        assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant", "user"]
        assert conv[2]["content"] == FOLLOW_UPS[i % len(FOLLOW_UPS)]
        first = engine.chat([req.messages], SamplingParams(max_tokens=8, temperature=0.0))[0].text.strip()
        assert conv[1]["content"] == first          # the reply the model gives to the first question
    assert req.messages == [req.messages[0]]         # the requests themselves are left as they were


def test_a_looping_greedy_answer_is_found_and_is_the_models_own(embedded, make_engine):
    """The demo's loop note is true: this prompt loops under fp32 greedy decoding, the detector
    finds the loop, and transformers' own `generate` gives the very same tokens."""
    from jupyter_pagedkv.notebook.loops import check_against_transformers, find_loop

    model, tokenizer = embedded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about a cat sleeping in the sun."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    out = make_engine(model, tokenizer).generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    loop = find_loop(out.token_ids)
    assert loop is not None and loop.repeats >= 4, out.text
    check = check_against_transformers(model, prompt, out.token_ids, 40)
    assert check.identical and "identical to transformers' generate" in check.line(loop)
