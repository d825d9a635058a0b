"""The magics in an InteractiveShell (terminal mode: plain incremental prints), on the embedded model.

One engine is loaded for the module; every test leaves it with no live request.
"""
from __future__ import annotations

import _thread
import subprocess
import signal
import sys
import threading
import time

import pytest
import torch
from IPython.core.error import UsageError

from jupyter_pagedkv import BeamSearchParams
from jupyter_pagedkv.notebook import session as session_mod
from jupyter_pagedkv.notebook.session import current
from jupyter_pagedkv.notebook.streaming import footer

pytestmark = pytest.mark.slow

GEN = "%%generate --max-tokens 8"


@pytest.fixture(scope="module")
def ip():
    from IPython.testing.globalipapp import get_ipython, start_ipython

    shell = start_ipython() or get_ipython()   # None once another module started it
    shell.run_line_magic("load_ext", "jupyter_pagedkv")
    shell.run_line_magic("pagedkv", "load --kv-cache-memory 128MiB --dtype float32")
    yield shell
    if current().engine is not None:
        current().unload()


def run(ip, cell: str):
    """Run a cell; re-raise what it raised (UsageError included) so tests can assert on it."""
    result = ip.run_cell(cell)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result.result


@pytest.fixture(autouse=True)
def engine_left_clean(request):
    yield
    engine = current().engine
    if engine is not None and "ip" in request.fixturenames:
        assert current().wait_background(120)
        assert not engine.live_requests()
        engine.check_invariants()
        assert all(b.ref_count == 0 for b in engine._pool.blocks)


def greedy_alone(prompt_text: str, max_tokens: int) -> str:
    """The reference: the same chat-templated prompt, alone on the engine, greedy."""
    from jupyter_pagedkv import SamplingParams

    engine = current().engine
    ids = engine.apply_chat_template([{"role": "user", "content": prompt_text}])
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


# -- the extension itself -------------------------------------------------------------------------

def test_loading_the_extension_does_not_import_torch_or_transformers():
    code = ("import sys\nfrom IPython.testing.globalipapp import start_ipython\nip = start_ipython()\n"
            "ip.run_line_magic('load_ext', 'jupyter_pagedkv')\n"
            "assert 'pagedkv' in ip.magics_manager.magics['line']\n"
            "assert 'generate' in ip.magics_manager.magics['cell']\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]")


def test_every_magic_documents_its_options(ip):
    assert "--kv-cache-memory" in ip.find_line_magic("pagedkv").__doc__
    doc = ip.find_cell_magic("generate").__doc__
    for option in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--n", "--beams",
                   "--system", "--raw", "--stop", "--speculative", "--out", "--no-stream", "--background"):
        assert option in doc, option
    assert "--reset" in ip.find_cell_magic("chat").__doc__


def test_without_an_engine_magics_say_to_load_one(ip, monkeypatch, capsys):
    monkeypatch.setattr(session_mod, "_current", session_mod.KernelSession())
    for cell in (f"{GEN}\nhello", "%%chat\nhello", "%pagedkv requests", "%pagedkv reset-cache"):
        with pytest.raises(UsageError, match=r"no model loaded: run `%pagedkv load`"):
            run(ip, cell)
    run(ip, "%pagedkv status")
    assert "no model loaded" in capsys.readouterr().out


# -- %pagedkv ---------------------------------------------------------------------------------------

def test_load_summary_line_states_the_kv_geometry(ip):
    line = "loaded " + current().summary_line()
    engine = current().engine
    assert f"{engine._pool.num_blocks:,} blocks × 16 = {engine._pool.num_blocks * 16:,} tokens" in line
    assert f"{46080 * 16:,} bytes per block" in line
    assert "SmolLM2-135M-Instruct on cpu (float32)" in line
    # %pagedkv load owns its model: each weight is held once, packed (no second copy).
    assert engine._hold_weights and engine._runner.packed.extra_bytes == 0
    native = engine._runner.plan.prefill_attention.choice == "native"
    kind = ("prefill attention in C++ (prefill_attention.cpp)" if native
            else "prefill attention by torch's SDPA (this CPU lacks AVX-512)")
    assert line.endswith("GEMMs on packed weights (each weight held once), steps in the lean loop "
                         f"(decode steps in C++), {kind}")


def test_status_monitor_and_requests_show_the_pool(ip, capsys):
    run(ip, f"{GEN} --out o\nSay hi.")
    capsys.readouterr()
    run(ip, "%pagedkv status")
    status = capsys.readouterr().out
    assert "blocks:" in status and "prefix cache:" in status and "engine thread: running" in status
    plan = current().engine._runner.plan
    assert f"execution plan:\n  backend: {plan.backend}\n  decode steps: {plan.decode_steps}\n" in status
    assert f"  forward: native ({plan.forward.reason})\n" in status      # the embedded model: C++ decode steps
    run(ip, "%pagedkv monitor")
    assert "legend (one character per block): . free  c cached" in capsys.readouterr().out
    run(ip, "%pagedkv requests")
    table = capsys.readouterr().out
    rid = ip.user_ns["o"].request_id
    row = next(line for line in table.splitlines() if line.startswith(rid + " "))
    assert "generate" in row and "done (length)" in row and " ms" in row
    assert table.splitlines()[0].split() == ["id", "source", "state", "prompt", "output", "blocks",
                                             "cached", "TTFT"]


def test_reset_cache_drops_cached_blocks(ip, capsys):
    run(ip, f"{GEN}\nName a colour.")
    assert current().engine.stats().num_cached > 0
    run(ip, "%pagedkv reset-cache")
    assert "prefix cache cleared" in capsys.readouterr().out
    assert current().engine.stats().num_cached == 0


@pytest.mark.parametrize("line, message", [
    ("%pagedkv load --num-blocks 10 --kv-cache-memory 1MiB", "not both"),
    ("%pagedkv load /no/such/model", "cannot load: no model folder at /no/such/model"),
    ("%pagedkv load nobody/no-such-model", "not in the local Hugging Face cache"),
    ("%pagedkv load --dtype float13", "unknown dtype 'float13'"),
    pytest.param("%pagedkv load --device cuda", "no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    ("%pagedkv status --block-size 8", "only applies to `%pagedkv load`"),
    ("%pagedkv frobnicate", "invalid choice"),
])
def test_bad_pagedkv_lines_are_one_usage_error(ip, line, message):
    engine = current().engine
    with pytest.raises(UsageError, match=message):
        run(ip, line)
    assert current().engine is engine and engine.is_running   # a typo does not cost the engine


# -- %%generate -----------------------------------------------------------------------------------------

def test_generate_streams_greedy_text_and_stores_it_with_out(ip, capsys):
    run(ip, f"{GEN} --out answer\nWhat is the capital of France?")
    printed = capsys.readouterr().out
    out = ip.user_ns["answer"]
    assert out.text == greedy_alone("What is the capital of France?", 8)
    assert printed.startswith(out.text)
    assert footer(out) in printed


def test_generate_speculative_ngram_is_exact_and_counts_drafts(ip):
    cell = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox."
    before = current().engine.stats().spec_proposed_tokens
    run(ip, f"%%generate --max-tokens 24 --speculative ngram --no-stream --out s\n{cell}")
    assert ip.user_ns["s"].text == greedy_alone(cell, 24)
    assert current().engine.stats().spec_proposed_tokens > before


@pytest.fixture
def terminal_writes(monkeypatch) -> list[str]:
    """Every string the terminal renderer writes, in order."""
    from jupyter_pagedkv.notebook import streaming

    writes: list[str] = []
    original = streaming.PrintRenderer.__init__
    monkeypatch.setattr(streaming.PrintRenderer, "__init__",
                        lambda self, write=None: original(self, writes.append))
    return writes


def test_generate_prints_text_incrementally_in_a_terminal(ip, terminal_writes):
    writes = terminal_writes
    run(ip, "%%generate --max-tokens 6 --out o\nCount from one to ten.")
    pieces = [w for w in writes if not w.startswith("\n[")]
    assert len(pieces) >= 2, writes          # several increments, not one final print
    assert "".join(pieces) == ip.user_ns["o"].text


def test_separated_prompts_run_concurrently_with_labels(ip, capsys):
    run(ip, f"{GEN} --out pair\nName a fruit.\n---\nName an animal.")
    printed = capsys.readouterr().out
    first, second = ip.user_ns["pair"]
    assert "── [1] Name a fruit. ──" in printed and "── [2] Name an animal. ──" in printed
    # Both were in the engine at once: each started before the other finished.
    assert first.metrics.first_scheduled_time < second.metrics.finish_time
    assert second.metrics.first_scheduled_time < first.metrics.finish_time
    assert first.text == greedy_alone("Name a fruit.", 8)
    assert second.text == greedy_alone("Name an animal.", 8)


def test_braces_interpolate_user_variables(ip):
    ip.user_ns["city"] = "Paris"
    run(ip, f"{GEN} --out o\nWhat is {{city}} known for? Answer as JSON like {{\"a\": 1}}.")
    prompt = current().engine.tokenizer.decode(ip.user_ns["o"].prompt_token_ids)
    assert 'What is Paris known for? Answer as JSON like {"a": 1}.' in prompt


def test_an_undefined_variable_is_a_usage_error(ip):
    with pytest.raises(UsageError, match=r"\{nowhere\} but 'nowhere' is not defined"):
        run(ip, f"{GEN}\nTell me about {{nowhere}}.")


def test_system_and_raw_and_stop(ip):
    run(ip, "%%generate --max-tokens 8 --system 'You are a pirate.' --out o\nGreet me.")
    prompt = current().engine.tokenizer.decode(ip.user_ns["o"].prompt_token_ids)
    assert "<|im_start|>system\nYou are a pirate.<|im_end|>" in prompt     # quotes removed
    assert "<|im_start|>user\nGreet me.<|im_end|>" in prompt
    run(ip, "%%generate --max-tokens 8 --raw --out r\nThe capital of France is")
    assert ip.user_ns["r"].prompt_token_ids == current().engine.tokenizer("The capital of France is").input_ids
    run(ip, "%%generate --max-tokens 16 --raw --stop ' ' --out s\nOne two three four")
    assert ip.user_ns["s"].finish_reason == "stop" and " " not in ip.user_ns["s"].text.strip()


def test_penalties_and_bad_words_reach_the_request(ip):
    run(ip, "%%generate --max-tokens 12 --raw --out plain\nThe capital of France is")
    assert "Paris" in ip.user_ns["plain"].text
    run(ip, "%%generate --max-tokens 12 --raw --repetition-penalty 1.3 --bad-word Paris --out r\n"
            "The capital of France is")
    out = ip.user_ns["r"]
    assert "Paris" not in out.text
    assert current().engine._requests == {} and out.outputs[0].token_ids


def test_logprobs_are_shown_shaded_and_kept_with_out(ip, capsys):
    run(ip, "%%generate --max-tokens 6 --raw --logprobs 2 --prompt-logprobs 1 --out lp\nThe capital of France is")
    out = ip.user_ns["lp"]
    sample = out.outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids) and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(next(iter(p)) == t and p[t].rank == 1 for p, t in zip(sample.logprobs, sample.token_ids))
    shown = capsys.readouterr().out                    # a terminal IPython shows the text form
    assert "answer\n  least sure: token  p  alternatives" in shown and "prompt\n" in shown


@pytest.mark.parametrize("option, message", [
    ("--n 0", "--n must be a positive integer"),
    ("--n 100000", "n=100000 needs 100000 sequences .* max_num_seqs=64"),
    ("--beams 0", "--beams must be >= 1"),
    ("--beams 2 --temperature 0.5 --n 2", "--beams is deterministic .* --n, --temperature: drop them"),
    ("--beams 2 --speculative ngram", "--beams is deterministic .* --speculative: drop it"),
    ("--speculative no/such/draft-model", "--speculative: no model folder"),
    ("--temperature -1", "temperature must be a finite number >= 0"),
    ("--max-tokens 0", "--max-tokens must be a positive integer"),
    ("--top-p 2", r"--top-p must be a number in \(0, 1\]"),
    ("--repetition-penalty 0", "--repetition-penalty must be a finite number > 0"),
    ("--presence-penalty 3", r"--presence-penalty must be in \[-2, 2\]"),
    ("--min-tokens 9 --max-tokens 4", r"--min-tokens \(9\) must not exceed --max-tokens \(4\)"),
    ("--beams 2 --repetition-penalty 1.2", "--beams is deterministic .* --repetition-penalty: drop it"),
    ("--logprobs 21", r"--logprobs must be None or an integer in \[0, 20\]"),
    ("--beams 2 --prompt-logprobs 1", "--beams is deterministic .* --prompt-logprobs: drop it"),
    ("--out 2x", "not a valid variable name"),
    ("--max-tokens many", "invalid int value"),
    ("--system 'unclosed", "cannot read the options: No closing quotation"),
    ("--json-schema nothing_here", "'nothing_here' is not defined"),
    ("--json-schema In", "In is a list; it must be a JSON-schema dict or a pydantic model class"),
    ("--regex 'a(b'", "structured_outputs.regex was refused by xgrammar: .*parenthesis"),
    ("--choice a, ", "--choice must be a non-empty list of non-empty strings"),
    ("--regex a --choice a,b", "--regex and --choice cannot be combined"),
    ("--beams 2 --choice a,b", "--beams is deterministic .* --choice: drop it"),
    ("--logit-bias 7", "--logit-bias item '7': write TOKEN_ID=BIAS"),
    ("--allowed-token-ids 1,,2", "--allowed-token-ids '1,,2': an empty item"),
    ("--allowed-token-ids 99999999", r"allowed_token_ids: token ids \[99999999\] are not in the vocabulary"),
])
def test_bad_generate_options_are_one_usage_error(ip, option, message):
    with pytest.raises(UsageError, match=message):
        run(ip, f"%%generate {option}\nhello")


def test_a_json_schema_class_fills_out_with_a_validated_instance(ip):
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str
        country: Literal["France", "Italy", "Spain"]
        population_millions: int = Field(ge=0, le=99)   # unbounded, the 135M model writes 1111...

    ip.user_ns["City"] = City
    run(ip, "%%generate --max-tokens 48 --json-schema City --out city\nGive Paris as JSON.")
    assert isinstance(ip.user_ns["city"], City)
    ip.user_ns["city_schema"] = City.model_json_schema()
    run(ip, "%%generate --max-tokens 48 --json-schema city_schema --out raw\nGive Rome as JSON.")
    assert City.model_validate_json(ip.user_ns["raw"].text) and ip.user_ns["raw"].finish_reason == "stop"


def test_regex_choice_logit_bias_and_allowed_ids_reach_the_request(ip):
    run(ip, "%%generate --max-tokens 8 --choice yes,no --out yn\nIs Paris in France?")
    assert ip.user_ns["yn"].text in ("yes", "no") and ip.user_ns["yn"].finish_reason == "stop"
    # (IPython expands {...} in a magic line: a regex writes [0-9]{{4}} there, or repeats itself)
    run(ip, "%%generate --max-tokens 12 --regex '[0-9][0-9][0-9][0-9]' --out year\nWhen did the Berlin wall fall?")
    assert len(ip.user_ns["year"].text) == 4 and ip.user_ns["year"].text.isdigit()
    tok = current().engine.tokenizer
    allowed = tok(" banana apple", add_special_tokens=False).input_ids
    run(ip, f"%%generate --max-tokens 4 --allowed-token-ids {','.join(map(str, allowed))} --out a\nFruit:")
    assert set(ip.user_ns["a"].outputs[0].token_ids) <= set(allowed)
    run(ip, "%%generate --max-tokens 6 --raw --out plain\nThe capital of France is")
    first = ip.user_ns["plain"].outputs[0].token_ids[0]
    run(ip, f"%%generate --max-tokens 6 --raw --logit-bias {first}=-100 --out biased\nThe capital of France is")
    assert first not in ip.user_ns["biased"].outputs[0].token_ids


def test_n_samples_all_appear_and_are_stored(ip, capsys):
    run(ip, "%%generate --max-tokens 6 --n 3 --temperature 0.9 --seed 7 --out samples\nName a colour.")
    printed = capsys.readouterr().out
    out = ip.user_ns["samples"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert printed.startswith(f"── sample 1/3 ──\n{out.outputs[0].text}")
    for o in out.outputs[1:]:
        assert f"\n\n── sample {o.index + 1}/3 ──\n{o.text}" in printed
    assert f"[{sum(len(o.token_ids) for o in out.outputs)} tokens generated" in printed


def test_beams_show_every_hypothesis_best_first(ip, capsys):
    run(ip, "%%generate --max-tokens 4 --beams 2 --out beams\nName a colour.")
    printed = capsys.readouterr().out
    out = ip.user_ns["beams"]
    engine = current().engine
    ref = engine.beam_search([out.prompt_token_ids], BeamSearchParams(beam_width=2, max_tokens=4))[0]
    assert [o.token_ids for o in out.outputs] == [s.token_ids for s in ref.sequences]
    assert [o.score for o in out.outputs] == pytest.approx([s.score for s in ref.sequences], abs=1e-4)
    assert printed.startswith(f"── beam 1/2 ──\n{out.outputs[0].text}")
    assert f"\n\n── beam 2/2 ──\n{out.outputs[1].text}" in printed


def test_a_prompt_too_long_for_the_pool_is_a_usage_error(ip):
    # 6,000 new tokens fit the model's context (8,192) but not the 128 MiB pool (2,912 tokens).
    with pytest.raises(UsageError, match="lower max_tokens or load with more"):
        run(ip, "%%generate --max-tokens 6000\nhello")
    with pytest.raises(UsageError, match="exceeds the model's context of 8192: lower max_tokens to 81"):
        run(ip, "%%generate --max-tokens 100000\nhello")


def test_no_stream_prints_only_the_result(ip, terminal_writes):
    writes = terminal_writes
    run(ip, "%%generate --max-tokens 6 --no-stream --out o\nCount from one to ten.")
    assert writes[0] == ip.user_ns["o"].text


# -- %%chat -----------------------------------------------------------------------------------------

def test_second_chat_turn_hits_the_first_turn_in_the_prefix_cache(ip, capsys):
    run(ip, "%%chat t --max-tokens 12 --out one\nMy name is Ada and I like prime numbers. Remember that.")
    first = ip.user_ns["one"]
    run(ip, "%%chat t --max-tokens 8 --out two\nWhat is my name?")
    printed = capsys.readouterr().out
    second = ip.user_ns["two"]
    chat = current().chats["t"]
    assert chat.reused_tokens                                  # the reply's tokens were kept as generated
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.token_ids)] == \
        first.prompt_token_ids + first.token_ids
    computed = len(first.prompt_token_ids) + len(first.token_ids) - 1   # the last token never ran
    assert second.num_cached_tokens >= computed // 16 * 16 > 0
    assert f"{second.num_cached_tokens}/{len(second.prompt_token_ids)} prompt tokens cached" in printed
    assert "TTFT" in printed and "tok/s" in printed


def test_why_explains_a_request_and_a_chat_turn_that_recomputed_what_was_cached(ip, capsys):
    run(ip, "%%chat why --max-tokens 8\nMy name is Ada and I like prime numbers. Remember that.")
    capsys.readouterr()
    run(ip, "%pagedkv why")                                     # the last request: that turn
    assert "prompt blocks hit the prefix cache" in capsys.readouterr().out
    run(ip, "%pagedkv reset-cache")
    run(ip, "%%chat why --max-tokens 4 --out two\nWhat is my name?")
    printed = capsys.readouterr().out
    report = current().engine.why(ip.user_ns["two"].request_id)
    assert report.num_reusable > 1 and report.line() in printed and "reset_prefix_cache()" in printed
    with pytest.raises(UsageError, match="no request 'nope'"):
        run(ip, "%pagedkv why nope")


def test_chat_sessions_are_separate_and_listed(ip, capsys):
    run(ip, "%%chat alpha --max-tokens 4\nHello.")
    run(ip, "%%chat beta --max-tokens 4\nBonjour.")
    assert current().chats["alpha"].messages[0]["content"] == "Hello."
    assert current().chats["beta"].messages[0]["content"] == "Bonjour."
    capsys.readouterr()
    run(ip, "%pagedkv requests")
    table = capsys.readouterr().out
    assert "alpha: 1 turn" in table and "beta: 1 turn" in table and "chat alpha" in table


def test_chat_reset_forgets_and_unknown_sessions_are_a_usage_error(ip):
    run(ip, "%%chat gamma --max-tokens 4\nHello.")
    run(ip, "%chat gamma --reset")
    assert "gamma" not in current().chats
    with pytest.raises(UsageError, match="no chat session 'nobody' to reset"):
        run(ip, "%chat nobody --reset")
    with pytest.raises(UsageError, match="no message"):
        run(ip, "%chat gamma")


# -- interrupt, background ---------------------------------------------------------------------------

@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler, whatever this process inherited: a test runner started in the
    background of a non-interactive shell ignores SIGINT, and `interrupt_main` then does nothing."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def interrupt_once_generating(origin: str) -> None:
    """Ctrl-C (SIGINT to the main thread) once a request of `origin` has produced two tokens."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "use the sigint_raises fixture"
    engine = current().engine

    def watch():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            mine = [r for r in engine.live_requests() if current().origins.get(r.request_id) == origin]
            if mine and mine[0].seqs[0].num_output_tokens >= 2:
                _thread.interrupt_main()
                return
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def test_ctrl_c_aborts_the_cells_requests_and_frees_their_blocks(ip, capsys, sigint_raises):
    engine = current().engine
    run(ip, "%%generate --max-tokens 40 --background --out survivor\nTell me about the sea.")
    interrupt_once_generating("generate")
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run(ip, "%%generate --max-tokens 400\nWrite a long story.\n---\nWrite a long poem.")
    assert time.monotonic() - t0 < 30
    assert "interrupted: aborted 2 requests of this cell" in capsys.readouterr().err
    assert [current().origins[r.request_id] for r in engine.live_requests()] == ["background"]
    assert current().wait_background(120)
    assert ip.user_ns["survivor"].finish_reason == "length"     # the background job kept running
    assert not engine.live_requests()
    engine.check_invariants()
    assert all(b.ref_count == 0 for b in engine._pool.blocks)
    run(ip, f"{GEN} --out after\nStill there?")                    # the engine keeps serving
    assert ip.user_ns["after"].finish_reason == "length"


def test_ctrl_c_in_a_chat_drops_the_turn_and_keeps_the_session(ip, capsys, sigint_raises):
    run(ip, "%%chat calm --max-tokens 4\nHello.")
    before = list(current().chats["calm"].messages)
    interrupt_once_generating("chat calm")
    with pytest.raises(KeyboardInterrupt):
        run(ip, "%%chat calm --max-tokens 400\nTell me a very long story.")
    assert "interrupted: aborted 1 request of this cell" in capsys.readouterr().err
    assert current().chats["calm"].messages == before
    engine = current().engine
    assert not engine.live_requests() and all(b.ref_count == 0 for b in engine._pool.blocks)
    run(ip, "%%chat calm --max-tokens 4 --out o\nStill there?")
    assert len(current().chats["calm"].messages) == len(before) + 2


def test_background_requests_share_the_engine_with_a_foreground_cell(ip, capsys):
    prompts = ["Name a planet.", "Name a river.", "Name a mountain."]
    run(ip, f"{GEN} --background --out bg1\n{prompts[0]}")
    run(ip, f"{GEN} --background --out bg2\n{prompts[1]}")
    assert "running; the result prints here when done" in capsys.readouterr().out
    run(ip, f"{GEN} --out fg\n{prompts[2]}")
    assert current().wait_background(120)
    outs = [ip.user_ns["bg1"], ip.user_ns["bg2"], ip.user_ns["fg"]]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert [o.text for o in outs] == [greedy_alone(p, 8) for p in prompts]
    assert "background req-" in capsys.readouterr().out


def test_pagedkv_bench_runs_the_bench_module_in_a_subprocess(ip, capsys):
    run(ip, "%pagedkv bench --help")
    assert "usage: python -m jupyter_pagedkv.bench" in capsys.readouterr().out
    with pytest.raises(UsageError, match="the benchmark exited with status 2"):
        run(ip, "%pagedkv bench no-such-bench")


def test_pagedkv_bench_tail_shows_its_plot(ip, capsys, tmp_path, monkeypatch):
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    run(ip, f"%pagedkv bench tail --scale sim --sim-requests 40 --sim-rates 1 4 --sim-scale-check 0 "
            f"--plot-dir {tmp_path}")
    out = capsys.readouterr().out
    assert "P99 end-to-end latency reaches 60 s (interpolated" in out and "P99 TTFT reaches 5 s" in out
    assert "swap vs recompute" in out
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)
    assert (tmp_path / "tail_sim.png").read_bytes()[:4] == b"\x89PNG"


def test_pagedkv_plan_prints_the_arithmetic_and_plots_concurrency(ip, capsys, monkeypatch):
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    run(ip, "%pagedkv plan Llama-3-70B --gpu H100-80GB --num-gpus 2")
    out = capsys.readouterr().out
    assert "327,680 bytes (320 KiB)" in out and "concurrent requests" in out
    # a PNG, so it renders whatever matplotlib backend the kernel has (a Figure showed as text)
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)
    assert shown[0].data[:4] == b"\x89PNG"


def test_pagedkv_plan_bad_input_is_one_line(ip):
    with pytest.raises(UsageError, match="invalid choice: 'Z80'"):
        run(ip, "%pagedkv plan Llama-3-70B --gpu Z80")
    with pytest.raises(UsageError, match="arguments are required: model"):
        run(ip, "%pagedkv plan")


def test_generate_and_chat_carry_a_tenant(ip):
    """--tenant reaches the request (RequestOutput.tenant); a chat session belongs to the tenant of
    its first turn; a bad name is one UsageError line, nothing left running."""
    run(ip, f"{GEN} --tenant alice --out t_out\nName a colour.")
    assert ip.user_ns["t_out"].tenant == "alice"
    run(ip, "%%chat tenant_s --max-tokens 4 --tenant bob --out t_chat\nHi!")
    assert ip.user_ns["t_chat"].tenant == "bob"
    run(ip, "%%chat tenant_s --max-tokens 4 --out t_chat\nAnd again?")          # continues as bob
    assert ip.user_ns["t_chat"].tenant == "bob"
    with pytest.raises(UsageError, match=r"chat session 'tenant_s' belongs to tenant 'bob': .* for 'carol'"):
        run(ip, "%%chat tenant_s --max-tokens 4 --tenant carol\nMine now?")
    with pytest.raises(UsageError, match=r"^tenant must be a non-empty string such as 'alice'"):
        run(ip, f'{GEN} --tenant " "\nName a colour.')
    run(ip, "%chat tenant_s --reset")


def test_pagedkv_tenants_table_and_tenant_settings(ip, capsys):
    """`%pagedkv tenant` sets a weight and cap (one line back, one line for bad input);
    `%pagedkv tenants` prints a row per tenant; `%pagedkv status` a line per tenant."""
    capsys.readouterr()
    run(ip, "%pagedkv tenant alice --weight 2 --max-blocks 64")
    assert capsys.readouterr().out.startswith("tenant alice: weight 2, at most 64 blocks; holds 0 blocks")
    run(ip, f"{GEN} --tenant alice\nName a colour.")
    capsys.readouterr()
    run(ip, "%pagedkv tenants")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("policy: fcfs; pool: ")
    assert out[1].split()[:4] == ["tenant", "weight", "cap", "share"]
    alice = next(line.split() for line in out if line.startswith("alice "))
    assert alice[1:3] == ["2", "64"]
    run(ip, "%pagedkv status")
    assert "  alice: 0 blocks (cap 64)" in capsys.readouterr().out
    run(ip, "%pagedkv requests")
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["id", "source", "tenant", "state"]
    assert any(line.split()[2] == "alice" for line in table[1:] if line.strip())
    with pytest.raises(UsageError, match=r"^tenant 'alice': weight must be a positive number"):
        run(ip, "%pagedkv tenant alice --weight -1")
    with pytest.raises(UsageError, match=r"^usage: %pagedkv tenant NAME"):
        run(ip, "%pagedkv tenant")
    run(ip, "%pagedkv tenant alice --max-blocks 1")
    with pytest.raises(UsageError, match=r"^tenant 'alice' may hold at most 1 blocks \(max_blocks\)"):
        run(ip, f"{GEN} --tenant alice\nName a colour.")
    current().engine.set_tenant("alice", max_blocks=None)


# -- reload, unload (last: they take the module's engine away) ------------------------------------------

def test_loading_again_replaces_the_engine_cleanly(ip, capsys):
    run(ip, "%%chat keep --max-tokens 4\nHello.")
    old = current().engine
    run(ip, "%pagedkv load --kv-cache-memory 64MiB --block-size 8 --dtype float32")
    new = current().engine
    assert new is not old and not old.is_running and old.model is None   # shut down, weights dropped
    assert new.block_size == 8 and new.is_running
    assert current().chats["keep"].token_ids == []     # old token ids are re-templated on the new model
    run(ip, "%%chat keep --max-tokens 4 --out o\nAgain.")
    assert [m["content"] for m in current().chats["keep"].messages][::2] == ["Hello.", "Again."]


def test_unload_gives_the_memory_back(ip, capsys):
    """After `%pagedkv unload` nothing holds the engine, its model or its KV tensors any more, so
    their memory is free (what the process's RSS then does is up to the allocator, not a test)."""
    import weakref

    run(ip, "%pagedkv load --kv-cache-memory 128MiB --dtype float32")
    run(ip, f"{GEN}\nHello.")
    engine = current().engine
    refs = [weakref.ref(x) for x in (engine, engine.model, engine._kv_cache.k, engine._kv_cache.v,
                                      next(engine.model.parameters()))]
    del engine
    run(ip, "%pagedkv unload")
    out = capsys.readouterr().out
    assert "unloaded SmolLM2-135M-Instruct: process memory" in out and "→" in out
    assert current().engine is None
    import gc
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
