"""The `%%generate` cell magic in an InteractiveShell (terminal mode: plain incremental prints), on
the embedded model: streaming and `--out`, speculative decoding, several prompts at once,
interpolation, system/raw/stop, penalties, logprobs, bad options, structured outputs, `--n`,
`--beams`, a prompt too long for the pool, `--no-stream`.

One engine is loaded for the module (magics_shell.py); every test leaves it with no live request.
"""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from jupyter_pagedkv import BeamSearchParams
from jupyter_pagedkv.notebook.session import current
from jupyter_pagedkv.notebook.streaming import footer

from magics_shell import GEN, engine_left_clean, greedy_alone, ip, run  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


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
