"""Run an exported decode step in ONNX Runtime (CPU): :class:`OrtDecoder`.

The step's state outputs are bound to the very buffers of its state inputs
(IOBinding), so the cache and bounds are updated in place instead of being
copied every step: ``ScatterND`` skips its copy when its output is its input.
That is only safe when the step reads a state input nowhere else; the decoder
checks this on the graph, and double-buffers (one copy per step) any input for
which it does not hold.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

import torch

__all__ = ["OrtDecoder", "shared_buffer_inputs"]


def shared_buffer_inputs(model_path) -> Dict[str, str]:
    """``{state input: output}`` pairs that may share one buffer.

    A pair qualifies when the input's only consumer is a ``ScatterND`` reading it
    as ``data`` and the output is that node's result (directly or through
    ``Identity`` nodes), or a ``DequantizeLinear`` (a new buffer) that the node
    producing the output depends on (int8 bounds written through Q/DQ): either
    way the input is fully read before the output is written.
    """
    import onnx

    g = onnx.load(os.fspath(model_path), load_external_data=False).graph
    consumers: Dict[str, list] = {}
    producer = {}
    for n in g.node:
        for i, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, i))
        for o in n.output:
            producer[o] = n
    outputs = {o.name for o in g.output}
    pairs = {}
    for inp in g.input:
        out = f"{inp.name}.out"
        if out not in outputs:
            continue
        users = consumers.get(inp.name, [])
        if len(users) != 1 or users[0][0].op_type not in ("ScatterND", "DequantizeLinear") or users[0][1] != 0:
            continue
        node, src = users[0][0], out
        while src in producer and producer[src].op_type == "Identity":
            src = producer[src].input[0]
        if src in node.output or (node.op_type == "DequantizeLinear" and _depends_on(src, node, producer)):
            pairs[inp.name] = out
    return pairs


def _depends_on(value: str, node, producer) -> bool:
    """Whether computing ``value`` needs an output of ``node``."""
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        if v in seen or v not in producer:
            continue
        seen.add(v)
        p = producer[v]
        if p is node:
            return True
        todo.extend(i for i in p.input if i)
    return False


class OrtDecoder:
    """Greedy decode steps of an exported file in ONNX Runtime, with the state kept in place.

    Parameters
    ----------
    path : str or os.PathLike
        A file written by :func:`tinyserve_compile.export_onnx`.
    threads : int, optional
        ``intra_op_num_threads`` (default: ONNX Runtime's choice).
    share_buffers : bool
        Bind each state output to its input's buffer where that is safe (see
        :func:`shared_buffer_inputs`); False double-buffers every state tensor.
    """

    def __init__(self, path, *, threads: Optional[int] = None, share_buffers: bool = True):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = int(threads)
        so.log_severity_level = 3
        self.path = os.fspath(path)
        self.session = ort.InferenceSession(self.path, so, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        if self.input_names[:2] != ["input_ids", "position"] or self.output_names[0] != "logits":
            raise ValueError(f"OrtDecoder: argument 'path' is not an exported decode step (inputs "
                             f"{self.input_names[:3]}..., outputs {self.output_names[:2]}...)")
        self.state_names = self.input_names[2:]
        self.shared = shared_buffer_inputs(self.path) if share_buffers else {}
        self.state: Dict[str, torch.Tensor] = {}
        self._spare: Dict[str, torch.Tensor] = {}

    def load_state(self, state: Mapping[str, torch.Tensor], copy: bool = True) -> None:
        """Set the state (see :func:`tinyserve_compile.onnx.export.decode_state`).

        Parameters
        ----------
        state : mapping
            ``{name: tensor}`` for every state input of the file.
        copy : bool
            Copy the tensors (default); False decodes into the given buffers.
        """
        missing = [n for n in self.state_names if n not in state]
        if missing:
            raise ValueError(f"OrtDecoder.load_state: argument 'state' lacks {missing[:4]} ({len(missing)} missing)")
        types = {i.name: i for i in self.session.get_inputs()}
        new = {}
        for n in self.state_names:
            t = state[n]
            want = list(types[n].shape)
            if list(t.shape) != want:
                raise ValueError(f"OrtDecoder.load_state: state '{n}' has shape {tuple(t.shape)}, the file wants {want}")
            t = t.detach()
            new[n] = t.clone(memory_format=torch.contiguous_format) if copy or not t.is_contiguous() else t
        self.state = new
        self._spare = {n: torch.empty_like(t) for n, t in new.items() if n not in self.shared}

    def step(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One decode step; the state advances in place.

        Parameters
        ----------
        input_ids : torch.Tensor
            int64 ``[B, 1]``.
        position : torch.Tensor
            int64 ``[B]``: the slot each row writes.

        Returns
        -------
        torch.Tensor
            float32 ``[B, V]`` logits.
        """
        import onnxruntime as ort

        if not self.state:
            raise ValueError("OrtDecoder.step: no state; call load_state first")
        b = self.session.io_binding()
        b.bind_ortvalue_input("input_ids", ort.OrtValue.from_dlpack(input_ids.to(torch.int64).contiguous()))
        b.bind_ortvalue_input("position", ort.OrtValue.from_dlpack(position.to(torch.int64).reshape(-1).contiguous()))
        b.bind_output("logits")  # first: get_outputs() follows the binding order
        for n in self.state_names:
            b.bind_ortvalue_input(n, ort.OrtValue.from_dlpack(self.state[n]))
            dst = self.state[n] if n in self.shared else self._spare[n]
            b.bind_ortvalue_output(f"{n}.out", ort.OrtValue.from_dlpack(dst))
        self.session.run_with_iobinding(b)
        for n in self._spare:  # double-buffered: the output becomes the next input
            self.state[n], self._spare[n] = self._spare[n], self.state[n]
        return torch.from_dlpack(b.get_outputs()[0]).clone()
