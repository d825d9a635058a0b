"""CostModel: how long one scheduler step takes, from what it computes — no model needed.

A step reads every weight once and the KV of every context it attends to (memory traffic), does
2 FLOPs per weight per computed token plus attention and the output projection at sampled rows
(compute), moves swapped blocks over the host link, and pays a fixed overhead (scheduling, kernel
launches, tensor-parallel all-reduces). The step time is their sum:

    t = overhead + bytes * s_per_byte + flops * s_per_flop + swap_bytes * s_per_swap_byte

A sum rather than a roofline max, because it is linear in its coefficients: the same form is
fitted by least squares to step times measured on a real run (`CostModel.fit`), and set from a
GPU's datasheet numbers times an efficiency (`CostModel.for_gpu`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .plan import GPU, GPUS, MODELS, ModelShape


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step does, in the units the cost model prices."""

    bytes: float
    flops: float
    swap_bytes: float


@dataclass(frozen=True)
class ModelCost:
    """The per-token numbers of one model at one precision."""

    shape: ModelShape
    weight_bytes: float
    kv_bytes_per_token: int

    @classmethod
    def of(cls, model: str | ModelShape, bytes_per_weight: float = 2, kv_bytes: int = 2,
           kv_cache_dtype: str = "auto") -> ModelCost:
        """`kv_cache_dtype` as the engine's option: a quantized cache reads and swaps ~half the bytes."""
        shape = MODELS[model] if isinstance(model, str) else model
        return cls(shape, shape.num_params * bytes_per_weight, shape.kv_bytes_per_token(kv_bytes, kv_cache_dtype))

    def work(self, chunks: Iterable[tuple[int, int, bool]], num_swapped_blocks: int = 0,
             block_size: int = 16) -> StepWork:
        """`chunks`: (start, num_tokens, samples) of each scheduled sequence."""
        m = self.shape
        tokens = sampled = 0
        kv_read = attn = 0.0
        for start, n, samples in chunks:
            tokens += n
            sampled += samples
            kv_read += start + n
            attn += n * (start + (n + 1) / 2)   # causal: query i sees start + i + 1 keys
        dense = m.num_params - m.embedding_params
        flops = (2 * dense * tokens + 2 * m.vocab_size * m.hidden_size * sampled
                 + 4 * m.num_layers * m.num_heads * m.head_dim * attn)
        traffic = self.weight_bytes + (kv_read + tokens) * self.kv_bytes_per_token
        swap = num_swapped_blocks * block_size * self.kv_bytes_per_token
        return StepWork(traffic, flops, swap)


@dataclass(frozen=True)
class CostModel:
    overhead_s: float
    s_per_byte: float
    s_per_flop: float
    s_per_swap_byte: float

    def step_time(self, work: StepWork) -> float:
        return (self.overhead_s + work.bytes * self.s_per_byte + work.flops * self.s_per_flop
                + work.swap_bytes * self.s_per_swap_byte)

    @classmethod
    def for_gpu(cls, gpu: str | GPU, num_gpus: int = 1, bandwidth_efficiency: float = 0.8,
                flops_efficiency: float = 0.5, overhead_s: float = 0.003,
                allreduce_s: float = 15e-6, num_layers: int = 80) -> CostModel:
        """Datasheet bandwidth and FLOP/s times typical efficiencies; tensor parallelism splits
        bytes and FLOPs over `num_gpus` and adds two all-reduces per layer per step."""
        g = GPUS[gpu] if isinstance(gpu, str) else gpu
        overhead = overhead_s + (2 * num_layers * allreduce_s if num_gpus > 1 else 0.0)
        return cls(overhead, 1 / (num_gpus * g.bandwidth * bandwidth_efficiency),
                   1 / (num_gpus * g.flops * flops_efficiency), 1 / (num_gpus * g.host_bandwidth))

    @classmethod
    def fit(cls, works: Sequence[StepWork], durations: Sequence[float],
            s_per_swap_byte: float = 1 / 5e9) -> CostModel:
        """Least squares of measured step times on (1, bytes, flops), no coefficient negative
        (a negative one is dropped and the rest refitted: with weights read every step, bytes are
        nearly constant and can fold into the overhead)."""
        if len(works) < 3:
            raise ValueError("calibration needs at least 3 measured steps")
        x = np.array([[1.0, w.bytes, w.flops] for w in works])
        y = np.asarray(durations, dtype=float)
        scale = x.max(axis=0)
        xs = x / scale
        keep = [0, 1, 2]
        while True:
            coef, *_ = np.linalg.lstsq(xs[:, keep], y, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = np.zeros(3)
        full[keep] = np.maximum(coef, 0)
        full /= scale
        return cls(float(full[0]), float(full[1]), float(full[2]), s_per_swap_byte)

    def describe(self) -> str:
        return (f"overhead {self.overhead_s * 1e3:.2f} ms, {1 / self.s_per_byte / 1e9 if self.s_per_byte else float('inf'):.1f} GB/s, "
                f"{1 / self.s_per_flop / 1e12 if self.s_per_flop else float('inf'):.3f} TFLOP/s")
