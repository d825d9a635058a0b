"""One kernel launch as data: the kernel, its grid and exactly the arguments the launcher passes.

The launchers (`paged_attention`, `write_kv`, `copy_blocks`) build these and run them; the compile
check (`compile_check.py`) builds the same objects on meta tensors and hands their arguments to
Triton's own binder, so what it compiles is what the engine would launch, never a re-typed copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    """`kernel[grid](*args, **constexprs, **options)`."""
    kernel: Any                         # a triton JITFunction (or the interpreter's wrapper)
    grid: tuple[int, ...]
    args: tuple                         # runtime arguments, in the kernel's order
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)   # num_warps, num_stages

    @property
    def name(self) -> str:
        fn = getattr(self.kernel, "fn", self.kernel)
        return getattr(fn, "__name__", repr(fn))

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)
