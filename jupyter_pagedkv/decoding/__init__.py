"""Decoding strategies beyond one token per step: speculative decoding and beam search.

Above `worker` (a draft model needs its own runner, verification the sampler's probabilities)."""
