"""The demo's loop note: a repeated span is found in tokens, and the transformers check tells the truth."""
from __future__ import annotations

import torch

from jupyter_pagedkv.testing.models import hf_greedy, tiny_model
from jupyter_pagedkv.notebook.loops import Loop, check_against_transformers, find_loop


def test_a_phrase_repeated_back_to_back_is_a_loop():
    tokens = [5, 6, 7] + [10, 11, 12, 13] * 6 + [10, 11]
    assert find_loop(tokens) == Loop(start=3, period=4, repeats=6)


def test_a_phrase_repeated_twice_or_far_apart_is_not():
    assert find_loop([10, 11, 12, 13] * 2 + list(range(20, 40))) is None
    assert find_loop([1, 2, 3] + list(range(40, 60)) + [1, 2, 3] + list(range(60, 80))) is None


def test_a_run_shorter_than_min_tokens_is_not_a_loop():
    assert find_loop([9, 9, 9, 9] + list(range(20, 40))) is None     # "!!!!" is not a loop
    assert find_loop([9] * 16 + list(range(20, 40))) == Loop(0, 1, 16)


def test_the_note_says_identical_only_when_transformers_agrees():
    torch.manual_seed(0)
    model = tiny_model("llama")
    prompt = [1, 17, 33, 60, 91]
    ref = hf_greedy(model, prompt, 24, stop_at_eos=True)
    loop = Loop(0, 2, 12)
    same = check_against_transformers(model, prompt, ref, 24)
    assert same.identical and "identical to transformers' generate" in same.line(loop)
    tampered = ref[:5] + [(ref[5] + 1) % 256] + ref[6:]
    other = check_against_transformers(model, prompt, tampered, 24)
    assert not other.identical and other.first_difference == 5
    assert "differs from token 5" in other.line(loop) and "identical" not in other.line(loop)
