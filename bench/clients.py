"""``python -m bench clients [--quick] [--only NAME[,NAME]]``: third-party decode loops through the backend.

Each client library gets its own virtualenv under ``~/.cache/tinyserve_compile/clients/<name>`` (reused across
runs; the libraries pin conflicting versions): torch 2.13.0 from the local CPU wheel first, then the library
at a pinned version (``--no-deps`` plus a short explicit list where its own requirements would pull another
torch or a GPU-only package), then this checkout, installed non-editable. ``bench/client_drivers.py`` runs
inside that virtualenv: it builds a tiny random-init model with the library's own model code and runs the
library's own decode loop four times, eagerly, compiled with ``backend="tinyserve"`` and a budget covering
the context (dense-exact: the greedy tokens equal eager), compiled with a small budget and page size (so the
selection drops pages), and eagerly with the rewritten layers' attention answered by the reference rule
(``tinyserve_compile.testing``). Nothing is downloaded from a model hub.

Output: a table on stdout, ``docs/bench/clients.{json,csv}`` and ``docs/clients.md``.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "client_drivers.py"
CACHE = Path(os.environ.get("TINYSERVE_CLIENTS_CACHE", Path.home() / ".cache" / "tinyserve_compile" / "clients"))
TORCH = "torch==2.13.0"

#: executorch's requirements without coremltools, scikit-learn and the test tools (its llama example needs none)
EXECUTORCH_DEPS = ["torchao==0.18.0", "pyyaml", "ruamel.yaml", "numpy", "sympy", "typing-extensions", "omegaconf",
                   "hydra-core", "tabulate", "pytorch-tokenizers", "packaging", "flatbuffers"]
#: llama-models' requirements plus fairscale, which its reference model code imports
LLAMA_MODELS_DEPS = ["fairscale==0.4.13", "numpy", "pydantic>=2", "tiktoken", "pyyaml", "jinja2", "pillow",
                     "termcolor", "rich", "httpx"]

#: name -> what to install and what the client is. ``deps=None``: the library's own requirements (under a
#: torch==2.13.0 constraint); a list: ``--no-deps`` and exactly these.
CLIENTS = {
    "torchtune": dict(  # torchao 0.16 and later drop the nf4 module that torchtune 0.6.1 imports
        pkgs=["torchtune==0.6.1", "torchao==0.15.0"], deps=None,
        loop="torchtune.generation.generate with a compiled generate_next_token (KVCache.update: "
             "k_cache[:, :, cache_pos[:n]] = k)"),
    "litgpt": dict(
        pkgs=["litgpt==0.5.13"], deps=None,
        loop="litgpt.generate.base.generate with a compiled next_token, as its --compile does (KVCache.forward: "
             "k = self.k[:bs].index_copy_(-2, pos, k), read as k[..., :input_pos_maxp1, :])"),
    "gpt-fast": dict(
        pkgs=["torchao==0.15.0"], deps=[],
        loop="gpt-fast's model.py + generate.py as torchao ships them (torchao/_models/llama, last in 0.15.0; "
             "gpt-fast itself is not on PyPI): generate() with a compiled decode_one_token, as its main() does "
             "(k_cache[:, :, input_pos] = k with int32 positions)"),
    "hf-static": dict(
        pkgs=["transformers==5.24.0"], deps=None,
        loop="transformers generate() with cache_implementation='static' and a CompileConfig (StaticCache: "
             "index_copy_ along the sequence dim)"),
    "executorch": dict(
        pkgs=["executorch==1.5.1"], deps=EXECUTORCH_DEPS,
        loop="executorch examples/models/llama: llama_transformer with its KVCache in dynamic-shape mode (what "
             "its eager runner feeds: start_pos = input_pos[0].item(), k_cache.index_copy_(2, arange(n) + start_pos, "
             "k)), run by its runner's LlamaRunner.generate"),
    "executorch-scalars": dict(
        venv="executorch", pkgs=["executorch==1.5.1"], deps=EXECUTORCH_DEPS,
        loop="the executorch loop above with torch._dynamo.config.capture_scalar_outputs = True (the cache's "
             ".item() stays in the graph)"),
    "llama4-reference": dict(
        venv="llama-models", pkgs=["llama-models==0.3.0"],
        deps=LLAMA_MODELS_DEPS,
        loop="Meta's reference Llama 4 text model (llama_models.llama4.model: cache_k[:bsz, pos:pos+n] = xk, "
             "keys read as cache_k[:bsz, :pos+n], no mask in decode), in the loop of its generate()"),
    "llama3-reference": dict(
        venv="llama-models", pkgs=["llama-models==0.3.0"],
        deps=LLAMA_MODELS_DEPS,
        loop="Meta's reference Llama 3 (llama_models.llama3.model: attention as matmul + softmax), in the loop of "
             "its generate()"),
}

#: what was looked at and is not in the sweep, with the reason
SKIPPED = {
    "torchchat": "not on PyPI: the PyPI name 'torchchat' (0.0.1, 2024-03) holds an old torchtune snapshot, and "
                 "torchchat's generate.py builds on gpt-fast's model.py (covered as gpt-fast)",
    "mistral-inference": "its attention is xformers' memory_efficient_attention over a ring-buffer cache, not "
                         "SDPA (nothing for the backend to rewrite), and xformers has no CPU operator for it "
                         "(cutlass and flash kernels are CUDA-only), so the library cannot decode on CPU",
    "nanoGPT": "not on PyPI; karpathy/nanoGPT's model.py has no KV cache (each step recomputes the whole "
               "context), so it has no decode SDPA to rewrite",
}


#: read with the table
NOTES = [
    "The libraries' generate loops run as their users run them with compilation on: torchtune's recipe "
    "compiles generate_next_token, litgpt's --compile and gpt-fast's --compile compile their per-token step "
    "function, transformers compiles the forward through CompileConfig, the others compile the model.",
    "llama-models' own generate() allocates its tensors with device=\"cuda\" and its Llama 4 attention "
    "creates its caches with .cuda(): the sweep builds the model with .cuda() as the identity and runs the "
    "same prev_pos -> cur_pos loop on CPU. Its Llama 3 attention is written as matmul + softmax, so there is "
    "no SDPA call to rewrite.",
    "executorch's eager runner feeds the dynamic-shape cache, whose .item() of the start position breaks the "
    "graph between the cache write and the attention: that site stays dense with its reason. With "
    "torch._dynamo.config.capture_scalar_outputs = True the write and the attention share one graph and every "
    "layer is rewritten (executorch-scalars).",
    "A logit hook on the LM head records each step outside the compiled graph (a graph break after the head), "
    "so graphs counts those too; layers_rewritten is the sparse attention calls per decode step.",
]


def _run(cmd, log, **kw):
    with open(log, "a") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        return subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, **kw).returncode


def _torch_base(log=print) -> Path:
    """One virtualenv holding only torch 2.13.0 (the local CPU wheel); its site-packages, shared by every client."""
    base = CACHE / "_torch"
    py = base / "bin" / "python"
    stamp = base / ".installed"
    if not (stamp.exists() and stamp.read_text() == TORCH):
        log(f"[torch] installing {TORCH} into {base}")
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(base)], check=True)
        if _run([py, "-m", "pip", "install", "-q", TORCH], CACHE / "_torch.install.log") != 0:
            raise RuntimeError(f"installing {TORCH} failed (see {CACHE / '_torch.install.log'})")
        stamp.write_text(TORCH)
    return Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def setup_venv(name: str, spec: dict, log=print) -> Path:
    """Create (or reuse) the client's virtualenv: torch first, then the library, then this checkout; its python.

    torch comes from one shared virtualenv (``_torch``, the local CPU wheel) through a ``.pth`` file, so that pip
    sees torch 2.13.0 as installed and a library's requirements cannot replace it (a constraints file pins it
    too); everything else lives in the client's own virtualenv, ahead of the shared one on ``sys.path``.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    torch_site = _torch_base(log)
    name = spec.get("venv", name)  # clients of one library share its virtualenv
    venv = CACHE / name
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    want = json.dumps({"torch": TORCH, "pkgs": spec["pkgs"], "deps": spec["deps"]}, sort_keys=True)
    logf = CACHE / f"{name}.install.log"
    if not (stamp.exists() and stamp.read_text() == want):
        t0 = time.time()
        log(f"[{name}] installing into {venv} (log: {logf})")
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / "zz_tinyserve_torch.pth").write_text(str(torch_site) + "\n")
        cons = venv / "constraints.txt"
        cons.write_text(TORCH + "\n")
        pip = [py, "-m", "pip", "install", "-q", "-c", cons]
        steps = [pip + [TORCH]]  # already satisfied through the shared site-packages
        if spec["deps"] is None:
            steps.append(pip + spec["pkgs"])
        else:
            steps.append(pip + ["--no-deps"] + spec["pkgs"])
            if spec["deps"]:
                steps.append(pip + spec["deps"])
        for cmd in steps:
            if _run(cmd, logf) != 0:
                raise RuntimeError(f"{name}: install failed: {' '.join(map(str, cmd[6:]))} (see {logf})")
        stamp.write_text(want)
        log(f"[{name}] installed in {time.time() - t0:.0f} s")
    # this checkout, non-editable, every run (the code under test changes between runs), with its own
    # requirements (numpy, ninja for the native build) as a user's install gets them
    # (pip always rebuilds and reinstalls a local folder)
    if _run([py, "-m", "pip", "install", "-q", "-c", venv / "constraints.txt", "--no-build-isolation", ROOT],
            logf) != 0:
        raise RuntimeError(f"{name}: installing this checkout failed (see {logf})")
    return py


def _commit() -> str:
    """The checkout's commit, with ``+changes`` when the installed package's files differ from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--", "tinyserve_compile", "passes", "kernels",
                                  "pyproject.toml"], capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def run_client(name: str, lower: str, timeout: int, log=print) -> dict:
    """Install (or reuse) the client's virtualenv and run its driver there; the driver's row."""
    spec = CLIENTS[name]
    commit = _commit()  # what setup_venv installs
    try:
        py = setup_venv(name, spec, log)
    except Exception as e:  # an install that fails is the client's result, with its reason
        return dict(client=name, error=str(e))
    out = CACHE / f"{name}.result.json"
    out.unlink(missing_ok=True)
    errf = CACHE / f"{name}.driver.log"
    t0 = time.time()
    log(f"[{name}] running {spec['loop']}")
    try:
        with open(errf, "w") as f:
            # cwd: not the checkout, so that the installed wheel (not the source tree) is imported
            subprocess.run([str(py), str(DRIVER), name, "--lower", lower, "--out", str(out)], stdout=f,
                           stderr=subprocess.STDOUT, timeout=timeout, cwd=str(CACHE))
    except subprocess.TimeoutExpired:
        return dict(client=name, error=f"driver timed out after {timeout} s (see {errf})")
    if not out.exists():
        tail = errf.read_text()[-2000:]
        return dict(client=name, error=f"driver wrote no result (see {errf}): {tail}")
    row = json.loads(out.read_text())
    row["commit"] = commit
    log(f"[{name}] done in {time.time() - t0:.0f} s")
    return row


COLUMNS = ("client", "library", "layers_rewritten", "sites_rewritten", "sites_dense", "worst_vs_reference",
           "tokens_equal_reference", "sparse_vs_eager", "dense_exact", "worst_dense_vs_eager", "native_kernel",
           "dense_reasons")


def _cell(r: dict, k: str) -> str:
    v = r.get(k, "")
    if k == "native_kernel" and isinstance(v, str) and v.startswith("unavailable"):
        return "no: " + v.split(": ", 1)[-1].split(": /")[0][:60]  # the reason, without the path
    if isinstance(v, float):
        return f"{v:.2e}"
    if isinstance(v, list):
        return "; ".join(v) if v else "-"
    return str(v)


def verdict(r: dict) -> str:
    """``ok`` (every site rewritten, matches the reference, dense-exact), ``dense`` (sites left dense with their
    reasons, still exact), ``no SDPA`` (nothing to rewrite), ``WRONG`` (a wrong answer), ``error``, ``skipped``."""
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return "error"
    exact = r["dense_exact"] and r["tokens_equal_reference"] and r["worst_vs_reference"] < 1e-3
    if not exact:
        return "WRONG"
    if not r.get("attention_sites"):
        return "no SDPA"
    return "ok" if r["sites_dense"] == 0 and r["sites_rewritten"] > 0 else "dense"


def table(rows) -> str:
    cols = ("client", "verdict") + COLUMNS[1:]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"| {r['client']} | {verdict(r)} | " + " | ".join([""] * (len(cols) - 3))
                         + f" | {why.splitlines()[0][:300] if why else ''} |")
            continue
        lines.append("| " + " | ".join([r["client"], verdict(r)] + [_cell(r, k) for k in COLUMNS[1:]]) + " |")
    return "\n".join(lines)


def write(rows, path: Path, md: Path, lower: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = [{k: v for k, v in r.items() if k != "trace"} for r in rows]
    for r in keep:
        r["verdict"] = verdict(r)
    path.write_text(json.dumps(keep, indent=1))
    keys = list(dict.fromkeys(k for r in keep for k in r))
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows([{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in keep])
    commit = next((r["commit"] for r in rows if r.get("commit")), None) or _commit()
    run = next((r for r in rows if "options" in r), dict(options={}, prompt="?", new="?", dense_options={}))
    loops = "\n".join(f"- **{n}**: {s['loop']}; installed: {', '.join(s['pkgs'])}"
                      + ("" if s["deps"] is None else f" (`--no-deps`, then: {', '.join(s['deps']) or 'nothing'})")
                      for n, s in CLIENTS.items())
    skipped = "\n".join(f"- **{n}**: {why}" for n, why in SKIPPED.items())
    notes = "\n".join(f"- {n}" for n in NOTES)
    md.write_text(f"""# Third-party decode loops through the backend

`python -m bench clients` (`bench/clients.py`, driver `bench/client_drivers.py`) runs each library's own
decode loop on CPU with `torch.compile(..., backend="tinyserve")`, each library in its own virtualenv
(torch {TORCH.split("==")[1]} CPU wheel, this checkout installed non-editable). Every model is a tiny random-init
model built with the library's own model code (3 layers, 4 query heads, 2 KV heads, head dim 16); the loop
decodes {run["new"]} greedy tokens after a {run["prompt"]}-token prompt.

- **sites rewritten / dense**: over every graph compiled in the small-budget run (`tinyserve_compile.explain()`),
  with the reasons of the dense ones.
- **worst_vs_reference**: the worst |logit difference| over all steps between the compiled run (options
  `{json.dumps(run["options"])}`, `lower="{lower}"`) and the same loop run eagerly with only the rewritten
  layers' attention answered by the reference rule (`sparse_decode_reference` with the same options);
  **tokens_equal_reference**: the greedy tokens agree.
- **sparse_vs_eager**: the worst |logit difference| between the small-budget run and stock eager: not zero,
  so the selection did drop pages.
- **dense_exact**: with `{json.dumps(run["dense_options"])}` (covering the context) the greedy tokens equal eager;
  **worst_dense_vs_eager** is the logit difference.
- **verdict**: `ok` (every site rewritten, exact), `dense` (sites left dense, each with its reason; still exact),
  `no SDPA` (the library's attention is not an SDPA call: nothing to rewrite), `WRONG` (a wrong answer),
  `error`, `skipped`.

Measured at commit {commit} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).

{table(rows)}

## The loops

{loops}

Notes:

{notes}

Not in the sweep:

{skipped}
""")
    print(f"wrote {path} (+ .csv) and {md}", file=sys.stderr)


def main(argv=None):
    from bench import cli

    ap = cli.parser("clients", __doc__.split("\n\n")[0], out=str(ROOT / "docs" / "bench"), threads=False,
                    quick="lower='eager' (no Inductor compile): a few minutes")
    ap.add_argument("--only", default="", help="comma-separated client names (default: all)")
    ap.add_argument("--lower", default="", choices=("", "eager", "inductor"),
                    help="how the rewritten graph runs (default: inductor, or eager with --quick)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per client driver")
    ap.add_argument("--md", default=str(ROOT / "docs" / "clients.md"))
    ap.add_argument("--list", action="store_true", help="print the clients and exit")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the table and docs from the JSON in --out (no run)")
    a = cli.parse(ap, argv, compare="clients runs each library's own loop with the drivers' fixed options "
                  "(bench/client_drivers.py): no variant is implemented")
    path = Path(cli.out_path(a.out, "clients"))
    if a.list:
        for n, s in CLIENTS.items():
            print(f"{n}: {s['loop']}")
        for n, why in SKIPPED.items():
            print(f"{n}: skipped: {why}")
        return 0
    if a.report_only:
        rows = json.loads(path.read_text())
        lower = next((r["lower"] for r in rows if "lower" in r), "?")
        print(table(rows))
        write(rows, path, Path(a.md), lower)
        return 0
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(CLIENTS)
    bad = [n for n in names if n not in CLIENTS]
    if bad:
        raise SystemExit(f"--only: unknown client(s) {bad}; known: {sorted(CLIENTS)}")
    lower = a.lower or ("eager" if a.quick else "inductor")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = [run_client(n, lower, a.timeout, log) for n in names]
    rows += [dict(client=n, skipped=why) for n, why in SKIPPED.items()] if not a.only else []
    print(table(rows))
    write(rows, path, Path(a.md), lower)
    return 1 if any(verdict(r) == "WRONG" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
