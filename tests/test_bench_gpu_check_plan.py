"""bench/gpu_check.sh's honest anchors, on the CPU: the step limits add up to less than 8 minutes with margin for
the kernel step, a dry run writes to a scratch folder (never docs/gpu), and the check adapts to the card (an H100
or an H200: its datasheet peak, and decode points that fit in its memory), which a dry run can pretend to be."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
needs_shell = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="bash + timeout")


def limits() -> dict:
    """The script's step limits: ``LIMIT_<NAME>=<seconds>`` lines."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^LIMIT_([A-Z0-9_]+)=(\d+)$", SCRIPT.read_text(), re.M)}


def test_step_limits_fit_in_eight_minutes_with_room_for_the_kernel_step():
    lim = limits()
    assert set(lim) == {"ENV", "KERNEL", "SMOL", "8B", "SUMMARY"}
    assert sum(lim.values()) < 480, lim  # the whole check, the summary's limit included
    assert lim["KERNEL"] >= 150  # the last H200 run took 84 s for a step limited to 70 s (cold caches)
    text = SCRIPT.read_text()
    # every step runs under its variable, none under a number written elsewhere
    runs = re.findall(r'^run (\w+) "\$LIMIT_(\w+)"', text, re.M)
    assert runs == [("env", "ENV"), ("kernel", "KERNEL"), ("decode_smollm", "SMOL"), ("decode_8b", "8B")]
    assert not re.search(r"^run \w+ \d", text, re.M)
    assert '--limit "$LIMIT_SUMMARY"' in text and "LIMIT_SUMMARY * ${TIMEOUT_SCALE:-1}" in text
    # docs/gpu/README.md's table of steps says the same
    doc = (ROOT / "docs" / "gpu" / "README.md").read_text()
    table = dict(re.findall(r"^\| `?(env|kernel|decode_smollm|decode_8b|summary)`? \| (\d+) \|", doc, re.M))
    assert {k: int(v) for k, v in table.items()} == {"env": lim["ENV"], "kernel": lim["KERNEL"],
                                                     "decode_smollm": lim["SMOL"], "decode_8b": lim["8B"],
                                                     "summary": lim["SUMMARY"]}
    assert f"add up to {sum(lim.values())}" in doc


def test_points_by_memory():
    """Llama-3-8B's shape whole (32 layers) at 128K batch 4 does not fit in 80% of an H100's 80 GB: it runs at batch
    2 there; an H200 runs it as it is; the check's 8 layers fit on both."""
    h100, h200 = 80e9, 141e9
    assert gpu_check.plan_points("decode_8b", h200, None) == ([(32768, 8), (131072, 4)], [])
    pts, notes = gpu_check.plan_points("decode_8b", h100, None)
    assert pts == [(32768, 8), (131072, 2)] and len(notes) == 1 and "run at 131072x2" in notes[0]
    assert gpu_check.plan_points("decode_8b", h100, 8) == ([(32768, 8), (131072, 4)], [])
    assert gpu_check.plan_points("decode_smollm", h100, None)[0] == [(8192, 1), (32768, 1)]
    assert gpu_check.plan_points("decode_8b", None, None)[0] == [(32768, 8), (131072, 4)]  # memory unknown
    pts, notes = gpu_check.plan_points("decode_8b", 8e9, None)  # not even batch 1 fits
    assert pts == [] and all("left out" in n for n in notes)
    # the estimate: the 32-layer model's bf16 weights alone are about 16 GB, each 128K x B4 cache about 69 GB
    from bench.models import SHAPES

    assert 90e9 < gpu_check.decode_bytes(SHAPES["llama3-8b"], None, 131072, 4) < 100e9


@pytest.mark.parametrize("name,card,peak,memory_gb", [(H100, "H100", 3350, 80), (H200, "H200", 4800, 141)])
def test_env_pretends_a_card_in_a_dry_run(tmp_path, capsys, name, card, peak, memory_gb):
    assert gpu_check.env(str(tmp_path), dry_run=True, device_name=name, layers_8b=None) == 0
    info = json.loads((tmp_path / "env.json").read_text())
    assert (info["device"], info["card"], info["datasheet_gbs"], info["pretend"]) == (name, card, peak, True)
    assert info["plan"]["memory_gb"] == memory_gb
    # a dry run runs its tiny points; the plan says what the card would run (the whole 8B model: 32 layers)
    assert info["plan"]["points"] == {k: [list(p) for p in v] for k, v in gpu_check.DRY_POINTS.items()}
    big = [tuple(p) for p in info["plan"]["gpu_points"]["decode_8b"]]
    assert big == ([(32768, 8), (131072, 2)] if card == "H100" else [(32768, 8), (131072, 4)])
    out = capsys.readouterr().out
    assert f"card: {card} ({name}, pretended): datasheet {peak} GB/s" in out
    # plan.env, as the script sources it
    res = subprocess.run(["bash", "-c", f'. "{tmp_path}/plan.env" && echo "$CARD|$PEAK_GBS|$DEVICE|$BIG_POINTS"'],
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == f"{card}|{peak}|{name}|256x2 512x2"


def test_device_name_only_in_a_dry_run(tmp_path):
    with pytest.raises(ValueError, match="dry run only"):
        gpu_check.env(str(tmp_path), dry_run=False, device_name=H100)
    with pytest.raises(SystemExit):
        gpu_check.main(["env", "--out", str(tmp_path), "--device-name", H100])


def test_a_target_says_its_point_ran_at_a_smaller_batch():
    rows = [dict(provider=p, context=131072, batch=2, vs_best_stock=v, best_stock="inductor-cudagraphs")
            for p, v in (("inductor-cudagraphs", 1.0), ("tinyserve-cudagraphs", 3.5))]
    rows = [dict(provider="eager", context=32768, batch=8, vs_best_stock=1.0, best_stock="eager")] + rows
    t = gpu_check.decode_targets("decode_8b", rows, dry_run=False)
    assert t[0]["met"] is None  # no tinyserve row at 32K
    assert t[1]["met"] is True and (t[1]["context"], t[1]["batch"]) == (131072, 2)
    assert "128K B4" in t[1]["target"] and "(run at 131072 x B2: the device's memory)" in t[1]["target"]


def _run(args, env, timeout=600):
    env = dict({k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_STEPS")}, PYTHON=sys.executable,
               TIMEOUT_SCALE="4", **env)
    return subprocess.run(["bash", str(SCRIPT)] + args, capture_output=True, text=True, env=env, timeout=timeout)


@needs_shell
def test_dry_run_writes_to_a_scratch_folder_never_docs_gpu(tmp_path):
    docs = ROOT / "docs" / "gpu"
    written = ("env.json", "plan.env", "steps.tsv", "summary.json", "env.log")  # what the steps run here write
    before = {name: (docs / name).stat().st_mtime_ns for name in written if (docs / name).exists()}
    env = {"GPU_CHECK_STEPS": "none", "TMPDIR": str(tmp_path)}
    res = _run(["--dry-run", "--device-name", H100], env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    m = re.search(r"^gpu_check: dry run, output in (\S+)$", res.stdout, re.M)
    assert m and Path(m[1]).parent == tmp_path and (Path(m[1]) / "summary.json").exists()
    assert f"=== card: H100 ({H100}), datasheet 3350 GB/s, 80 GB" in res.stdout
    assert json.loads((Path(m[1]) / "env.json").read_text())["card"] == "H100"
    # OUT pointing into docs/gpu: refused before anything is written
    for out in (str(docs), str(docs / "dry")):
        res = _run(["--dry-run"], dict(env, OUT=out))
        assert res.returncode == 2 and "never writes over the committed results" in res.stdout
    assert not (docs / "dry").exists()
    assert {name: (docs / name).stat().st_mtime_ns for name in written if (docs / name).exists()} == before
    res = _run(["--device-name", H100], dict(env, OUT=str(tmp_path / "x")))
    assert res.returncode == 2 and "dry run only" in res.stdout


@needs_shell
def test_dry_run_kernel_step_quotes_the_pretended_cards_peak(tmp_path):
    """The kernel step gets the card's datasheet peak (--peak-gbs): an H100's 3350 GB/s in its JSON and summary."""
    res = _run(["--dry-run", "--device-name", H100], {"GPU_CHECK_STEPS": "kernel", "OUT": str(tmp_path)}, 900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [x["step"] for x in s["steps"]] == ["env", "kernel"]
    assert s["kernel_peak"]["datasheet_gbs"] == 3350 and s["env"]["card"] == "H100"
    assert all(r["sdpa_flash_gqa"] == "enable_gqa" for r in s["kernel_bench"])  # the anchor reads K/V once
    assert "==== gpu_check summary: NVIDIA H100 80GB HBM3" in res.stdout
