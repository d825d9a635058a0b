"""Seeded workloads shared by benchmarks, so every system sees exactly the same requests."""
from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = ["the moon", "sourdough bread", "lighthouses", "green tea", "river deltas", "chess openings",
            "honey bees", "snowflakes", "volcanoes", "public libraries", "night trains", "barn owls",
            "stained glass", "old maps", "pendulum clocks", "sea salt"]
ASKS = ["Tell me about {s} in one short paragraph.",
        "Give three facts about {s}, one line each.",
        "Explain {s} to a ten-year-old, then add one detail an expert would mention and why it "
        "matters to people who work with it every day.",
        "Write a short poem about {s}."]


@dataclass(frozen=True)
class BenchRequest:
    messages: list[dict]
    max_tokens: int


def chat_requests(n: int = 32, seed: int = 0, min_tokens: int = 16, max_tokens: int = 128) -> list[BenchRequest]:
    """`n` chat requests of varied length with seeded max_tokens in [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ask = ASKS[i % len(ASKS)].format(s=SUBJECTS[(i * 5) % len(SUBJECTS)])
        out.append(BenchRequest([{"role": "user", "content": ask}], rng.randint(min_tokens, max_tokens)))
    return out
