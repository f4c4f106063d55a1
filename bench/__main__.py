"""The one benchmark command line: ``python -m bench <command> [options]``.

Each command runs the ``main(argv)`` of one module, imported only when the command is chosen, so a command
whose module or dependencies are missing fails alone, with a message. ``python -m bench <command> --help``
lists the command's options; every command takes the flags of :mod:`bench.cli` (``--quick``, ``--out``,
``--compare``, and ``--threads`` where a CPU run makes sense).
"""
from __future__ import annotations

import importlib
import os
import sys

from bench.omp_env import default_waits

default_waits()  # before torch loads libgomp (bench.cli imports torch): see bench/omp_env.py

from bench.cli import PRESETS  # noqa: E402

#: command -> (module of bench/, what it measures)
COMMANDS = {
    "op": ("op", "the sparse decode op alone against SDPA on this CPU (table, JSON/CSV/PNG)"),
    "linear": ("linear", "decode-shaped linears in GB/s of weight read: ATen, packed, the native GEMV"),
    "decode": ("decode", "decode ms/token: eager, inductor and tinyserve side by side"),
    "onnx": ("onnx_decode", "decode ms/token in ONNX Runtime (dense and tinyserve exports) next to PyTorch"),
    "gpu": ("gpu", "the Triton kernels on a CUDA GPU: correctness, then timings against SDPA"),
    "accuracy": ("accuracy", "perplexity, passkey retrieval and diagnostics of the selections (SmolLM2)"),
    "study": ("study", "the selection study: quality against bytes over several windows of text"),
    "coverage": ("coverage", "every decoder-only HF architecture through the backend"),
    "clients": ("clients", "third-party decode loops (torchtune, litgpt, gpt-fast, ...) with backend=\"tinyserve\""),
    "serve": ("serve", "multi-user load: continuous batching, stock and with tinyserve"),
    "serve-http": ("serve_http", "what the HTTP server's threads cost: one CB workload in-process and via the server"),
    "paged-op": ("paged_op", "the paged op alone (native, PyTorch path, stock CB's gather + SDPA), one layer"),
    "ceilings": ("ceilings", "read bandwidth of the op's access patterns (pages, rows, sequential) on this machine"),
    "report": ("report", "markdown tables and PNG plots from the accuracy and study results"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m bench <command> [options]   (python -m bench <command> --help for its options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "every command takes --quick (a short run), --out PATH (a folder or a .json path) and",
              "--compare '{\"option\": value, ...}' (TinyServeConfig options, or a preset: "
              + ", ".join(PRESETS) + ") run side by side", "with the defaults; --threads where a CPU run makes sense."]
    return "\n".join(lines)


def load(command: str):
    """The ``main(argv)`` of ``command``'s module; SystemExit with a message when the module is missing."""
    module, _ = COMMANDS[command]
    name = f"bench.{module}"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise SystemExit(f"python -m bench {command}: bench/{module}.py is not in this checkout") from None
        raise SystemExit(f"python -m bench {command}: bench/{module}.py needs the module {e.name!r}, which is not "
                         f"installed ({e})") from None
    if not callable(getattr(mod, "main", None)):
        raise SystemExit(f"python -m bench {command}: bench/{module}.py has no main(argv)")
    return mod.main


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"python -m bench: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if command == "gpu" and "--dry-run" in rest:  # the interpreter must be chosen before triton is imported
        os.environ["TRITON_INTERPRET"] = "1"
    sys.argv = [f"python -m bench {command}"] + rest  # argparse's prog in usage and errors
    rc = load(command)(rest)
    return rc if isinstance(rc, int) else 0  # some mains return their rows


if __name__ == "__main__":
    sys.exit(main())
