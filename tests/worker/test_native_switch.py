"""JUPYTER_PAGEDKV_NATIVE=0 stands every C++ kernel down (worker/native_switch.py): each plan takes
its fallback and says why, and insisting on a native path is one clear line. The Makefile's `test`
target runs the exactness tests again under it."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from jupyter_pagedkv.worker import native_switch
from jupyter_pagedkv.worker.plan import Decision, decide_decode_attention, decide_prefill_attention

CPU = torch.device("cpu")
WHY = "JUPYTER_PAGEDKV_NATIVE=0 forces the fallbacks"


@pytest.fixture
def switched_off(monkeypatch):
    monkeypatch.setenv(native_switch.ENV, "0")


@pytest.mark.parametrize("value, off", [("0", True), ("false", True), ("OFF", True), (" no ", True),
                                        ("1", False), ("", False), ("auto", False)])
def test_the_switch_reads_off_words_only(monkeypatch, value, off):
    monkeypatch.setenv(native_switch.ENV, value)
    assert (native_switch.native_disabled() is not None) == off


def test_unset_leaves_native_kernels_allowed(monkeypatch):
    monkeypatch.delenv(native_switch.ENV, raising=False)
    assert native_switch.native_disabled() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_falls_back_to_sdpa_and_says_why(switched_off, dtype):
    assert decide_prefill_attention("auto", CPU, "torch", dtype, 64) == (Decision("sdpa", WHY), None)
    with pytest.raises(ValueError, match=f"^prefill_attention='native' cannot run here: {WHY}; use 'auto'"):
        decide_prefill_attention("native", CPU, "torch", dtype, 64)


def test_decode_attention_falls_back_to_sdpa(switched_off):
    assert decide_decode_attention("auto", CPU, "torch") == (Decision("sdpa", WHY), None)
    with pytest.raises(ValueError, match=f"^decode_attention='native' cannot run here: {WHY}"):
        decide_decode_attention("native", CPU, "torch")


def test_an_engine_runs_every_step_without_cpp_and_stays_exact(switched_off, make_engine):
    from conftest import assert_same_or_near_tie, hf_greedy
    from jupyter_pagedkv import SamplingParams

    model = tiny_model("llama-gqa64")
    engine = make_engine(model, block_size=4)
    runner = engine._runner
    assert runner.prefill_kernel is None and runner.decode_kernel is None
    assert runner.lean is None or runner.lean.native is None
    assert runner.plan.forward.choice != "native" and WHY in runner.plan.prefill_attention.reason
    prompt = [5, 9, 3, 7, 11, 42]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert_same_or_near_tie(model, prompt, out[0].token_ids, hf_greedy(model, prompt, 6, stop_at_eos=False))
    with pytest.raises(ValueError, match="JUPYTER_PAGEDKV_NATIVE=0"):
        make_engine(model, block_size=4, step_loop="native")
