"""Dispatch `python -m jupyter_pagedkv.bench NAME [options]` to one benchmark."""
from __future__ import annotations

import sys

USAGE = "usage: python -m jupyter_pagedkv.bench {throughput,single,gemm,chat,sharing,speculative,tail,tenants,memory,monitor,structured,kernels,compile,gpu,soak,architectures,dtypes,kvquant,host} [options]  (add --help after NAME)"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "throughput" and any(a == "--shapes" or a.startswith("--shapes=") for a in rest):
        from .throughput_shapes import main as run
    elif name == "throughput":
        from .throughput import main as run
    elif name == "single":
        from .single import main as run
    elif name == "gemm":
        from .gemm import main as run
    elif name == "chat":
        from .chat import main as run
    elif name == "sharing":
        from .sharing import main as run
    elif name == "speculative":
        from .speculative import main as run
    elif name == "tail":
        from .tail import main as run
    elif name == "tenants":
        from .tenants import main as run
    elif name == "memory":
        from .memory import main as run
    elif name == "monitor":
        from .monitor import main as run
    elif name == "structured":
        from .structured import main as run
    elif name == "soak":
        from ..testing.soak import main as run
    elif name == "architectures":
        from ..gpucheck.architectures import main as run
    elif name == "dtypes":
        from .dtypes import main as run
    elif name == "kvquant":
        from .kvquant import main as run
    elif name == "host":
        from .host import main as run
    elif name == "gpu":
        from ..gpucheck.driver import main as run
    elif name == "compile":
        from jupyter_pagedkv.worker.kernels_bridge import kernel_module
        run = kernel_module("compile_check").main
    elif name == "kernels":
        from jupyter_pagedkv.worker.kernels_bridge import kernel_module
        run = kernel_module("bench").main
    else:
        print(f"unknown benchmark {name!r}. {USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
