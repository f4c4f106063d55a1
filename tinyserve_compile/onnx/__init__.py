"""ONNX export of the decode step: :mod:`.export` (``export_onnx``, ``decode_state``, the CLI), :mod:`.ops` (the
functional twins of the backend's ops), :mod:`.translate` (their lowerings to standard ONNX ops), :mod:`.runtime`
(an ONNX Runtime decoder) and :mod:`.check` (what TensorRT's parser would reject).

Nothing is imported here: the modules need onnx/onnxscript, and importing ``tinyserve_compile`` stays free of them.
"""
