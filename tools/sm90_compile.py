"""Compile every Triton kernel of the decode step for an H100/H200 (sm_90) without a GPU.

Run as a script in a process of its own (the kernels must not be interpreted): each launch of the op's kernels
(:data:`triton_sparse_decode.LAUNCHES`) and of the cache write is intercepted and, instead of running, compiled
through Triton's whole pipeline (front end, MLIR, LLVM, ``ptxas``) for ``GPUTarget("cuda", 90, 32)``, with the
argument types of the real call on CPU tensors, specialised as Triton's JIT specialises a launch (integers equal
to 1 become constants; pointers and integers divisible by 16 say so) where this Triton's JIT exposes that.
Prints one line per compiled specialisation, with its registers, stack (spills) and shared memory as ``ptxas``
allotted them, and exits non-zero on the first failure; exits 3 when Triton's NVIDIA backend or its ``ptxas`` is
not installed.

Modes: ``--quick`` (bf16 only, no mask and an additive per-head mask); ``--occupancy``: the op's launches at
the GPU check's shapes (Hq=32, Hkv=8, D=128, bf16; the defaults and the paper rule at 32K and 128K, batch 8)
with the plan an H200 (132 SMs) gets, checking the occupancy that plan assumes from the registers and shared
memory of the compiled kernels: each launch's programs fit on the SMs in one wave (launch 1's at
``_LAUNCH1_WARPS_PER_SM`` warps an SM); exits 1 when one does not.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

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
compiled = {}  #: (kernel name, source hash, options) -> resources of the compiled specialisation


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


def _generic_source(fn, args, kwargs):
    """``(source, options)`` of a launch from its argument types alone (no specialisation)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = inspect.signature(fn.fn).bind(*args, **kwargs).arguments
    const = {p.name for p in fn.params if p.is_constexpr}
    signature = {name: "constexpr" if name in const else _type(v) for name, v in bound.items()}
    constexprs = {name: v for name, v in bound.items() if name in const}
    return ASTSource(fn, signature, constexprs), options


def _jit_source(fn, args, kwargs):
    """``(source, options)`` of a launch as this Triton's JIT would compile it (its own binder and
    specialisation), or None where the JIT does not expose them (they are Triton internals)."""
    try:
        from triton import knobs
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(TARGET)
        kw = dict(kwargs)
        kw.setdefault("debug", False)
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kw[name] = getattr(knobs.compilation, name)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kw)
        options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
    except Exception:  # pragma: no cover - depends on the Triton version
        return None
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


def _resources(out) -> dict:
    """Registers a thread, stack bytes (spills) and shared memory bytes of a compiled kernel (``cuobjdump``
    on its cubin; ``regs`` None where the tool is missing)."""
    res = {"regs": None, "stack": None, "shared": int(out.metadata.shared)}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(tool) and "cubin" in out.asm:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(out.asm["cubin"])
            text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", text)
        if m:
            res["regs"], res["stack"] = int(m.group(1)), int(m.group(2))
    return res


class _CompileOnly:
    """Stands in for ``kernel[grid](...)``: compiles the specialisation for sm_90 instead of launching it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.last = None  #: (resources, warps, grid) of the latest launch

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            fn = self.kernel
            src, options = _jit_source(fn, args, dict(kwargs)) or _generic_source(fn, args, dict(kwargs))
            key = (fn.__name__, src.hash(), tuple(sorted((k, str(v)) for k, v in options.items())))
            warps = options.get("num_warps", 4)
            if key not in compiled:
                out = triton.compile(src, target=TARGET, options=options)
                res = compiled[key] = _resources(out)
                print(f"compiled {fn.__name__} for sm_90 (num_warps {warps}): {len(out.asm.get('ptx', ''))} chars of "
                      f"PTX, {res['regs']} registers, {res['stack']} bytes of stack, {res['shared']} bytes of "
                      f"shared memory", flush=True)
            self.last = (compiled[key], warps, tuple(grid))
        return launch


#: an H200's SMs, and what one SM holds (sm_90): 64K 32-bit registers, 228 KB of shared memory (1 KB of it
#: reserved per resident block)
H200_SMS, SM_REGISTERS, SM_SHARED, BLOCK_RESERVED_SHARED = 132, 65536, 233472, 1024


def _blocks_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident blocks an SM holds for a kernel of ``regs`` registers a thread (allocated per warp in units of
    256) and ``shared`` bytes of shared memory a block, at most 64 warps an SM."""
    regs_warp = -(-regs * 32 // 256) * 256
    by_regs = SM_REGISTERS // (regs_warp * warps)
    by_shared = SM_SHARED // (shared + BLOCK_RESERVED_SHARED)
    return min(by_regs, by_shared, 64 // warps)


def occupancy() -> int:
    """The op's launches at the GPU check's shapes with an H200's plan: each launch's compiled kernel allows the
    programs an SM its grid assumes (launch 1: ``_LAUNCH1_WARPS_PER_SM`` warps; launches 2 and 3:
    ``_PROGRAMS_PER_SM``) and its grid fits in one wave. Prints a line per launch and shape; 1 when one does
    not fit."""
    from tinyserve_compile.kernels import triton_sparse_decode as tsd
    from tinyserve_compile.kernels.spec import SelectionSpec

    stubs = {name: _CompileOnly(getattr(tsd, name)) for name in tsd.LAUNCHES}
    for name, stub in stubs.items():
        setattr(tsd, name, stub)

    class _H200:
        multi_processor_count = H200_SMS

    torch.cuda.get_device_properties = lambda device=None: _H200()
    plan_of = tsd._plan
    Hkv, G, D = 8, 4, 128
    bad = 0
    for name, spec in (("defaults", SelectionSpec.default()),
                       ("paper", SelectionSpec(16, 2048, 0, 1, 0, False, torch.float32))):
        for B, L in ((8, 32768), (8, 131072)):
            P = -(-L // spec.page_size)
            plan = tsd._Plan(B, Hkv, G, L, D, P, spec, torch.device("cuda"), None)
            q = torch.zeros(B, Hkv * G, 1, D, dtype=torch.bfloat16)
            k = torch.empty(B, Hkv, L, D, dtype=q.dtype)  # never written or read: only pointers and strides
            kmax = torch.zeros(B, Hkv, P, D, dtype=spec.bounds_dtype)
            for stub in stubs.values():
                stub.last = None
            tsd._plan = lambda *args: plan  # the H200's plan for these CPU tensors
            try:
                tsd.sparse_decode_triton(q, k, torch.empty_like(k), kmax, kmax.clone(), torch.zeros(B, Hkv, P),
                                         torch.full((B,), L), None, D ** -0.5, spec,
                                         ctrl=torch.zeros(2, dtype=torch.int32))
            finally:
                tsd._plan = plan_of
            for launch, stub in stubs.items():
                if stub.last is None:
                    continue  # launch 2 of a one-stage rule
                res, warps, grid = stub.last
                if res["regs"] is None:
                    print("cuobjdump is missing: registers unknown")
                    return 3
                per_sm = _blocks_per_sm(res["regs"], res["shared"], warps)
                assumed = (max(1, tsd._LAUNCH1_WARPS_PER_SM // warps) if launch == tsd.LAUNCHES[0]
                           else tsd._PROGRAMS_PER_SM)
                waves = grid[0] * grid[1] / (H200_SMS * per_sm)
                ok = per_sm >= assumed and waves <= 1.0
                bad += not ok
                extra = f", BLOCK_P {plan.block_p}" if launch == tsd.LAUNCHES[0] else ""
                extra += f", {warps} warps ({assumed} programs an SM assumed)"
                print(f"{name} B{B} L{L} {launch}: grid {grid[0]}x{grid[1]}{extra}, {res['regs']} registers, "
                      f"{res['stack']} bytes of stack, {res['shared']} bytes of shared memory: {per_sm} programs an "
                      f"SM, {waves:.2f} waves: {'ok' if ok else 'MISSED'}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from triton.backends.nvidia import compiler as nv  # noqa: F401  (the NVIDIA backend, with its ptxas)

    if "--occupancy" in argv:
        return occupancy()
    quick = "--quick" in argv  # bf16, no mask and an additive per-head mask

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
        ctrl = torch.tensor([0, 0, -1, 0], dtype=torch.int32)  # the runtime's ctrl (bounds.CTRL_SIZE words)
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
