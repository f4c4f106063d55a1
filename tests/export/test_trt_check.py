"""Every node of the exported steps is an op TensorRT's ONNX parser supports, within its restrictions."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from tinyserve_compile.onnx.check import TRT_MAX_TOPK, trt_problems


@pytest.mark.parametrize("name", ["llama_sparse", "llama_one_stage", "gpt2_sparse", "llama_dense",
                                  "llama_int8_tokens"])
def test_exported_steps_pass_the_tensorrt_check(exports, name):
    info = exports[name]
    m = onnx.load(info.path, load_external_data=False)
    onnx.checker.check_model(m)
    assert trt_problems(m) == []
    assert max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) >= 18
    assert {n.domain for n in m.graph.node} <= {""} and not m.functions
    ops = {n.op_type for n in m.graph.node}
    if info.sparse_layers:
        assert {"TopK", "ScatterND", "Gather"} <= ops
        inits = {i.name: i for i in m.graph.initializer}
        ks = sorted(int(onnx.numpy_helper.to_array(inits[n.input[1]]).reshape(-1)[0])
                    for n in m.graph.node if n.op_type == "TopK")
        assert ks and all(k < TRT_MAX_TOPK for k in ks), ks


@pytest.mark.parametrize("int8_write", ["tensorrt", "inplace"])
def test_int8_bounds_write_passes_only_through_qdq(tmp_path, int8_write):
    """The default int8 write (Q/DQ of the whole state) passes; scattering int8 codes in place is flagged."""
    import torch
    from tests.support.export_helpers import export_module

    from tinyserve_compile.kernels.spec import SelectionSpec
    from tinyserve_compile.onnx import ops as onnx_ops  # noqa: F401  (registers the ops)

    class Write(torch.nn.Module):
        def forward(self, k, kmax, kmin, kabs, pos):
            spec = SelectionSpec(8, 8, 0, 1, 0, False, torch.int8).to_list()
            return torch.ops.tinyserve.export_bounds_write(k, kmax, kmin, kabs, pos, spec)

    z = torch.zeros(1, 2, 4, 16, dtype=torch.int8)
    args = (torch.randn(1, 2, 32, 16), z, z.clone(), torch.zeros(1, 2, 4), torch.tensor([9]))
    m = onnx.load(export_module(Write(), args, tmp_path / "w.onnx", int8_write))
    found = trt_problems(m)
    if int8_write == "tensorrt":
        assert found == [] and {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in m.graph.node}
    else:
        assert found and all("INT8" in p for p in found) and any("ScatterND" in p for p in found), found


def _model(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def test_the_check_rejects_what_tensorrt_rejects():
    x, y = _vi("x", [4, 8]), _vi("y", [4, 2])
    k_in = _vi("k", [1], TensorProto.INT64)
    i64 = lambda name, v: helper.make_tensor(name, TensorProto.INT64, [len(v)], v)  # noqa: E731
    cases = [  # (graph, what the problem line must say)
        (_model([helper.make_node("TopK", ["x", "k"], ["y", "i"], name="t")], [x, k_in],
                [y, _vi("i", [4, 2], TensorProto.INT64)]), "input 1 ('k') is not a constant"),
        (_model([helper.make_node("TopK", ["x", "kc"], ["y", "i"], name="t")], [x],
                [y, _vi("i", [4, 2], TensorProto.INT64)], [i64("kc", [TRT_MAX_TOPK + 256])]), "not below"),
        (_model([helper.make_node("ScatterND", ["x", "idx", "u"], ["z"], name="s", reduction="add")],
                [x, _vi("idx", [1, 1], TensorProto.INT64), _vi("u", [1, 8])], [_vi("z", [4, 8])]), "reduction"),
        (_model([helper.make_node("ReduceMax", ["x", "ax"], ["z"], name="r")],
                [x, _vi("ax", [1], TensorProto.INT64)], [_vi("z", [4])]), "input 1 ('ax') is not a constant"),
        (_model([helper.make_node("Unique", ["x"], ["z"], name="u")], [x], [_vi("z", [None])]), "support matrix"),
        (_model([helper.make_node("SparseAttention", ["x"], ["z"], name="c", domain="tinyserve")], [x],
                [_vi("z", [4, 8])]), "custom domain"),
        (_model([helper.make_node("Relu", ["x"], ["z"], name="r")], [x], [_vi("z", [4, 8])], opset=23), "opset 23"),
        (_model([helper.make_node("Cast", ["c"], ["z"], name="c", to=TensorProto.FLOAT)],
                [_vi("c", [4, 8], TensorProto.INT8)], [_vi("z", [4, 8])]), "reads INT8 'c'"),
        (_model([helper.make_node("Cast", ["x"], ["z"], name="c", to=TensorProto.INT8)],
                [x], [_vi("z", [4, 8], TensorProto.INT8)]), "writes INT8 'z'"),
    ]
    for m, what in cases:
        found = trt_problems(m)
        assert any(what in p for p in found), (what, found)
    # and a clean graph passes
    ok = _model([helper.make_node("TopK", ["x", "kc"], ["y", "i"], name="t")], [x],
                [y, _vi("i", [4, 2], TensorProto.INT64)], [i64("kc", [2])])
    assert trt_problems(ok) == []
