"""`bench throughput --shapes`' seeded workload shapes: replayable, covering what they promise.
Nothing is timed and no model is loaded."""
from __future__ import annotations

import pytest

from jupyter_pagedkv.sim.workload import OUTPUT_RANGES, draw_shapes, shape_requests


def test_the_same_seed_replays_the_same_shapes_and_texts():
    a, b = draw_shapes(8, seed=3), draw_shapes(8, seed=3)
    assert a == b
    assert [shape_requests(s) for s in a] == [shape_requests(s) for s in b]
    # a prefix of the list is the shorter draw: `--shapes 4` runs the first four of `--shapes 8`
    assert draw_shapes(4, seed=3) == a[:4]


def test_another_seed_changes_the_texts():
    one, two = draw_shapes(4, seed=0), draw_shapes(4, seed=1)
    texts = lambda shapes: [r.messages for s in shapes for r in shape_requests(s)]  # noqa: E731
    assert texts(one) != texts(two)


def test_any_four_shapes_cover_every_corner_and_8_to_64_requests():
    for start in (0, 4):
        shapes = draw_shapes(8, seed=0)[start:start + 4]
        assert {(s.outputs, s.prefix) for s in shapes} == {(o, p) for o in OUTPUT_RANGES for p in ("shared", "distinct")}
        assert sorted(s.requests for s in shapes) == [8, 16, 32, 64]


def test_requests_follow_their_shape():
    for shape in draw_shapes(4, seed=5):
        reqs = shape_requests(shape)
        assert len(reqs) == shape.requests
        lo, hi = shape.token_range
        assert all(lo <= r.max_tokens <= hi for r in reqs)
        systems = {r.messages[0]["content"] for r in reqs}
        # shared: one system prompt for all; distinct: one each
        assert len(systems) == (1 if shape.prefix == "shared" else shape.requests)
        assert all(r.messages[0]["role"] == "system" and r.messages[1]["role"] == "user" for r in reqs)


def test_no_shapes_is_a_one_line_error():
    with pytest.raises(ValueError, match="positive"):
        draw_shapes(0)
