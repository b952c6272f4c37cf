"""The build rules this project lives by (ARCHITECTURE.md), checked on every run."""

import pathlib
import re
import subprocess
import sys

import samcache

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_data_structures_have_no_torch_headers():
    """Fast rebuilds: the data-structure sources must not include torch, ATen or c10."""
    pattern = re.compile(r'#include\s*[<"](torch|ATen|c10)/')
    offenders = [
        str(p.relative_to(ROOT))
        for d in ("cpp/include", "cpp/src", "cpp/bindings/module.cpp")
        for p in ([ROOT / d] if d.endswith(".cpp") else (ROOT / d).rglob("*"))
        if p.is_file() and pattern.search(p.read_text())
    ]
    assert not offenders, f"torch headers in data-structure sources: {offenders}"


def test_cuda_sources_need_no_torch():
    """Every cuda/*.cu compiles alone with nvcc: raw pointers, no torch headers."""
    for p in (ROOT / "cuda").glob("*.cu*"):
        assert not re.search(r'#include\s*[<"](torch|ATen|c10)/', p.read_text()), p


def test_import_loads_torch_first_and_registers_ops():
    code = "import samcache, sys, torch; assert 'torch' in sys.modules; print(torch.ops.samcache.copy_blocks)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "copy_blocks" in out.stdout


def test_cpu_torch_gives_a_cpu_build():
    import torch

    if torch.version.cuda is None:
        assert samcache._C.with_cuda is False
