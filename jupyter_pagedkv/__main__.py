"""`python -m jupyter_pagedkv COMMAND ...`: the package's command-line entry points.

    demo    8 chat prompts at once on the embedded model, then the block pool (`make demo`)
    plan    KV capacity of a model on a GPU: paged vs contiguous
    bench   benchmarks against peers (`bench --help`)
    sim     the simulator at production scale
    serve   a local vLLM server for the remote client (needs `make bench-peers`)
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {"demo": "notebook.demo", "plan": "sim.plan", "bench": "bench.__main__",
            "sim": "sim.__main__", "serve": "remote.peer_server"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv else sys.stdout)
        return 2 if argv else 0
    module = importlib.import_module(f"jupyter_pagedkv.{COMMANDS[argv[0]]}")
    sys.argv = [f"python -m jupyter_pagedkv {argv[0]}", *argv[1:]]
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
