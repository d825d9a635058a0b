"""The lean forward loop: which models get it, why the others do not, and that an engine step
through it computes bit for bit what the model's own forward computes through our attention."""
from __future__ import annotations

import pytest
import torch

from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.testing.models import random_prompts, tiny_model
from jupyter_pagedkv.worker import lean_forward
from jupyter_pagedkv.worker.attention import ATTN_IMPLEMENTATION
from jupyter_pagedkv.worker.packed_linear import PackedLinears, packable_dtypes, packed_gemms

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def tiny_granite():
    """Llama's parts exactly, but scaled embeddings, residuals and logits: only the probe can tell."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GraniteConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0,
                              residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.3)
    return tf.GraniteForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "mistral-window48"])
def test_llama_shaped_models_get_the_lean_loop(arch):
    model = tiny_model(arch)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    lean, why = lean_forward.plan(model, PackedLinears())
    assert lean is not None, why
    assert "lean loop" in why
    # The probe borrows the model's attention setting and gives it back.
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    if arch == "mistral-window48":
        assert {a.window for a in lean.attention} == {48}        # recorded from the model's own call


@pytest.mark.parametrize("arch, reason", [
    ("qwen3", "attention has parts beyond"),        # q_norm / k_norm
    ("phi3", "not exactly the Llama parts"),        # fused qkv_proj / gate_up_proj
])
def test_other_shapes_keep_their_own_forward(arch, reason):
    lean, why = lean_forward.plan(tiny_model(arch), PackedLinears())
    assert lean is None
    assert why.startswith("the model's own forward") and reason in why


def test_the_probe_refuses_a_model_whose_forward_differs_from_its_parts():
    lean, why = lean_forward.plan(tiny_granite(), PackedLinears())
    assert lean is None
    assert "logits differ" in why


def _step_logits(make_engine, model, step_loop: str, **options) -> tuple[list[torch.Tensor], object]:
    """Every step's logits of one engine run over shared-prefix prompts (prefix hits, chunked
    prefill, mixed decode + prefill steps, decode-only steps), and the engine."""
    engine = make_engine(model, step_loop=step_loop, **options)
    seen: list[torch.Tensor] = []
    execute = engine._runner.execute

    def recording(*args, **kwargs):
        chunks, logits = execute(*args, **kwargs)
        seen.append(logits.clone())
        return chunks, logits

    engine._runner.execute = recording
    shared = random_prompts(1, 256, seed=3, lo=40, hi=41)[0]
    prompts = [shared + p for p in random_prompts(6, 256, seed=5, lo=3, hi=30)]
    engine.generate(prompts[:2], GREEDY)              # leaves the shared prefix cached
    engine.generate(prompts, GREEDY)
    return seen, engine


def _assert_same_steps(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs) > 10
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


OPTIONS = dict(block_size=8, max_num_batched_tokens=48, max_num_seqs=4)


@pytest.mark.parametrize("arch, dtype", [("llama", torch.float32), ("mistral-window48", torch.float32),
                                         ("qwen2", torch.float32), ("llama", torch.bfloat16)])
def test_engine_steps_are_bit_identical_to_the_models_own_forward(make_engine, arch, dtype):
    model = tiny_model(arch).to(dtype)
    theirs, _ = _step_logits(make_engine, model, "model", **OPTIONS)
    lean, engine = _step_logits(make_engine, model, "lean", **OPTIONS)
    assert engine._runner.lean is not None and engine._runner.lean.native is None
    _assert_same_steps(lean, theirs)
    # Decode steps in C++ wherever the projections are packed (bf16 only on CPUs with bf16 GEMMs).
    native, engine = _step_logits(make_engine, model, "auto", **OPTIONS)
    loop = engine._runner.lean.native
    if dtype in packable_dtypes():
        assert loop is not None and loop.proven and loop.enabled, engine._runner.plan.forward.reason
        assert "decode steps in C++" in engine.info().summary
    else:
        assert loop is None and "not packed" in engine._runner.plan.forward.reason
    _assert_same_steps(native, theirs)


def test_the_cpp_loop_is_proven_on_its_first_step_and_dropped_if_it_differs(make_engine, monkeypatch):
    """A C++ loop that computed anything else would be caught on its first step, not served."""
    from jupyter_pagedkv.worker.native_decode import NativeDecode

    model = tiny_model("llama")
    theirs, _ = _step_logits(make_engine, model, "model", **OPTIONS)
    run = NativeDecode.run
    monkeypatch.setattr(NativeDecode, "run", lambda self, h, *a: run(self, h, *a) * (1 + 2 ** -10))
    ours, engine = _step_logits(make_engine, model, "native", **OPTIONS)
    loop = engine._runner.lean.native
    assert not loop.enabled and not loop.proven
    assert "steps in the lean loop" in engine.info().summary and "C++" not in engine.info().summary
    _assert_same_steps(ours, theirs)


def test_step_loop_options_that_cannot_run_say_so_in_one_line(make_engine):
    with pytest.raises(ValueError, match="step_loop='native' cannot run this model.*use 'auto'"):
        make_engine(tiny_model("qwen3"), step_loop="native")
    with pytest.raises(ValueError, match="step_loop='native' cannot run this model: .*not packed"):
        make_engine(tiny_model("llama"), step_loop="native", pack_weights=False)
    with pytest.raises(ValueError, match="torch attention backend only"):
        make_engine(tiny_model("llama"), step_loop="lean", attention_backend="triton")
    engine = make_engine(tiny_model("qwen3"))           # auto: its own forward, and why
    assert engine._runner.lean is None and "attention has parts beyond" in engine._runner.plan.forward.reason


def test_the_cpp_loop_builds_here():
    """CI has a compiler: a build failure must fail loudly, not fall back unnoticed."""
    from jupyter_pagedkv.worker.native_decode import load_extension

    assert hasattr(load_extension(), "decode_layers")


def test_held_packed_weights_serve_the_lean_loop():
    """Sibling projections run as one packed GEMM through the handle, the same values as alone."""
    from jupyter_pagedkv.worker.packed_linear import pack_linears

    model = tiny_model("llama")
    if torch.float32 not in packable_dtypes():
        pytest.skip("this torch has no oneDNN packed GEMMs")
    handle = pack_linears(model)
    with torch.inference_mode(), packed_gemms(handle):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False)     # learns the groups
        lean, why = lean_forward.plan(model, handle)
        attn = model.model.layers[0].self_attn
        x = torch.randn(5, 64)
        fused = handle.fused((attn.q_proj, attn.k_proj, attn.v_proj), x)
        apart = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    assert lean is not None, why
    assert handle.groups and torch.equal(fused, apart)
    handle.release()


def test_hooks_added_after_the_build_divert_steps_to_the_models_own_forward(make_engine):
    """A forward hook (activation steering, capture) is honoured: the lean loop would not see it."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 256, seed=11, lo=5, hi=20)
    plain = [o.token_ids for o in make_engine(model, step_loop="model").generate(prompts, GREEDY)]
    engine = make_engine(model)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, args, out: out * 3.0)
    try:
        hooked = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        assert not engine._runner.lean.usable()
        reference = [o.token_ids for o in make_engine(model, step_loop="model").generate(prompts, GREEDY)]
    finally:
        handle.remove()
    assert hooked == reference and hooked != plain          # the hook acted, through the model's forward
    assert engine._runner.lean.usable()
    engine.reset_prefix_cache()       # its cached prompt blocks were computed by the hooked model
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain


def test_the_cpp_loop_lets_other_threads_run_while_it_computes():
    """A notebook's widgets and streams run beside the engine thread: the C++ step releases the GIL.
    With the interpreter never switching threads on its own (a huge switch interval), the other
    thread can run during the call only if the call lets go of the GIL: no timing luck involved."""
    import sys
    import threading
    import time

    from jupyter_pagedkv.worker.native_decode import load_extension

    module, ticks, done = load_extension(), [0], threading.Event()
    layers, t, heads, d = 64, 4, 4, 16
    args = (torch.randn(t, 64), torch.ones(t, 1, d), torch.zeros(t, 1, d),
            [torch.ones(64)] * layers, [1e-6] * layers, [torch.ones(64)] * layers, [1e-6] * layers,
            [torch.ops.mkldnn._reorder_linear_weight(torch.randn(3 * heads * d, 64) * 0.01)] * layers, [None] * layers,
            [torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, heads * d) * 0.01)] * layers, [None] * layers,
            [torch.ops.mkldnn._reorder_linear_weight(torch.randn(256, 64) * 0.01)] * layers, [None] * layers,
            [torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 128) * 0.01)] * layers, [None] * layers,
            torch.zeros(layers, t, 4, heads, d), torch.zeros(layers, t, 4, heads, d), torch.arange(t) * 4,
            torch.arange(t).view(t, 1), torch.ones(t, dtype=torch.int32), heads, heads, d, 128, [0.25] * layers,
            [0] * layers, [0] * (4 * layers), 16, None, None)       # no KV scales: a model-dtype cache

    def spin():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0)             # hands the GIL back, so the main thread can resume

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    thread = threading.Thread(target=spin)
    during, deadline = [], time.monotonic() + 60
    try:
        thread.start()
        # A call that kept the GIL lets one stray tick through at most; one that lets go gives the
        # spinner hundreds (~300 here) if the OS runs it then. A loaded machine may not, for one
        # call of a few ms: call again until one shows it, for up to a minute.
        while (not during or max(during) < 3) and time.monotonic() < deadline:
            before = ticks[0]
            module.decode_layers(*args)
            during.append(ticks[0] - before)
    finally:
        done.set()
        sys.setswitchinterval(interval)
        thread.join()
    assert max(during) >= 3, during


def test_a_module_swapped_after_the_build_diverts_steps_to_the_models_own_forward(make_engine):
    """An adapter wrapped around a projection after the engine was built (as adapter libraries
    inject theirs) is computed: neither loop would know it is there."""
    model = tiny_model("llama")
    prompts = random_prompts(3, 256, seed=13, lo=5, hi=20)
    plain = [o.token_ids for o in make_engine(model, step_loop="model").generate(prompts, GREEDY)]

    class Scaled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 3.0

    engine = make_engine(model)
    attn = model.model.layers[0].self_attn
    original = attn.o_proj
    attn.o_proj = Scaled(original)
    try:
        swapped = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        assert not engine._runner.lean.usable()
        reference = [o.token_ids for o in make_engine(model, step_loop="model").generate(prompts, GREEDY)]
    finally:
        attn.o_proj = original
    assert swapped == reference and swapped != plain
    assert engine._runner.lean.usable()
    engine.reset_prefix_cache()       # its cached prompt blocks were computed by the changed model
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == plain
