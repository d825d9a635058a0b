"""Capacity planner: how much KV cache a model gets on a GPU, and how many requests fit.

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element; grouped-query
attention shrinks it by heads / kv_heads (Llama-3-70B in fp16: 320 KiB per token, not the
2.6 MB one gets by counting all 64 query heads).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

GiB = 1 << 30
# A quantized KV cache's bytes per element and per scale (the format of worker/kv_quant.py, which
# sim may not import; tests/sim checks the two agree).
QUANTIZED_KV = {"fp8_e4m3": 1, "int8": 1}
KV_SCALE_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """The config numbers that decide memory (from each model's config.json)."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    vocab_size: int = 32000
    tied_embeddings: bool = False

    @property
    def embedding_params(self) -> float:
        """Parameters that cost no FLOPs per token (the input embedding; the output projection
        runs only at sampled positions)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def kv_bytes_per_token(self, bytes_per_element: int = 2, kv_cache_dtype: str = "auto") -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes; a quantized cache ("fp8_e4m3",
        "int8") stores one byte per element plus a float16 scale per token and KV head."""
        if kv_cache_dtype != "auto":
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * QUANTIZED_KV[kv_cache_dtype] + KV_SCALE_BYTES)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_config(cls, config, name: str | None = None, num_params: float | None = None) -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(name or getattr(text, "_name_or_path", "model"), num_params or 0.0,
                   text.num_hidden_layers, text.hidden_size, heads,
                   getattr(text, "num_key_value_heads", None) or heads,
                   getattr(text, "head_dim", None) or text.hidden_size // heads,
                   getattr(text, "max_position_embeddings", 4096), text.vocab_size,
                   bool(getattr(text, "tie_word_embeddings", False)))


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth: float       # bytes/s of HBM
    flops: float           # dense bf16 FLOP/s
    host_bandwidth: float = 25e9   # bytes/s to host memory (PCIe), what swapping pays


MODELS = {m.name: m for m in [
    ModelShape("Llama-3-8B", 8.03e9, 32, 4096, 32, 8, 128, 8192, 128256),
    ModelShape("Llama-3-70B", 70.6e9, 80, 8192, 64, 8, 128, 8192, 128256),
    ModelShape("Qwen2.5-7B", 7.62e9, 28, 3584, 28, 4, 128, 32768, 152064),
    ModelShape("SmolLM2-135M", 134.5e6, 30, 576, 9, 3, 64, 8192, 49152, tied_embeddings=True),
]}

GPUS = {g.name: g for g in [
    GPU("A100-40GB", 40 * GiB, 1.555e12, 312e12, 25e9),     # PCIe 4.0 x16
    GPU("A100-80GB", 80 * GiB, 2.039e12, 312e12, 25e9),
    GPU("H100-80GB", 80 * GiB, 3.35e12, 989e12, 50e9),      # PCIe 5.0 x16
    GPU("H200", 141 * 10**9, 4.8e12, 989e12, 50e9),
]}


@dataclass
class Plan:
    model: ModelShape
    gpu: GPU
    num_gpus: int
    weight_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    block_size: int
    context_len: int
    kv_cache_dtype: str = "auto"

    @property
    def fits(self) -> bool:
        return self.kv_budget_bytes > 0

    @property
    def tokens(self) -> int:
        """KV tokens that fit in the budget, in whole blocks."""
        blocks = max(0, self.kv_budget_bytes) // (self.kv_bytes_per_token * self.block_size)
        return blocks * self.block_size

    @property
    def paged_concurrency(self) -> int:
        """Requests of `context_len` tokens held at once with paging (waste < 1 block each)."""
        per_request = math.ceil(self.context_len / self.block_size) * self.block_size
        return self.tokens // per_request

    @property
    def contiguous_concurrency(self) -> int:
        """Requests held at once when each reserves the model's whole context up front."""
        return self.tokens // self.model.max_context

    def summary(self) -> str:
        m, g = self.model, self.gpu
        head = f"{m.name} on {self.num_gpus} x {g.name}"
        if not self.fits:
            need = math.ceil(self.weight_bytes / (g.memory_bytes * 0.9))
            return (f"{head}: does not fit: weights take {self.weight_bytes / GiB:.1f} GiB of "
                    f"{self.num_gpus * g.memory_bytes * 0.9 / GiB:.1f} GiB usable; use >= {need} GPUs "
                    f"(tensor parallel) or smaller weights (--weight-bytes 1 for 8-bit)")
        return "\n".join([
            f"{head}: weights {self.weight_bytes / GiB:.1f} GiB, KV budget {self.kv_budget_bytes / GiB:.1f} GiB",
            (f"KV per token: 2 x {m.num_layers} layers x {m.num_kv_heads} kv heads x {m.head_dim} x "
             f"{self.kv_bytes_per_token // (2 * m.num_layers * m.num_kv_heads * m.head_dim)} bytes "
             if self.kv_cache_dtype == "auto" else
             f"KV per token ({self.kv_cache_dtype}): 2 x {m.num_layers} layers x {m.num_kv_heads} kv heads x "
             f"({m.head_dim} x 1 byte + a {KV_SCALE_BYTES}-byte scale) ")
            + f"= {self.kv_bytes_per_token:,} bytes ({self.kv_bytes_per_token / 1024:.0f} KiB)",
            f"tokens that fit: {self.tokens:,} ({self.tokens // self.block_size:,} blocks of {self.block_size})",
            f"concurrent requests at {self.context_len:,} tokens: paged {self.paged_concurrency:,}, "
            f"contiguous (reserving {m.max_context:,} each) {self.contiguous_concurrency:,}",
        ])


def plan(model: str | ModelShape, gpu: str | GPU = "H100-80GB", num_gpus: int = 1,
         context_len: int = 2048, block_size: int = 16, weight_bytes: float = 2, kv_bytes: int = 2,
         gpu_memory_utilization: float = 0.9, activation_reserve: float = 0.05, kv_cache_dtype: str = "auto") -> Plan:
    """Memory plan for `model` on `num_gpus` x `gpu` (weights and KV split evenly by tensor parallel);
    `kv_cache_dtype` as the engine's option ("auto": `kv_bytes` per element)."""
    if kv_cache_dtype not in ("auto", *QUANTIZED_KV):
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8_e4m3' or 'int8', got {kv_cache_dtype!r}")
    m = MODELS[model] if isinstance(model, str) else model
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"unknown GPU {gpu!r}: choose one of {', '.join(GPUS)}")
        gpu = GPUS[gpu]
    total = num_gpus * gpu.memory_bytes
    weights = int(m.num_params * weight_bytes)
    budget = int(total * (gpu_memory_utilization - activation_reserve)) - weights
    return Plan(m, gpu, num_gpus, weights, budget, m.kv_bytes_per_token(kv_bytes, kv_cache_dtype), block_size,
                context_len, kv_cache_dtype)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv plan", description=__doc__)
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--gpu", default="H100-80GB", choices=sorted(GPUS))
    ap.add_argument("--num-gpus", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--weight-bytes", type=float, default=2, help="bytes per weight (2 = bf16, 1 = 8-bit)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *QUANTIZED_KV),
                    help="KV storage: auto = 2 bytes per element; fp8_e4m3 / int8 = 1 byte + a float16 scale "
                         "per token and KV head")
    return ap


def from_argv(argv: list[str] | None) -> Plan:
    args = parser().parse_args(argv)
    if args.num_gpus < 1 or args.context < 1 or args.block_size < 1:
        parser().error("--num-gpus, --context and --block-size must be positive")
    return plan(args.model, args.gpu, args.num_gpus, args.context, args.block_size, args.weight_bytes,
                kv_cache_dtype=args.kv_cache_dtype)


def figure(p: Plan):
    """Concurrent requests that fit vs context length, paged vs contiguous (a matplotlib Figure)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(8, 3.4))
    ax = fig.subplots()
    lengths = [n for n in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
               if n <= p.model.max_context]
    bs = p.block_size
    paged = [p.tokens // (math.ceil(n / bs) * bs) for n in lengths]
    contiguous = [p.contiguous_concurrency] * len(lengths)
    ax.plot(lengths, paged, "o-", color="#2a7ab9", label="paged (blocks of %d)" % bs)
    ax.plot(lengths, contiguous, "s--", color="#d9552b",
            label=f"contiguous (reserves {p.model.max_context:,} each)")
    ax.set(xscale="log", yscale="log", xlabel="tokens per request (prompt + output)",
           ylabel="concurrent requests that fit",
           title=f"{p.model.name} on {p.num_gpus} x {p.gpu.name}: {p.tokens:,} KV tokens")
    # Label the swept lengths only (log axes' default minor labels collide: "3x10^2 4x10^2").
    ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths], minor=False)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    print(from_argv(argv).summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
