"""What every ``python -m bench`` command shares on its command line: ``--quick``, ``--out``, ``--compare`` and
(where a CPU run makes sense) ``--threads``, and the named presets ``--compare`` takes.

``--compare '{"option": value, ...}'`` is a JSON object of :class:`~tinyserve_compile.config.TinyServeConfig`
options (or the name of one of :data:`PRESETS`): the command runs that variant side by side with the backend's
defaults, in one process. A command with no backend configuration to vary refuses it with a usage error that
names the argument.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Optional

from tinyserve_compile.config import TinyServeConfig

#: named option sets for ``--compare``: overrides of ``TinyServeConfig()``, defined here and nowhere else
PRESETS = {
    # the paper's selection rule: pages of 16, the bound alone (one stage, whole pages), no sink page, fp32 bounds
    "paper": {"page_size": 16, "sink_pages": 0, "candidate_factor": 1, "candidate_extra": 0, "keep_tokens": False,
              "bounds_dtype": "float32"},
    # the base of the selection study's grids (bench/study.py, bench/accuracy.py): the paper's rule, bf16 bounds
    "paper-bf16": {"page_size": 16, "sink_pages": 0, "candidate_factor": 1, "candidate_extra": 0,
                   "keep_tokens": False, "bounds_dtype": "bfloat16"},
    # the earlier defaults: bf16 bounds, two stages with c=2 keeping whole pages
    "previous": {"candidate_factor": 2, "candidate_extra": 0, "keep_tokens": False, "bounds_dtype": "bfloat16"},
    # the modelled GPU setting (bench/gpu_model.py, docs/gpu/README.md): pages of 32 with int8 bounds and a quarter
    # of the defaults' extra candidates, two stages keeping tokens; by bytes >= 1.5x the op's targets over SDPA
    # flash at 32K and 128K batch 8 (12.1x, 30.3x), where pages of 16 cannot reach 10.5x at 32K. Its quality misses
    # the targets: +4.2% perplexity at budget 2048, +9.8% at 512 (docs/selection_study.md), so it is not a default
    "gpu": {"page_size": 32, "sink_pages": 1, "candidate_factor": 1, "candidate_extra": 256, "keep_tokens": True,
            "bounds_dtype": "int8"},
}


class Options(dict):
    """``--compare``'s options, with the name of the variant: the preset's, else "compare"."""

    name = "compare"


def config(options: Optional[dict] = None) -> TinyServeConfig:
    """``TinyServeConfig()`` with ``options`` (a dict of overrides, or a preset's name) applied."""
    return TinyServeConfig.from_options(PRESETS[options] if isinstance(options, str) else options)


def options_arg(text: str) -> Options:
    """The value of ``--compare``: a JSON object of TinyServeConfig options, or a preset name (:class:`Options`)."""
    if text in PRESETS:
        value = Options(PRESETS[text])
        value.name = text
        return value
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"neither a preset ({', '.join(PRESETS)}) nor JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of tinyserve options, got {text!r}")
    try:
        TinyServeConfig.from_options(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return Options(value)


def parser(command: str, description: str, out: Optional[str] = None, quick: str = "a short run",
           threads: bool = True, options: bool = False, **kwargs) -> argparse.ArgumentParser:
    """The parser of ``python -m bench <command>`` with the shared flags: ``--quick`` (help ``quick``), ``--out``
    (default ``out``: a folder, or a ``.json`` path, see :func:`out_path`), ``--compare``, ``--threads`` unless
    ``threads`` is False, and with ``options`` ``--options`` (the base options of every tinyserve run, which
    ``--compare`` then changes)."""
    ap = argparse.ArgumentParser(prog=f"python -m bench {command}", description=description, **kwargs)
    g = ap.add_argument_group("flags of every command")
    g.add_argument("--quick", action="store_true", help=quick)
    g.add_argument("--out", default=out, metavar="PATH",
                   help="where the JSON (with a CSV and PNG next to it) goes: a folder or a .json path"
                   + (f" (default {out})" if out else " (default: print only)"))
    g.add_argument("--compare", type=options_arg, default=None, metavar="JSON",
                   help="run this variant of the backend's options side by side with the defaults: a JSON object "
                   "of TinyServeConfig options, e.g. '{\"decode_linear\": false}', or a preset: "
                   + ", ".join(PRESETS))
    if options:
        g.add_argument("--options", type=options_arg, default="{}", metavar="JSON",
                       help="tinyserve options of every tinyserve run, e.g. '{\"token_budget\": 1024}' (default {})")
    if threads:
        g.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    return ap


def parse(ap: argparse.ArgumentParser, argv=None, compare: Optional[str] = None) -> argparse.Namespace:
    """``ap.parse_args(argv)``, then ``--threads`` applied. ``compare``: why this command takes no ``--compare``
    (a usage error naming the argument when it is given); None when it takes one."""
    a = ap.parse_args(argv)
    if compare is not None and a.compare is not None:
        ap.error(f"argument --compare: {compare}")
    if isinstance(getattr(a, "threads", None), int):  # a command timing several counts takes a list and sets each
        import torch

        torch.set_num_threads(a.threads)
    return a


def out_path(out: Optional[str], stem: str) -> Optional[str]:
    """The JSON file ``--out`` names: ``out`` itself when it ends in ``.json``, else ``<out>/<stem>.json``; None
    when ``out`` is empty (print only)."""
    if not out:
        return None
    return out if out.endswith(".json") else os.path.join(out, f"{stem}.json")


def changed(options: dict) -> dict:
    """The entries of ``options`` that differ from ``TinyServeConfig()`` (a variant's label)."""
    base = TinyServeConfig()
    return {k: v for k, v in options.items() if k not in {f.name for f in dataclasses.fields(base)}
            or getattr(base, k) != v}
