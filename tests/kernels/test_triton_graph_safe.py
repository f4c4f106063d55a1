"""The Triton decode op is safe to capture in a CUDA graph: CPU-side checks under the Triton interpreter.

A captured step replays the same launches with the same arguments whatever the data says, so the op must
decide everything on the device. Checked here without a GPU:

* at most three Triton launches per call (``LAUNCHES``), for the defaults and the paper rule alike;
* no host read and no ATen selection op while it runs (``ForbidHostSync``: ``item``, ``_local_scalar_dense``,
  ``nonzero``, ``topk``, ``sort``, ``argsort``, ``unique``, ``masked_select`` ...), and every tensor a launch
  takes on the device of ``q``;
* the same launches (kernels, grids, scalar arguments, tensors) for different valid lengths, mask values and
  ``ctrl`` flags of one shape;
* a stand-in for a graph replay: the launches of one call, recorded, then re-issued after the inputs changed in
  place (query, valid lengths, ``ctrl`` flags, keys and their bounds), give the answer of the PyTorch path on the
  new inputs.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.triton_interp import _import_interpreted  # noqa: E402

tsd = _import_interpreted("tinyserve_compile.kernels.triton_sparse_decode")

from tests.support.kernel_checks import TOL, assert_close_report, make_gen, randn  # noqa: E402
from tests.support.no_host_sync import VIEWS_AND_ALLOCATIONS, ForbidHostSync  # noqa: E402
from tinyserve_compile.kernels import reference as ref  # noqa: E402
from tinyserve_compile.kernels.sparse_decode import run_kernel  # noqa: E402
from tinyserve_compile.kernels.spec import SelectionSpec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning",
                                        "ignore:invalid value encountered in subtract:RuntimeWarning")

B, HKV, G, L, D, S = 2, 2, 2, 120, 16, 4

#: selection settings of one shape, and the launches each makes: the defaults' shape of rule (two stages keeping
#: tokens, int8 bounds, a sink page), two stages keeping pages, the paper's one stage, and a cache dense by shape
SETTINGS = {
    "tokens": (SelectionSpec(S, 16, 1, 1, 8, True, torch.int8), 3),
    "pages": (SelectionSpec(S, 16, 1, 2, 0, False, torch.bfloat16), 3),
    "paper": (SelectionSpec(S, 16, 0, 1, 0, False, torch.float32), 2),
    "dense": (SelectionSpec(S, 128, 0, 1, 0, False, torch.float32), 1),
}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class _Recorder:
    """Wrap the module's kernels so that every launch is recorded as ``(name, grid, args, kwargs)``."""

    def __init__(self, monkeypatch):
        self.log = []
        self.kernels = {name: getattr(tsd, name) for name in tsd.LAUNCHES}
        self.mode = None  # a ForbidHostSync paused during each launch (the interpreter stands in for the device)
        for name in tsd.LAUNCHES:
            monkeypatch.setattr(tsd, name, self._wrap(name, getattr(tsd, name)))

    def _wrap(self, name, kernel):
        rec = self

        class _Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    rec.log.append((name, tuple(grid), args, kwargs))
                    if rec.mode is None:
                        return kernel[grid](*args, **kwargs)
                    with rec.mode.paused():
                        return kernel[grid](*args, **kwargs)

                return launch

        return _Launcher()

    def signature(self):
        """What a graph would freeze: kernel, grid, scalar arguments, and each tensor's identity and shape."""
        def arg(a):
            if isinstance(a, torch.Tensor):
                return ("tensor", a.data_ptr(), tuple(a.shape), a.dtype, a.device)
            return a
        return [(n, g, tuple(arg(a) for a in args), tuple(sorted((k, arg(v)) for k, v in kw.items())))
                for n, g, args, kw in self.log]

    def replay(self):
        """Re-issue the recorded launches, as a graph replay does (the original kernels, nothing recorded)."""
        for name, grid, args, kwargs in list(self.log):
            self.kernels[name][grid](*args, **kwargs)


def _inputs(spec: SelectionSpec, seed: int, dtype=torch.float32, mask: bool = True):
    gen = make_gen(seed)
    q = randn((B, HKV * G, 1, D), gen, dtype)
    k = randn((B, HKV, L, D), gen, dtype)
    v = randn((B, HKV, L, D), gen, dtype)
    hot = torch.randint(0, L, (6,), generator=gen)
    k[:, :, hot] = (k[:, :, hot].float() + 2.0 * q.float().reshape(B, HKV, G, D)[:, :, :1]).to(dtype)
    bounds = ref.page_bounds(k, S, dtype=spec.bounds_dtype)
    m = (torch.rand(B, 1, 1, L, generator=gen) < 0.8) if mask else None
    return q, k, v, bounds, m


def _call(q, k, v, bounds, vl, mask, spec, ctrl=None):
    return tsd.sparse_decode_triton(q, k, v, *bounds, vl, mask, D ** -0.5, spec, ctrl=ctrl)


def _want(q, k, v, bounds, vl, mask, spec, ctrl=None):
    return run_kernel("torch", q, k, v, *bounds, vl, mask, D ** -0.5, spec, ctrl=ctrl)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_at_most_three_launches(setting, monkeypatch):
    spec, launches = SETTINGS[setting]
    q, k, v, bounds, mask = _inputs(spec, 1)
    rec = _Recorder(monkeypatch)
    _call(q, k, v, bounds, torch.tensor([L, L - 9]), mask, spec, torch.zeros(2, dtype=torch.int32))
    names = [n for n, *_ in rec.log]
    assert len(names) == launches <= 3, names
    assert names == [n for n in tsd.LAUNCHES if n in names], f"launch order {names}"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_no_host_read_and_no_aten_selection(setting, monkeypatch):
    """Nothing reads the device from the host, no ATen op selects, and every launched tensor is on q's device."""
    spec, _ = SETTINGS[setting]
    q, k, v, bounds, mask = _inputs(spec, 2)
    vl, ctrl = torch.tensor([L - 3, 17]), torch.tensor([0, 1], dtype=torch.int32)
    _call(q, k, v, bounds, vl, mask, spec, ctrl)  # the workspace of this shape exists from here on
    rec = _Recorder(monkeypatch)
    with ForbidHostSync(allowed=VIEWS_AND_ALLOCATIONS) as mode:
        rec.mode = mode
        _call(q, k, v, bounds, vl, mask, spec, ctrl)
    assert not mode.violations, mode.violations
    allocs = [op for op in mode.seen if op.startswith("aten.empty")]
    assert allocs == ["aten.empty.memory_format"], f"allocations besides the output: {allocs}"
    for name, _, args, kwargs in rec.log:
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                assert a.device == q.device, f"{name} takes a tensor on {a.device}"


@pytest.mark.parametrize("setting", ["tokens", "pages", "paper"])
def test_same_launches_for_any_lengths_masks_and_flags(setting, monkeypatch):
    spec, _ = SETTINGS[setting]
    q, k, v, bounds, mask = _inputs(spec, 3)
    gen = make_gen(33)
    vl, ctrl = torch.empty(B, dtype=torch.int64), torch.empty(2, dtype=torch.int32)  # a graph's static inputs
    sigs = []
    for lens, flags in (([L, L], [0, 0]), ([L - 5, 9], [0, 0]), ([3, 2], [0, 0]), ([L, L], [1, 0]), ([L, 70], [0, 1])):
        rec = _Recorder(monkeypatch)
        mask.copy_(torch.rand(mask.shape, generator=gen) < 0.7)
        vl.copy_(torch.tensor(lens))
        ctrl.copy_(torch.tensor(flags, dtype=torch.int32))
        _call(q, k, v, bounds, vl, mask, spec, ctrl)
        out_ptr = rec.log[-1][2][13].data_ptr()  # a fresh output each call here; a graph's pool gives the same one
        sigs.append([(n, g, tuple("out" if isinstance(a, tuple) and a[:2] == ("tensor", out_ptr) else a
                                  for a in args), kw) for n, g, args, kw in rec.signature()])
    assert all(s == sigs[0] for s in sigs[1:]), "the launches depend on the data"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recorded_launches_replay_exactly_on_new_inputs(setting, dtype, monkeypatch):
    """A replay stand-in: record one call's launches, change every input in place, re-issue them."""
    spec, _ = SETTINGS[setting]
    q, k, v, bounds, mask = _inputs(spec, 4, dtype)
    vl = torch.tensor([L, L - 20])
    ctrl = torch.zeros(2, dtype=torch.int32)
    rec = _Recorder(monkeypatch)
    _call(q, k, v, bounds, vl, mask, spec, ctrl)
    out = rec.log[-1][2][13]  # the attention launch's output buffer
    q2, k2, v2, bounds2, mask2 = _inputs(spec, 5, dtype)
    for step, (lens, flags) in enumerate((([L - 7, 41], [0, 0]), ([L, L], [0, 1]), ([33, L - 1], [1, 0]))):
        q.copy_(q2 * (step + 1))
        k.copy_(k2)  # "a prefill outside the graph": new keys, their bounds rebuilt in place
        v.copy_(v2)
        for t, t2 in zip(bounds, bounds2):
            t.copy_(t2)
        mask.copy_(mask2)
        vl.copy_(torch.tensor(lens))
        ctrl.copy_(torch.tensor(flags, dtype=torch.int32))
        out.fill_(float("nan"))
        rec.replay()
        want = _want(q, k, v, bounds, vl, mask, spec, ctrl)
        assert_close_report(out.float(), want.float(), *TOL[dtype], f"replay {step} ({setting})")


@pytest.mark.parametrize("setting", ["tokens", "pages", "paper"])
def test_looping_select_equals_the_resident_one(setting, monkeypatch):
    """Keys past ``_BLOCK_ALL`` (longer than 128K tokens in pages of 8) are selected in chunks, 4 bits a pass:
    forced here on a small cache, the same kept sets and output as the register-resident select."""
    spec, _ = SETTINGS[setting]
    q, k, v, bounds, mask = _inputs(spec, 6)
    vl = torch.tensor([L, L - 11])
    want = tsd.select_pages_triton(q, k, *bounds, vl, mask, D ** -0.5, spec)
    out_want = _call(q, k, v, bounds, vl, mask, spec)
    monkeypatch.setattr(tsd, "_BLOCK_ALL", 4)
    monkeypatch.setattr(tsd, "_BLOCK_SEL", 8)
    tsd._WORKSPACES.clear()
    got = tsd.select_pages_triton(q, k, *bounds, vl, mask, D ** -0.5, spec)
    assert torch.equal(got.idx, want.idx) and torch.equal(got.ok, want.ok)
    assert torch.equal(_call(q, k, v, bounds, vl, mask, spec), out_want)


def test_a_workspace_handed_out_under_capture_is_never_dropped(monkeypatch):
    """A graph captured over a call holds its workspace's pointers: past ``_MAX_WORKSPACES`` shapes the oldest
    workspace no capture holds is dropped, never a captured one (freed, its memory would be reused under the
    graph). ``_capturing`` stands in for ``torch.cuda.is_current_stream_capturing`` on this CPU."""
    monkeypatch.setattr(tsd, "_WORKSPACES", {})
    monkeypatch.setattr(tsd, "_CAPTURED", set())
    monkeypatch.setattr(tsd, "_MAX_WORKSPACES", 4)
    spec, _ = SETTINGS["tokens"]
    device = torch.device("cpu")

    def workspace(batch):
        plan = tsd._plan(batch, HKV, G, L, D, -(-L // S), spec, device, None)
        return tsd._workspace(plan, batch, HKV, G, -(-L // S), D, spec, device)

    first = workspace(1)
    monkeypatch.setattr(tsd, "_capturing", lambda dev: True)
    assert workspace(1) is first  # fetched while a graph is captured: pinned
    monkeypatch.setattr(tsd, "_capturing", lambda dev: False)
    second = workspace(2)
    for batch in range(3, 12):  # more shapes than the cache keeps
        workspace(batch)
    assert workspace(1) is first, "a captured workspace was dropped"
    assert workspace(2) is not second, "workspaces no capture holds are still dropped past the limit"
    assert len(tsd._WORKSPACES) == 4
