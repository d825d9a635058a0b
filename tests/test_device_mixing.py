"""Every tensor and generator the engine makes says where it lives.

A tensor factory without `device=` lands on the CPU; mixed with the model's CUDA tensors it
raises at run time, and only on a GPU, which this machine does not have (the sampler divided CUDA
logits by CPU tensors and drew with a CPU generator). So the rule is checked on the source: in
`worker/`, `decoding/`, `engine/` and `core/`, each call of a torch factory (`torch.tensor`,
`zeros`, `empty`, `arange`, `rand*`, `Generator`, `from_numpy` ...) must either name its device
(`device=`, or an `out=` tensor), be moved at once in the same expression (`.to(<device>)`,
`.pin_memory()`, `.cuda()`), or carry `# host: <why>` on one of its lines: a tensor meant to stay
on the host (built there, then copied). `*_like` and `x.new_*` inherit their device and are fine.
"""
from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCOPE = [ROOT / "jupyter_pagedkv" / area for area in ("worker", "decoding", "engine", "core")]

# torch.<name>(...) calls that make a tensor (or a generator) on the default device, the CPU.
FACTORIES = {
    "tensor", "as_tensor", "asarray", "scalar_tensor", "from_numpy", "frombuffer", "Generator",
    "zeros", "ones", "empty", "full", "empty_strided", "eye", "arange", "range", "linspace",
    "logspace", "rand", "randn", "randint", "randperm", "normal", "tril_indices", "triu_indices",
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
    "IntTensor", "ShortTensor", "ByteTensor", "CharTensor", "BoolTensor",
}
MOVES = {"to", "pin_memory", "cuda"}
DTYPES = {"float", "float32", "float64", "double", "float16", "half", "bfloat16", "int", "int8",
          "int16", "int32", "int64", "long", "short", "uint8", "bool", "complex64", "complex128"}
HOST_MARK = re.compile(r"#\s*host:\s*\S")
MARK = "# host: <why>"


FIX = ("pass device=<the tensors' device>, chain .to(<device>) / .pin_memory() in the same "
       f"expression, or end the line with '{MARK}' if it is meant to stay on the CPU")


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    call: str

    def __str__(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{where}:{self.line}: torch.{self.call}(...) names no device"


def _factory(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch" \
            and f.attr in FACTORIES:
        return f.attr
    return None


def _names_device(call: ast.Call, name: str) -> bool:
    if any(k.arg in ("device", "out") or k.arg is None for k in call.keywords):   # None: **kwargs
        return True
    return name == "Generator" and bool(call.args)       # torch.Generator(device) takes it first


def _to_names_device(to: ast.Call) -> bool:
    """`.to(x)` moves to a device unless x is only a dtype (`torch.float32`, `dtype`, `x.dtype`)."""
    if any(k.arg == "device" for k in to.keywords):
        return True
    if not to.args:
        return False
    first = to.args[0]
    if isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name) and first.value.id == "torch":
        return first.attr not in DTYPES
    label = first.id if isinstance(first, ast.Name) else first.attr if isinstance(first, ast.Attribute) else ""
    return "dtype" not in label


def _moved_at_once(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    """The factory's result goes straight (through method calls or indexing) into a move."""
    node: ast.AST = call
    while True:
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node:
            node = parent
            continue
        if not (isinstance(parent, ast.Attribute) and parent.value is node):
            return False
        method = parents.get(parent)
        if not (isinstance(method, ast.Call) and method.func is parent):
            return False
        if parent.attr in MOVES and (parent.attr != "to" or _to_names_device(method)):
            return True
        node = method


def _host_marked_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT and HOST_MARK.match(t.string)}


def violations(path: Path) -> list[Violation]:
    source = path.read_text()
    tree = ast.parse(source, str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    marked = _host_marked_lines(source)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (name := _factory(node)) is None:
            continue
        if _names_device(node, name) or _moved_at_once(node, parents):
            continue
        if any(line in marked for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
            continue
        found.append(Violation(path, node.lineno, name))
    return sorted(found, key=lambda v: v.line)


def scope_violations() -> list[Violation]:
    return [v for d in SCOPE for p in sorted(d.rglob("*.py")) for v in violations(p)]


def test_every_tensor_factory_in_the_engine_names_its_device():
    found = scope_violations()
    if found:
        pytest.fail(f"{len(found)} tensor factory call(s) would land on the CPU whatever the model's "
                    f"device: {FIX}.\n" + "\n".join(map(str, found)), pytrace=False)


def test_the_rule_tells_device_names_moves_and_host_marks_apart(tmp_path):
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "import torch\n"
        "a = torch.tensor([1.0])\n"                                   # 2: CPU by default
        "b = torch.tensor([1.0], device=d)\n"
        "c = torch.tensor([1.0]).to(d)\n"
        "e = torch.tensor([1.0]).unsqueeze(1).to(d, non_blocking=True)\n"
        "f = torch.zeros(3).pin_memory()\n"
        "g = torch.tensor([1.0]).to(torch.float64)\n"                 # 7: a dtype is no device
        "h = torch.ones(3).to(x.dtype)\n"                            # 8
        "i = torch.Generator()\n"                                     # 9
        "j = torch.Generator(device=d)\n"
        "k = torch.arange(4)  # host: a CPU-side index\n"
        "m = torch.empty(\n"
        "    4)  # host: built here, copied below\n"
        "n = torch.empty_like(x)\n"
        "s = '# host: not a comment'; o = torch.rand(2)\n"           # 15: marks live in comments only
        "p = torch.from_numpy(arr)[None].to(d)\n")
    assert [v.line for v in violations(snippet)] == [2, 7, 8, 9, 15]


if __name__ == "__main__":   # `python tests/test_device_mixing.py`: the list, one line each
    found = scope_violations()
    print("\n".join(map(str, found)) + f"\nFix each: {FIX}." if found else "no violations")
    sys.exit(1 if found else 0)
