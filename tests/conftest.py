"""Shared fixtures: tiny random models of several architectures, the embedded model, HF references."""
from __future__ import annotations

import os

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
    they get the long limit the browser and server tests have (pytest-timeout)."""
    for item in items:
        if item.nodeid.split("::")[0].endswith(".ipynb"):
            item.add_marker(pytest.mark.timeout(1200))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips while it is collected (`pytest.skip(allow_module_level=True)`,
    `pytest.importorskip` at module level) fails in CI too, like a test that skips."""
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


def assert_same_or_near_tie(model, prompt: list[int], ours: list[int], ref: list[int]) -> bool:
    """Token-identical, or the first difference is a true near-tie (top-2 logit gap < 1e-4).

    Returns True when identical. fp32 reduction order may legitimately flip a near-tie; anything
    else is a bug.
    """
    found = compare_with_oracle(model, prompt, ours, ref)
    if found.identical:
        return True
    assert found.gap is not None, (
        f"lengths differ without a token difference: ours {len(ours)}, reference {len(ref)}")
    i = found.index
    assert found.gap < 1e-4, f"token {i} differs ({ours[i]} vs {ref[i]}) but the top-2 gap is {found.gap:.3g}"
    return False


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct: (model, tokenizer), loaded once per session."""
    from jupyter_pagedkv.worker.loader import load_model

    loaded = load_model(None, torch.float32, torch.device("cpu"))
    return loaded.model, loaded.tokenizer


@pytest.fixture
def make_engine():
    """Build engines and check the invariants of every one of them when the test ends."""
    from jupyter_pagedkv import Engine

    engines = []

    def make(model, tokenizer=None, **kwargs):
        kwargs.setdefault("kv_cache_memory", "64MiB")
        engine = Engine(model, tokenizer, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()
        engine.check_invariants()
