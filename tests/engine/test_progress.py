"""`generate(..., use_tqdm=True)`: one progress bar from tqdm.auto (a widget in a notebook)."""
from __future__ import annotations

import tqdm.auto

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams

MODEL = tiny_model("llama", seed=4)


class FakeBar:
    made: list["FakeBar"] = []

    def __init__(self, total: int, **kwargs) -> None:
        self.total, self.n, self.closed = total, 0, False
        FakeBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def test_use_tqdm_counts_finished_requests_on_a_tqdm_auto_bar(make_engine, monkeypatch):
    monkeypatch.setattr(tqdm.auto, "tqdm", FakeBar)
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]
    engine.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    bar = FakeBar.made[-1]
    assert (bar.total, bar.n, bar.closed) == (3, 3, True)
