"""The bench command line (``python -m bench <command>``: every command takes --quick, --out, --compare) and the
benchmarks' "defaults": every benchmark that says it runs the backend's defaults takes every selection field from
``TinyServeConfig()``, and the presets are overrides of it."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from bench import __main__ as cli  # noqa: E402
from bench.cli import PRESETS, config, options_arg  # noqa: E402
from tinyserve_compile.config import TinyServeConfig  # noqa: E402

#: the fields of TinyServeConfig that are not part of the selection rule
NOT_SELECTION = {"dense_layers", "policy", "lower", "kernel", "strict", "dense_by_cost", "decode_linear",
                 "inductor_options", "cudagraphs"}
SELECTION = [f.name for f in dataclasses.fields(TinyServeConfig) if f.name not in NOT_SELECTION]
PRESENT = [c for c, (module, _) in cli.COMMANDS.items() if (ROOT / "bench" / f"{module}.py").exists()]


def test_commands_are_the_documented_ones():
    assert list(cli.COMMANDS) == ["op", "linear", "decode", "onnx", "gpu", "accuracy", "study", "coverage",
                                  "clients", "serve", "serve-http", "paged-op", "ceilings", "report"]
    res = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    for command in cli.COMMANDS:
        assert f"  {command} " in res.stdout


#: prints ``python -m bench <command> --help`` of every command in one fresh interpreter, each after a line
#: "=== <command> <exit code>" (one interpreter, not one per command: each start imports torch, ~4 s on 2 cores)
_ALL_HELP = """
import contextlib, io, sys
from bench import __main__ as cli
for command in cli.COMMANDS:
    out, code = io.StringIO(), 0
    sys.argv = ["python -m bench"]
    with contextlib.redirect_stdout(out):
        try:
            cli.main([command, "--help"])
        except SystemExit as e:
            code = e.code or 0
    print(f"=== {command} {code}")
    print(out.getvalue())
"""


def test_every_command_has_the_shared_flags_in_its_help():
    """``python -m bench <command> --help`` in a fresh interpreter, for every command: --quick, --out, --compare."""
    res = subprocess.run([sys.executable, "-c", _ALL_HELP], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    helps = {}
    for part in res.stdout.split("=== ")[1:]:
        head, _, text = part.partition("\n")
        command, code = head.split()
        helps[command] = (int(code), text)
    assert list(helps) == list(cli.COMMANDS)
    for command, (code, text) in helps.items():
        assert code == 0, (command, text[-2000:])
        assert text.startswith(f"usage: python -m bench {command}"), (command, text[:200])
        for flag in ("--quick", "--out", "--compare"):
            assert flag in text, (command, flag)


@pytest.mark.parametrize("command", ["linear", "ceilings", "report", "serve-http", "clients", "onnx", "coverage"])
def test_compare_where_nothing_varies_is_a_usage_error_naming_it(command, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--compare", "paper"])
    assert e.value.code == 2
    assert "argument --compare:" in capsys.readouterr().err


def test_compare_takes_a_preset_or_json_options_and_names_a_bad_one():
    assert options_arg("paper") == PRESETS["paper"] and options_arg("paper").name == "paper"
    opts = options_arg('{"decode_linear": false}')
    assert opts == {"decode_linear": False} and opts.name == "compare"
    for bad in ('{"no_such_option": 1}', "[1]", "{", '{"page_size": -1}'):
        with pytest.raises(Exception) as e:
            options_arg(bad)
        assert type(e.value).__name__ == "ArgumentTypeError", bad


@pytest.mark.parametrize("command", PRESENT)
def test_help_of_each_command(command, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the dispatcher sets argv[0] for argparse
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench {command}")


def test_a_missing_module_is_named(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(cli.COMMANDS, "later", ("no_such_bench_module", "a module of another branch"))
    with pytest.raises(SystemExit, match=r"python -m bench later: bench/no_such_bench_module\.py is not in this"):
        cli.main(["later", "--help"])


def test_unknown_command(capsys):
    assert cli.main(["speed"]) == 2
    assert "unknown command 'speed'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ defaults
def test_presets_are_overrides_of_the_config():
    for name, overrides in PRESETS.items():
        assert set(overrides) <= {f.name for f in dataclasses.fields(TinyServeConfig)}, name
        assert config(name) == TinyServeConfig(**overrides)


def test_harness_defaults_are_the_config():
    from bench.harness import Sparse

    config_, sparse = TinyServeConfig(), Sparse()
    assert isinstance(sparse, TinyServeConfig)
    assert {f.name: getattr(sparse, f.name) for f in dataclasses.fields(config_)} == dataclasses.asdict(config_)
    assert Sparse(token_budget=512).token_budget == 512


def test_gpu_bench_defaults_are_the_config():
    from bench import gpu as g

    config = TinyServeConfig()
    assert set(g.SETTING_FIELDS.values()) == set(SELECTION) - {"token_budget"}  # the budget is the shape's
    assert {g.SETTING_FIELDS[k]: v for k, v in g.SETTINGS["defaults"].items()} == \
        {name: getattr(config, name) for name in g.SETTING_FIELDS.values()}
    assert g.FULL["budget"] == config.token_budget
    assert list(g.SETTINGS) == ["defaults"]  # --compare adds its variant at run time


def test_op_bench_defaults_are_the_config():
    from bench import op as bench_op

    config = TinyServeConfig()
    assert set(bench_op.SETTING_FIELDS.values()) == set(SELECTION)
    assert {bench_op.SETTING_FIELDS[k]: v for k, v in bench_op.SETTINGS["defaults"].items()} == \
        {name: getattr(config, name) for name in SELECTION}
    assert list(bench_op.SETTINGS) == ["defaults"]  # --compare adds its variant at run time


# ------------------------------------------------------------------------------------------------ ONNX profile
def test_onnx_profile_is_opt_in(tmp_path):
    """ONNX Runtime's profiler runs only with --profile, and writes under the folder given, not the cwd."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("transformers")
    work = tmp_path / "cwd"
    work.mkdir()
    common = ["--model", "tiny", "--contexts", "100", "--budget", "32", "--steps", "1", "--rounds", "1",
              "--warmup", "1", "--providers", "ort-dense", "--export-dir", str(tmp_path / "exports")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = "import json, sys; from bench.onnx_decode import main; print(json.dumps(main(sys.argv[1:])))"
    plain = subprocess.run([sys.executable, "-c", code, *common], capture_output=True, text=True, cwd=work, env=env,
                           timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "profile" not in plain.stdout.splitlines()[-1]
    prof = tmp_path / "prof"
    res = subprocess.run([sys.executable, "-c", code, *common, "--profile", str(prof)], capture_output=True,
                         text=True, cwd=work, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (written,) = prof.iterdir()
    assert written.name.startswith("onnxruntime_profile_ort_dense_100") and written.stat().st_size > 0
    assert str(written) in res.stdout
    assert list(work.iterdir()) == []


# ------------------------------------------------------------------------------------------------ report
def test_report_of_the_stored_study(tmp_path, capsys):
    """``python -m bench report`` on the stored rows of the defaults' study: one window report for the
    tune/heldout pair, the defaults meet every target on the held-out means, and the plots are written."""
    pytest.importorskip("matplotlib")
    import shutil

    from bench import report

    results, img = tmp_path / "results", tmp_path / "img"
    results.mkdir()
    for half in ("tune", "heldout"):
        shutil.copy(ROOT / "docs" / "bench" / f"study_defaults_{half}.json", results)
    assert cli.main(["report", "--out", str(results), "--img", str(img)]) == 0
    text = capsys.readouterr().out
    assert text.count("### Selection study `study_defaults` (several windows per cell)") == 1
    assert (results / "report.md").read_text().strip() == text.strip()
    for half in ("tune", "heldout"):
        for kind in ("frontier", "means"):
            assert (img / f"study_defaults_{half}_{kind}.png").stat().st_size > 0
    rows = report.json.loads((results / "study_defaults_heldout.json").read_text())
    c = TinyServeConfig()
    (checked,) = [t for t in report.targets_check(report.study_summary(rows))
                  if t["variant"] == f"pages {c.page_size}, sink {c.sink_pages}, c={c.candidate_factor} "
                                     f"+{c.candidate_extra}, keep tokens, int8 bounds"]
    assert all(checked["met"].values()), checked


def test_a_list_of_thread_counts_is_left_to_the_command():
    # bench linear times several thread counts (--threads 1 2); parse must not hand the list to set_num_threads
    import torch

    from bench import cli

    ap = cli.parser("linear", "test", threads=False)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    before = torch.get_num_threads()
    assert cli.parse(ap, ["--threads", "1", "2"]).threads == [1, 2]
    assert torch.get_num_threads() == before
    one = cli.parser("op", "test")
    cli.parse(one, ["--threads", "1"])
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


def test_default_waits_sets_the_spin_count_unless_the_environment_chose(monkeypatch):
    from bench import omp_env

    for v in omp_env.WAIT_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    assert omp_env.default_waits() is True and os.environ["GOMP_SPINCOUNT"] == omp_env.GOMP_SPINCOUNT_DEFAULT
    for var, value in (("OMP_WAIT_POLICY", "passive"), ("GOMP_SPINCOUNT", "7")):
        for v in omp_env.WAIT_VARIABLES:
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv(var, value)
        assert omp_env.default_waits() is False
        assert os.environ.get("GOMP_SPINCOUNT") == (value if var == "GOMP_SPINCOUNT" else None)


@pytest.mark.parametrize("env, want", [({}, ("30000", None)), ({"OMP_WAIT_POLICY": "passive"}, (None, "passive"))])
def test_python_m_bench_starts_with_the_default_waits_before_torch(tmp_path, env, want):
    """The spin count reaches libgomp only when it is in the environment before torch loads: ``python -m bench``
    sets it first thing, and its records say what the run had (here: what the decode record carries)."""
    import json

    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = tmp_path / "d.json"
    res = subprocess.run([sys.executable, "-m", "bench", "decode", "--model", "tiny", "--contexts", "64", "--batches",
                          "1", "--providers", "eager", "--steps", "1", "--rounds", "1", "--warmup", "1", "--no-profile",
                          "--prefill-cache", str(tmp_path / "snap"), "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env={**base, **env})
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert (row["gomp_spincount"], row["omp_wait_policy"]) == want
