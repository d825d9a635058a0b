"""Shared fixtures: tiny random models of several architectures, the embedded model, HF references."""
from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, field

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests never reach the model hub (our machines cannot): it is offline for them and for the kernels
# they start, so a hub id fails at once with the offline message; tests of downloading replace the
# hub client (jupyter_pagedkv.worker.hub.snapshot_download).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import pytest  # noqa: E402
import torch  # noqa: E402  (importing torch does not import triton)

# Without CUDA the Triton kernels run in Triton's interpreter; the switch must be set before
# anything imports triton, so it is set for the whole session (nothing else uses Triton on a CPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from jupyter_pagedkv.testing.models import attention, compare_with_oracle, hf_greedy, tiny_model  # noqa: E402,F401

# Property tests draw the same examples on every run and machine (a failure replays as is).
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("replayable", derandomize=True, print_blob=True)
_hypothesis_settings.load_profile("replayable")

# In CI (`.ci/run` exports CI=1) every capability must run: a test that skips (no Chromium, no
# peer venv, no node) fails and says what is missing. Locally a skip stays a skip, with its reason.
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")


def _fail_skip_in_ci(report) -> None:
    """A skipped report becomes a failure that says what was missing."""
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every capability must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


def pytest_collection_modifyitems(items):
    """A notebook runs all its cells as one nbval item each, in one kernel started by the first:
    they get the long limit the browser and server tests have (pytest-timeout). nbval fails a
    cell whose kernel sends nothing on iopub for 5 s after its reply (its `output_timeout`); a
    starved kernel may, so each cell waits up to 120 s (the cell's own time limit is separate)."""
    for item in items:
        if item.nodeid.split("::")[0].endswith(".ipynb"):
            item.add_marker(pytest.mark.timeout(1200))
            if hasattr(item, "output_timeout"):
                item.output_timeout = 120


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips while it is collected (`pytest.skip(allow_module_level=True)`,
    `pytest.importorskip` at module level) fails in CI too, like a test that skips."""
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


# The near-tie allowance (fp32): the first difference from the oracle is excused only where the
# oracle's top-2 logits differ by less than NEAR_TIE_EPSILON, and a test may be excused at most one
# near-tie per NEAR_TIES_PER_OUTPUTS outputs it compared (at least one): more is a bug, whatever
# each gap. bf16 tests state their own, relative, epsilon and bound (tests/engine/test_dtypes.py).
NEAR_TIE_EPSILON = 1e-4
NEAR_TIES_PER_OUTPUTS = 8


@dataclass
class NearTieLedger:
    """What one test compared with an oracle: outputs compared, and the near-ties excused."""

    compared: int = 0
    excused: list[str] = field(default_factory=list)

    @property
    def bound(self) -> int:
        return max(1, self.compared // NEAR_TIES_PER_OUTPUTS)

    def check(self) -> None:
        assert len(self.excused) <= self.bound, (
            f"{len(self.excused)} near-ties in {self.compared} outputs compared with the oracle, over the "
            f"bound of {self.bound} (one per {NEAR_TIES_PER_OUTPUTS}): {'; '.join(self.excused)}")


NEAR_TIES = NearTieLedger()   # the running test's; reset and checked around every test


def assert_same_or_near_tie(model, prompt: list[int], ours: list[int], ref: list[int]) -> bool:
    """Token-identical, or the first difference is a true near-tie (oracle's top-2 gap below
    NEAR_TIE_EPSILON), counted against the test's bound (NearTieLedger).

    Returns True when identical. fp32 reduction order may legitimately flip a near-tie; anything
    else is a bug.
    """
    NEAR_TIES.compared += 1
    found = compare_with_oracle(model, prompt, ours, ref)
    if found.identical:
        return True
    assert found.gap is not None, (
        f"lengths differ without a token difference: ours {len(ours)}, reference {len(ref)}")
    i = found.index
    assert found.gap < NEAR_TIE_EPSILON, (
        f"token {i} differs ({ours[i]} vs {ref[i]}) but the top-2 gap is {found.gap:.3g}")
    NEAR_TIES.excused.append(f"token {i} ({ours[i]} vs {ref[i]}, gap {found.gap:.2g})")
    return False


@pytest.fixture(autouse=True)
def near_tie_bound(request):
    """Every test's near-ties are counted (in its report's user properties) and bounded."""
    NEAR_TIES.compared, NEAR_TIES.excused = 0, []
    yield NEAR_TIES
    if NEAR_TIES.compared:
        request.node.user_properties.append(("near_ties", f"{len(NEAR_TIES.excused)}/{NEAR_TIES.compared}"))
    NEAR_TIES.check()


@dataclass(frozen=True)
class BuiltEngine:
    """An engine a test built: weakly (a property test builds hundreds), plus the small parts the
    invariants read (scheduler, swap space, lock), so one already collected is checked too."""

    engine: weakref.ref
    scheduler: object
    swap: object
    lock: object

    def check_invariants(self) -> None:
        from jupyter_pagedkv.core.invariants import check_invariants

        engine = self.engine()
        if engine is not None:
            engine.check_invariants()
            return
        with self.lock:
            check_invariants(self.scheduler, self.swap)


@pytest.fixture(autouse=True)
def engines_keep_their_invariants():
    """Every engine a test builds, however it builds it (directly, `make_engine`, a magic, a
    benchmark), has its invariants checked when the test ends (under the engine's lock, so a
    background loop may still be running)."""
    from jupyter_pagedkv.engine.engine import Engine

    built: list[BuiltEngine] = []
    init = Engine.__init__

    @functools.wraps(init)
    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(BuiltEngine(weakref.ref(self), self._scheduler, self._swap, self._lock))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "__init__", tracked_init)
        yield built
    for engine in built:
        engine.check_invariants()


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct: (model, tokenizer), loaded once per session."""
    from jupyter_pagedkv.worker.loader import load_model

    loaded = load_model(None, torch.float32, torch.device("cpu"))
    return loaded.model, loaded.tokenizer


@pytest.fixture
def make_engine():
    """Build engines (64 MiB of KV unless told) and stop their background loops when the test ends.
    Speculation is sized without wall-clock measurements (StepCost, which follows the machine's
    load): every draft length keeps its assumed cost, so what is drafted, kept and rejected
    depends on the tokens alone and a test's counts replay on any machine, busy or not."""
    from jupyter_pagedkv import Engine

    engines = []

    def make(model, tokenizer=None, **kwargs):
        kwargs.setdefault("kv_cache_memory", "64MiB")
        engine = Engine(model, tokenizer, **kwargs)
        engine._speculator.cost.observe = lambda num_tokens, seconds: None
        engines.append(engine)
        return engine

    yield make
    for engine in engines:   # their invariants: engines_keep_their_invariants
        engine.stop()
