"""Compile every Triton kernel of the decode step for an H100/H200 (sm_90) without a GPU.

Run as a script in a process of its own (``--quick``: bf16 only, no mask and an additive per-head mask) (the kernels must not be interpreted): each launch of the op's kernels
(:data:`triton_sparse_decode.LAUNCHES`) and of the cache write is intercepted and, instead of running, compiled
through Triton's whole pipeline (front end, MLIR, LLVM, ``ptxas``) for ``GPUTarget("cuda", 90, 32)``, with the
argument types of the real call on CPU tensors. Prints one line per compiled specialisation and exits non-zero
on the first failure; exits 3 when Triton's NVIDIA backend or its ``ptxas`` is not installed.
"""
from __future__ import annotations

import inspect
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

try:
    import triton  # noqa: E402
    from triton.backends.compiler import GPUTarget  # noqa: E402
    from triton.compiler import ASTSource  # noqa: E402
except Exception as e:  # pragma: no cover - depends on the environment
    print(f"triton unavailable: {e}")
    sys.exit(3)

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
        torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8", torch.int16: "*i16"}
TARGET = GPUTarget("cuda", 90, 32)
compiled = []


def _type(v):
    if isinstance(v, torch.Tensor):
        return _PTR[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"argument of type {type(v).__name__}")


class _CompileOnly:
    """Stands in for ``kernel[grid](...)``: compiles the specialisation for sm_90 instead of launching it."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            fn = self.kernel
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            bound = inspect.signature(fn.fn).bind(*args, **kwargs).arguments
            const = {p.name for p in fn.params if p.is_constexpr}
            signature = {name: "constexpr" if name in const else _type(v) for name, v in bound.items()}
            constexprs = {name: v for name, v in bound.items() if name in const}
            key = (fn.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())),
                   tuple(sorted(options.items())))
            if key not in {c[0] for c in compiled}:
                out = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=options)
                regs = getattr(out, "n_regs", None)
                spills = getattr(out, "n_spills", None)
                compiled.append((key, regs, spills))
                print(f"compiled {fn.__name__} for sm_90 {options or ''}: {len(out.asm.get('ptx', ''))} chars of PTX"
                      + (f", {regs} registers, {spills} spills" if regs is not None else ""), flush=True)
        return launch


def main(argv=None) -> int:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)  # bf16, no mask and an additive per-head mask
    from triton.backends.nvidia import compiler as nv  # noqa: F401  (the NVIDIA backend, with its ptxas)

    from tinyserve_compile.kernels import triton_bounds as tb
    from tinyserve_compile.kernels import triton_sparse_decode as tsd
    from tinyserve_compile.kernels import reference as ref
    from tinyserve_compile.kernels.spec import SelectionSpec

    for name in tsd.LAUNCHES:
        setattr(tsd, name, _CompileOnly(getattr(tsd, name)))
    for name in [n for n in dir(tb) if n.endswith("_kernel")]:
        setattr(tb, name, _CompileOnly(getattr(tb, name)))

    B, Hkv, G, L, D = 2, 8, 4, 4096, 128
    specs = [SelectionSpec.default(),  # the shipped defaults: pages of 8, two stages keeping tokens, int8 bounds
             SelectionSpec(16, 2048, 0, 1, 0, False, torch.float32),  # the paper's rule
             SelectionSpec(8, 512, 1, 2, 0, False, torch.bfloat16),  # two stages keeping pages
             SelectionSpec(8, 8192, 0, 1, 0, False, torch.float32)]  # a cache dense by shape
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32):
        q = torch.randn(B, Hkv * G, 1, D, dtype=dtype)
        k = torch.randn(B, Hkv, L, D, dtype=dtype)
        v = torch.randn_like(k)
        vl = torch.tensor([L, L - 100])
        ctrl = torch.zeros(2, dtype=torch.int32)
        for spec in specs:
            bounds = ref.page_bounds(k[:, :, :64], spec.page_size, dtype=spec.bounds_dtype)
            P = -(-L // spec.page_size)
            bounds = ref.PageBounds(*(t.new_zeros((B, Hkv, P) + tuple(t.shape[3:])) for t in bounds))
            masks = [None, torch.ones(B, 1, 1, L, dtype=torch.bool), torch.zeros(B, Hkv * G, 1, L, dtype=dtype)]
            for mask in masks[::2] if quick else masks:
                tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, D ** -0.5, spec, ctrl=ctrl)
            pos = torch.tensor([L - 1])
            tb.cache_write_triton(k, *bounds, ctrl, pos, k[:, :, :1].clone(), spec.page_size)
    print(f"sm_90: {len(compiled)} specialisations compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
