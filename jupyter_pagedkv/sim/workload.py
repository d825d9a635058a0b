"""Seeded workloads shared by the simulator and the benchmarks, so every system sees exactly the
same requests: chat requests for real engines (`chat_requests`, `with_history`), and request
streams for the simulator and the tail benchmark (`synthetic`).

Length profiles follow the two datasets the PagedAttention paper evaluates on: conversations
shaped like ShareGPT (long prompts, long answers: means ~161 input / ~338 output tokens, heavy
tail) and instructions shaped like Alpaca (short: ~19 / ~58). Lengths are log-normal with those
means, clipped to the context. `max_tokens` is what the client asks for — the cap the contiguous
baseline must reserve — while the output length is where the answer really stops (EOS).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthProfile:
    name: str
    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float
    max_tokens: int   # the client's cap, reserved whole by the contiguous baseline


PROFILES = {p.name: p for p in [
    LengthProfile("sharegpt", 161.3, 1.0, 338.0, 0.9, 1024),
    LengthProfile("alpaca", 19.3, 0.6, 58.5, 0.8, 256),
]}


@dataclass(frozen=True)
class SimRequest:
    """One request: when it arrives, its prompt, and the tokens it will generate (stopping there)."""

    request_id: str
    arrival_s: float
    prompt_ids: list[int]
    output_ids: list[int]
    max_tokens: int
    priority: int = 0
    tenant: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


def arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals at `rate` requests/s (exponential gaps); rate <= 0 or inf: all at t = 0."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(rng.getrandbits(64)).integers(100, vocab, n).tolist()


def synthetic(n: int, profile: str | LengthProfile = "sharegpt", rate: float = float("inf"),
              seed: int = 0, vocab: int = 32000, max_context: int = 4096,
              system_prompt_len: int = 0, num_tenants: int = 1) -> list[SimRequest]:
    """`n` requests with random token ids; with `system_prompt_len`, each belongs to one of
    `num_tenants` tenants whose requests all start with that tenant's system prompt."""
    p = PROFILES[profile] if isinstance(profile, str) else profile
    rng = random.Random(seed)
    systems = [_tokens(rng, system_prompt_len, vocab) for _ in range(num_tenants)] if system_prompt_len else []
    out = []
    for i, t in enumerate(arrivals(n, rate, rng)):
        user = _lognormal(rng, p.prompt_mean, p.prompt_sigma, 4, max_context // 2)
        prompt = (systems[i % num_tenants] if systems else []) + _tokens(rng, user, vocab)
        max_tokens = max(1, min(p.max_tokens, max_context - len(prompt)))
        out_len = _lognormal(rng, p.output_mean, p.output_sigma, 1, max_tokens)
        out.append(SimRequest(f"sim-{i}", t, prompt, _tokens(rng, out_len, vocab), max_tokens))
    return out


# -- chat requests for real engines -------------------------------------------------------------
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


FOLLOW_UPS = ["Thanks. Can you say more about that?", "Now sum that up in two sentences.",
              "Give one concrete example of what you just said.", "What is the most surprising part of it?"]


def with_history(engine, requests: list[BenchRequest], turns: int, reply_tokens: int) -> list[list[dict]]:
    """Each request's conversation grown by `turns` earlier exchanges, the replies generated by
    `engine` itself (greedy, at most `reply_tokens` each, all requests batched): the shape of real
    chat traffic, where a request carries its history, so prompts are long and answers short."""
    from ..core.sampling_params import SamplingParams

    conversations = [list(r.messages) for r in requests]
    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0)
    for turn in range(turns):
        replies = engine.chat(conversations, params)
        for i, (conv, reply) in enumerate(zip(conversations, replies)):
            conv.append({"role": "assistant", "content": reply.text.strip()})
            conv.append({"role": "user", "content": FOLLOW_UPS[(i + turn) % len(FOLLOW_UPS)]})
    return conversations


# -- seeded workload shapes for `bench throughput --shapes` -------------------------------------
# Why: one prompt set can flatter an engine (the issue behind #37 saw 1.75x vLLM on the default set
# and 1.47x on another of the same kind), so throughput is judged on the minimum over shapes that
# vary what a scheduler and a model runner feel: output length, prefix sharing, batch size.
OUTPUT_RANGES = {"short": (8, 32), "long": (128, 256)}
CORNERS = tuple((o, p) for o in OUTPUT_RANGES for p in ("shared", "distinct"))
REQUEST_COUNTS = (8, 16, 32, 64)
TOPICS = SUBJECTS + ["tide pools", "paper kites", "glaciers", "bicycle gears", "city parks", "radio waves",
                     "bread ovens", "desert plants", "harbour cranes", "wool dyeing", "street markets", "comets"]
ROLES = ["a museum guide", "a science teacher", "a travel writer", "a librarian", "a park ranger", "an engineer"]
STYLES = ["Answer plainly and avoid jargon.", "Prefer concrete numbers to adjectives.",
          "Use short sentences.", "Mention one common misconception when it helps.",
          "Say when something is uncertain.", "Give an everyday comparison where you can.",
          "Keep lists to at most five items.", "End with one question the reader might ask next."]


@dataclass(frozen=True)
class WorkloadShape:
    """One seeded workload: `requests` chat requests whose system prompts are one shared text
    (prefix "shared": the prefix cache can hit) or one text each (prefix "distinct"), asking for
    outputs in OUTPUT_RANGES[outputs]; `seed` sets every text and length in it."""

    name: str
    seed: int
    requests: int
    outputs: str
    prefix: str

    @property
    def token_range(self) -> tuple[int, int]:
        return OUTPUT_RANGES[self.outputs]


def draw_shapes(n: int, seed: int = 0) -> list[WorkloadShape]:
    """`n` shapes, the same for the same (n, seed): the four corners (short/long outputs x
    shared/distinct prefixes) in turn, each run of four given the request counts 8, 16, 32 and 64
    in a seeded order, so any four consecutive shapes cover every corner and both extremes."""
    if n <= 0:
        raise ValueError(f"--shapes needs a positive number of shapes, got {n}")
    rng = random.Random(f"shapes-{seed}")
    out = []
    for start in range(0, n, len(CORNERS)):
        counts = rng.sample(REQUEST_COUNTS, len(REQUEST_COUNTS))
        for j, (outputs, prefix) in enumerate(CORNERS[:n - start]):
            i = start + j
            out.append(WorkloadShape(f"{i}:{outputs}-{prefix}-{counts[j]}", seed * 1000 + i, counts[j],
                                     outputs, prefix))
    return out


def _system_text(rng: random.Random) -> str:
    """A system prompt of ~150-250 words: a role, a topic list and style rules, all seeded."""
    topics = rng.sample(TOPICS, 6)
    rules = rng.sample(STYLES, 5)
    lines = [f"You are {rng.choice(ROLES)} answering visitors' questions in a notebook.",
             f"Today's topics are {', '.join(topics[:-1])} and {topics[-1]}."]
    for k in range(rng.randint(4, 8)):
        t = topics[k % len(topics)]
        lines.append(f"Note {k + 1}: when asked about {t}, first say what {t} is, then how it is used, "
                     f"then one fact about {rng.choice(topics)} that connects to it. {rng.choice(rules)}")
    return " ".join(lines + rules)


def shape_requests(shape: WorkloadShape) -> list[BenchRequest]:
    """The shape's chat requests: messages (system + user) and seeded max_tokens in its range."""
    rng = random.Random(f"shape-{shape.seed}")
    lo, hi = shape.token_range
    shared = _system_text(rng) if shape.prefix == "shared" else None
    out = []
    for _ in range(shape.requests):
        system = shared if shared is not None else _system_text(rng)
        ask = rng.choice(ASKS).format(s=rng.choice(TOPICS))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
        out.append(BenchRequest(messages, rng.randint(lo, hi)))
    return out
