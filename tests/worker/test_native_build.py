"""Builds that stay built: torch's extension cache keeps one build per name and rebuilds it when
the command changes, so every variant (other flags, other sources, another venv's torch) must
get a name of its own, or `make test` would leave the user's next load a minute-long rebuild."""
from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_pagedkv.worker import native_decode, prefill_attention
from jupyter_pagedkv.worker.native_build import LazyModule, NativeBuildError, variant_name


def test_the_same_sources_and_flags_give_the_same_name_and_any_change_a_new_one(tmp_path, monkeypatch):
    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 1; }\n")
    base = variant_name("mod", src, ["-O3"], [])
    assert base == variant_name("mod", src, ["-O3"], []) and base.startswith("mod_")
    assert variant_name("mod", src, ["-O0"], []) != base                        # other flags
    assert variant_name("mod", src, ["-O3"], ["-fopenmp"]) != base              # other link flags
    (tmp_path / "k.h").write_text("#pragma once\n")
    with_header = variant_name("mod", src, ["-O3"], [])
    assert with_header != base                                                  # a header beside it
    src.write_text("int f() { return 2; }\n")
    changed = variant_name("mod", src, ["-O3"], [])
    assert changed != with_header                                               # other source text
    import torch
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/torch/__init__.py")
    assert variant_name("mod", src, ["-O3"], []) != changed                     # another venv's torch


def test_a_broken_variant_under_the_real_name_leaves_the_real_build_alone(tmp_path, monkeypatch):
    """The suite's broken-source test, as it would hit the real module's name: the build torch
    keeps for the user's module (a stand-in here, so nothing real is compiled) is not touched."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    from torch.utils.cpp_extension import _get_build_directory
    real = native_decode._EXTENSION
    real_dir = Path(_get_build_directory(real.build_name, verbose=False))
    (real_dir / "build.ninja").write_text("the user's build\n")
    (real_dir / f"{real.build_name}.so").write_bytes(b"built")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in real_dir.iterdir()}

    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    variant = LazyModule(real.name, bad, "a broken variant", "nothing", ["-O0"])
    assert variant.build_name != real.build_name and variant.build_name.startswith(real.name + "_")
    with pytest.raises(NativeBuildError):
        variant.load()
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in real_dir.iterdir()} == before
    assert Path(_get_build_directory(variant.build_name, verbose=False)).is_dir()


def test_the_shipped_modules_are_built_under_hashed_names():
    for module, base in ((native_decode._EXTENSION, "jupyter_pagedkv_native_decode"),
                         (prefill_attention._KERNEL, "jupyter_pagedkv_prefill_attention")):
        assert module.name == base and module.build_name.startswith(base + "_") and len(module.build_name) == len(base) + 11


def test_a_load_does_not_change_the_name_it_was_built_under(tmp_path, monkeypatch):
    """torch's loader appends its link flags to the lists it is given: the variant's own flags
    (and so its name) must not change with them, or the next load would look for another build."""
    import torch.utils.cpp_extension as cpp

    seen = []

    def fake_load(name, sources, extra_include_paths, extra_cflags, extra_ldflags, verbose):
        extra_ldflags += ["-ltorch", "-ltorch_python"]       # as torch does
        seen.append(name)
        return object()
    monkeypatch.setattr(cpp, "load", fake_load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))   # not the user's cache
    src = tmp_path / "k.cpp"
    src.write_text("int f();\n")
    module = LazyModule("mod", src, "a module", "nothing", ["-O3"], ["-fopenmp"])
    before = module.build_name
    module.load()
    assert seen == [before] and module.build_name == before and module.ldflags == ("-fopenmp",)
