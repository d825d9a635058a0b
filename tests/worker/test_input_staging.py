"""The Triton path's step inputs: staged on the host, uploaded in one copy into buffers that
persist; nothing else is built for the kernels (no masks, no per-row tensors)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.testing.models import random_prompts
from jupyter_pagedkv.worker.input_staging import InputStaging, layout

MODEL = tiny_model("llama", seed=5)


def test_fields_round_trip_with_int64_fields_at_even_words():
    staging = InputStaging("cpu", capacity=None)
    fields = [("lens", torch.int32, (3,)), ("ids", torch.int64, (1, 2)), ("tables", torch.int32, (2, 3))]
    placed, used = layout(fields)
    assert [f.offset for f in placed] == [0, 4, 8] and used == 14
    views = staging.fill(fields, {"lens": [1, 2, 3], "ids": [2**40, -1], "tables": [[7], [8, 9, 10]]})
    assert views["lens"].tolist() == [1, 2, 3]
    assert views["ids"].dtype == torch.int64 and views["ids"].tolist() == [[2**40, -1]]
    assert views["tables"].tolist() == [[7, 0, 0], [8, 9, 10]]      # rows zero-padded
    assert staging.num_uploads == 1


def test_staging_grows_when_a_step_needs_more_and_a_fixed_one_refuses():
    staging = InputStaging("cpu")
    big = staging.fill([("ids", torch.int64, (5000,))], {"ids": list(range(5000))})
    assert big["ids"][-1].item() == 4999 and staging.device_words.numel() >= 10000
    fixed = InputStaging("cpu", capacity=8)
    with pytest.raises(ValueError, match="more than this staging's fixed 8"):
        fixed.fill([("ids", torch.int64, (5,))], {"ids": [0] * 5})


def test_a_2d_array_leaves_columns_beyond_it_as_they_were():
    import numpy as np
    staging = InputStaging("cpu", capacity=16)
    fields = [("tables", torch.int32, (2, 4))]
    staging.fill(fields, {"tables": np.arange(8, dtype=np.int32).reshape(2, 4)})
    views = staging.fill(fields, {"tables": np.full((2, 2), 9, dtype=np.int32)})
    assert views["tables"].tolist() == [[9, 9, 2, 3], [9, 9, 6, 7]]
    assert staging.views(fields)["tables"].data_ptr() == views["tables"].data_ptr()   # never moves


class HostData(TorchDispatchMode):
    """Records tensors made from host data (`torch.tensor(...)`) and copies between tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.made, self.copies = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.made += name == "lift_fresh"
        self.copies += name in ("copy_", "_to_copy")
        return func(*args, **(kwargs or {}))


def step_inputs(make_engine, backend: str) -> tuple[HostData, object]:
    engine = make_engine(MODEL, block_size=4, attention_backend=backend)
    for p in random_prompts(3, 256, seed=8, lo=3, hi=20):
        engine.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()                                                    # prefills
    chunks = engine._scheduler.schedule().chunks                      # a decode step
    mode = HostData()
    with mode:
        engine._runner.prepare(chunks)
    for c in chunks:
        engine._scheduler.finish(c.seq, "abort")
    return mode, engine


def test_a_triton_step_builds_no_tensor_and_makes_one_copy(make_engine):
    mode, _ = step_inputs(make_engine, "triton")
    assert (mode.made, mode.copies) == (0, 1)
    # The detector sees the torch path's tensors, built one by one.
    torch_mode, _ = step_inputs(make_engine, "torch")
    assert torch_mode.made >= 5


def test_the_triton_path_is_token_identical_to_transformers_and_counts_one_copy_a_step(make_engine):
    prompts = random_prompts(4, 256, seed=9, lo=2, hi=40)
    engine = make_engine(MODEL, block_size=8, attention_backend="triton", max_num_batched_tokens=48)
    engine.step_timings = []
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for p, o in zip(prompts, engine.generate(prompts, greedy)):
        assert_same_or_near_tie(MODEL, p, o.token_ids, hf_greedy(MODEL, p, 6, stop_at_eos=False))
    assert {t.h2d_copies for t in engine.step_timings} == {1}


def test_the_engine_warms_every_kernel_variant_for_its_layers_with_and_without_the_window(make_engine):
    # On CUDA `Engine.__init__` does this; here the same launches run in Triton's interpreter.
    engine = make_engine(tiny_model("mistral-window48"), block_size=16, attention_backend="triton")
    from jupyter_pagedkv.worker.kernels_bridge import warm_up_model_kernels
    roles = warm_up_model_kernels(engine.model, engine._kv_cache, engine.device)
    once = ["decode", "decode split", "merge", "prefill", "prefill split", "write_kv", "copy_blocks"]
    assert roles == once + once + ["copy_blocks on the cache"]   # unwindowed layers, windowed ones, the real cache
