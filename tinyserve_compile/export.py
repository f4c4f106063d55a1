"""``python -m tinyserve_compile.export``: the ONNX export's command line (:mod:`tinyserve_compile.onnx.export`)."""
from .onnx.export import decode_state, export_onnx, main  # noqa: F401

if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
