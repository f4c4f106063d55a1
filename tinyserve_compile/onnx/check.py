"""Static check of an ONNX graph against what TensorRT's ONNX parser accepts: :func:`trt_problems`.

TensorRT cannot be installed here, so an exported file is checked op by op
against the parser's published support matrix (onnx-tensorrt
``docs/operators.md``, TensorRT 8.5's table; ``LayerNormalization`` from 8.6)
and the restrictions that matter for the decode step: ``TopK``'s ``K`` an
initializer below 3840, no ``ScatterND``/``ScatterElements`` reduction, constant
reduction/slice axes, opsets 9-20 (TensorRT 10.0), no custom domain, and INT8
tensors only where the parser takes them: TensorRT treats INT8 as a quantized type,
produced by ``QuantizeLinear`` and read by ``DequantizeLinear`` (or a graph input /
output / constant), so no ``Cast``, ``ScatterND`` or data movement on INT8. Passing
this check does not prove that an engine builds; ``bench/trt_build.sh`` does
that where TensorRT exists.
"""
from __future__ import annotations

import os
from typing import List

__all__ = ["TRT_OPS", "TRT_MAX_TOPK", "trt_problems"]

#: ops the TensorRT ONNX parser supports (its support matrix, rows marked Y)
TRT_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast Ceil Celu Clip
Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace DequantizeLinear Div Dropout Einsum
Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gemm GlobalAveragePool GlobalLpPool
GlobalMaxPool Greater GreaterOrEqual GridSample GRU HardSigmoid HardSwish Identity If ImageScaler
InstanceNormalization IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM
LpNormalization LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mod Mul Neg NonMaxSuppression NonZero
Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin
ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN RoiAlign Round ScaledTanh Scan Scatter
ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth
Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

#: TensorRT's TopK limit on K
TRT_MAX_TOPK = 3840
_OPSETS = (9, 20)  # TensorRT 10.0 parses opsets 9 to 20
#: (op, input index) that must be a constant: reduction axes (opset 18 inputs), slice/squeeze axes, TopK's K
_CONST_INPUTS = {
    "TopK": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceProd": (1,),
    "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,), "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "Slice": (3,),
}
#: (op, input index) where an INT8 tensor may be read: the quantized input and the zero points of Q/DQ
_INT8_READERS = {("DequantizeLinear", 0), ("DequantizeLinear", 2), ("QuantizeLinear", 2)}


def _int8_problems(model) -> List[str]:
    """INT8 tensors that are not produced by ``QuantizeLinear`` / read by ``DequantizeLinear``."""
    import onnx

    int8 = onnx.TensorProto.INT8
    try:
        g = onnx.shape_inference.infer_shapes(model, data_prop=False).graph
    except Exception:  # noqa: BLE001 - a graph ONNX cannot type (custom domain): its declared types only
        g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)
             if v.type.HasField("tensor_type")}
    types.update({i.name: i.data_type for i in g.initializer})
    constant = {i.name for i in g.initializer}
    problems = []
    for n in g.node:
        where = f"{n.op_type} node {n.name!r}"
        if n.op_type == "Constant":
            continue
        for i, name in enumerate(n.input):
            if name and types.get(name) == int8 and (n.op_type, i) not in _INT8_READERS:
                problems.append(f"{where}: reads INT8 {name!r}; TensorRT reads INT8 only through DequantizeLinear")
        for name in n.output:
            if name and types.get(name) == int8 and n.op_type != "QuantizeLinear" and name not in constant:
                problems.append(f"{where}: writes INT8 {name!r}; TensorRT makes INT8 only with QuantizeLinear")
    return problems


def trt_problems(model) -> List[str]:
    """Why TensorRT's ONNX parser would reject ``model`` (empty when nothing is found).

    Parameters
    ----------
    model : onnx.ModelProto or str or os.PathLike
        The graph (a path is loaded without its external weights).

    Returns
    -------
    list of str
        One line per problem, naming the node.
    """
    import onnx
    from onnx import numpy_helper

    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model), load_external_data=False)
    g = model.graph
    problems = []
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and not _OPSETS[0] <= o.version <= _OPSETS[1]:
            problems.append(f"opset {o.version} outside TensorRT's {_OPSETS[0]}-{_OPSETS[1]}")
        elif o.domain not in ("", "ai.onnx"):
            problems.append(f"custom opset domain {o.domain!r}")
    if model.functions:
        problems.append(f"model-local functions {[f.name for f in model.functions]}")
    consts = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    consts[n.output[0]] = numpy_helper.to_array(a.t)
                elif a.name in ("value_int", "value_ints"):
                    consts[n.output[0]] = onnx.helper.get_attribute_value(a)
    for n in g.node:
        where = f"{n.op_type} node {n.name!r}"
        if n.domain not in ("", "ai.onnx"):
            problems.append(f"{where}: custom domain {n.domain!r}")
            continue
        if n.op_type not in TRT_OPS:
            problems.append(f"{where}: not in TensorRT's ONNX op support matrix")
        for i in _CONST_INPUTS.get(n.op_type, ()):
            if i < len(n.input) and n.input[i] and n.input[i] not in consts:
                problems.append(f"{where}: input {i} ({n.input[i]!r}) is not a constant")
        if n.op_type == "TopK" and len(n.input) > 1 and n.input[1] in consts:
            k = int(__import__("numpy").asarray(consts[n.input[1]]).reshape(-1)[0])
            if k >= TRT_MAX_TOPK:
                problems.append(f"{where}: K={k} is not below TensorRT's limit {TRT_MAX_TOPK}")
        if n.op_type in ("ScatterND", "ScatterElements"):
            for a in n.attribute:
                if a.name == "reduction" and onnx.helper.get_attribute_value(a) not in (b"none", "none"):
                    problems.append(f"{where}: reduction={onnx.helper.get_attribute_value(a)!r}")
    return problems + _int8_problems(model)
