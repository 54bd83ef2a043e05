"""The hardware's pinned versions, checked on this CPU: launch/compat_check.sh runs this.

CI installs one torch and one transformers (requirements.txt: 2.13 + 5.24); the hardware runs
others (NPU: torch 2.10 + transformers 5.5.4; GPU: torch 2.11 + transformers 5.24; the device
image: torch 2.11 + transformers 5.17). A call that one of those releases lacks (a keyword
argument, a function) passes CI and stops the first hardware run. So for each pin set this
builds a venv once (cached under $COMPAT_DIR, default ~/.cache/grpo-compat; a changed pin list
builds a new one), runs the fast test tier and a 5-step 3-rank torchrun demo (HF engine) in it,
and prints one JSON line:

    {"pins": "gpu", "torch": "2.11.0", "transformers": "5.24.0", "fast_tier": "703 passed",
     "demo_lpdiff_max": 1.4e-06, "ok": true, ...}

The exit code is non-zero when any pin set is not ok; its line names what failed (the failing
tests, or the demo's last error line). The PyPI torch builds of 2.10 / 2.11 are CUDA builds:
they run on this CPU once their own (CUDA library) dependencies are installed, several GB each,
downloaded once into uv's cache under $COMPAT_DIR, which the venvs share (hard links).

    bash launch/compat_check.sh                 # every pin set
    bash launch/compat_check.sh npu             # one
    bash launch/compat_check.sh --dry-run       # the pins and commands, nothing built or run
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Packages of a hardware requirements file that are not installed in its pin set: the engines
# (no vLLM build for this CPU at those pins), torchvision / torchaudio (vLLM's; torchvision would
# change transformers' image processor), accelerator-only or CUDA-compiled packages (fla: Triton
# kernels transformers would pick for linear-attention layers on this CPU too), and the
# hub-dataset reader the tests never use.
EXCLUDED = {"vllm", "vllm-ascend", "torch-npu", "torchvision", "torchaudio", "triton-ascend",
            "datasets", "flash-linear-attention", "fla-core", "einops", "causal-conv1d"}

# The device image's versions (the device tool's KINDS.md, its pip list of 2026-11): the GPU pin
# file's set with these in place.
DEVICE_IMAGE = {"torch": "2.11.0", "transformers": "5.17.0", "huggingface-hub": "1.33.0",
                "tokenizers": "0.23.2", "accelerate": "1.15.0", "safetensors": "0.8.0"}

PIN_SETS = ("gpu", "npu", "device")
DEMO_STEPS = 5
LPDIFF_BOUND = 1e-5  # fp32 on CPU: the engine's and the trainer's logprobs of the same token


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements file (comments, index lines dropped), by the
    normalised name."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            pins[norm(m.group(1))] = m.group(2)
    return pins


def pin_set(name: str, root: Path = ROOT) -> dict[str, str]:
    """The packages of pin set `name`: requirements.txt (the tests' own packages: pytest,
    trackers, ...) with the hardware file's pins in place, less EXCLUDED."""
    pins = read_pins(root / "requirements.txt")
    if name in ("gpu", "device"):
        pins.update(read_pins(root / "requirements-gpu.txt"))
    elif name == "npu":
        pins.update(read_pins(root / "requirements-npu.txt"))
    else:
        raise SystemExit(f"compat: unknown pin set {name!r} (one of {', '.join(PIN_SETS)})")
    if name == "device":
        pins.update(DEVICE_IMAGE)
    return {k: v for k, v in sorted(pins.items()) if k not in EXCLUDED}


def venv_dir(name: str, pins: dict[str, str], base: Path) -> Path:
    """One folder per pin list: a changed pin builds a new venv beside the old one."""
    digest = hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:10]
    return base / f"{name}-{digest}"


UV = "uv==0.13.9"  # installs each venv: parallel downloads, files hard-linked from one cache


def uv(base: Path, log) -> list[str]:
    """The uv command (installed once under `base` with pip), its cache under `base` too: the
    venvs share one copy of each wheel's files (two pin sets share torch 2.11's CUDA libraries,
    about 4 GB), so a second venv costs seconds."""
    home = base / UV.replace("==", "-")
    if not (home / "bin" / "uv").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--target", str(home), UV], check=True, stdout=log, stderr=subprocess.STDOUT)
    return [str(home / "bin" / "uv"), "--cache-dir", str(base / "uv-cache")]


def build(name: str, pins: dict[str, str], venv: Path, base: Path, log) -> None:
    """Create the venv once: built under a temporary name, renamed when complete (an
    interrupted build never passes for a finished one)."""
    if (venv / "bin" / "python").exists():
        return
    tmp = venv.with_name(venv.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    cmd = uv(base, log)
    run = dict(check=True, stdout=log, stderr=subprocess.STDOUT)
    subprocess.run([*cmd, "venv", "-q", "-p", sys.executable, str(tmp)], **run)
    reqs = tmp / "pins.txt"
    reqs.write_text("".join(f"{k}=={v}\n" for k, v in pins.items()))
    subprocess.run([*cmd, "pip", "install", "-q", "--python", str(tmp / "bin" / "python"),
                    "-r", str(reqs)], **run)
    tmp.rename(venv)
    print(f"compat: {name}: venv built in {time.monotonic() - t:.0f} s ({venv})",
          file=sys.stderr, flush=True)


def versions(python: Path) -> dict:
    code = ("import json, torch, transformers; print(json.dumps({'torch': torch.__version__, "
            "'transformers': transformers.__version__}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if out.returncode:
        return {"import_error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(pytest_out: str) -> tuple[str, list[str]]:
    """pytest's closing counts ("703 passed, 2 skipped") and the failing tests' ids."""
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", pytest_out, re.M)
    counts = ""
    for line in reversed(pytest_out.strip().splitlines()):
        if re.search(r"\d+ (passed|failed|error)", line):
            counts = re.sub(r"\s+in [\d.]+s.*$", "", line.strip("= ").strip())
            break
    return counts or "no summary", failed


def env_for(name: str, base: Path) -> dict:
    """The tests' environment: the venv's packages only (no PYTHONPATH shim), and on PATH a
    `python` / `python3` that fails, so a test that starts a bare `python` (another interpreter
    than the venv's, which is never activated) fails here instead of passing on the outer one."""
    trap = base / "no-bare-python"
    trap.mkdir(parents=True, exist_ok=True)
    for exe in ("python", "python3"):
        f = trap / exe
        f.write_text("#!/bin/sh\necho \"compat: a bare '$0' was started (PATH); tests start "
                     "sys.executable\" >&2\nexit 97\n")
        f.chmod(0o755)
    env = dict(os.environ, OMP_NUM_THREADS="1", GRPO_COMPAT_PINS=name, PYTHONDONTWRITEBYTECODE="1",
               PATH=f"{trap}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    return env


def fast_tier(name: str, python: Path, base: Path, log) -> dict:
    t = time.monotonic()
    out = subprocess.run([str(python), "-m", "pytest", "-q", "-m", "not slow", "-p",
                          "no:cacheprovider", "tests"], cwd=ROOT, env=env_for(name, base),
                         capture_output=True, text=True)
    log.write(out.stdout + out.stderr)
    counts, failed = summary(out.stdout)
    return {"fast_tier": counts, "fast_tier_s": round(time.monotonic() - t, 1),
            "fast_tier_ok": out.returncode == 0, "failed_tests": failed}


def demo_lpdiff(metrics: Path) -> float | None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    vals = [r["logprob_diff/max"] for r in rows if "logprob_diff/max" in r]
    return max(vals) if len(vals) == DEMO_STEPS else None


def demo(name: str, python: Path, base: Path, log) -> dict:
    """The CPU demo's real 3-rank split (2 trainers, 1 HF engine) for DEMO_STEPS steps."""
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"compat-{name}-") as out_dir:
        cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "3", "train.py", "--config", "configs/tiny.toml", f"--run.steps={DEMO_STEPS}",
               f"--run.out_dir={out_dir}"]
        out = subprocess.run(cmd, cwd=ROOT, env=env_for(name, base), capture_output=True, text=True,
                             timeout=600)
        log.write(out.stdout + out.stderr)
        metrics = Path(out_dir) / "metrics.jsonl"
        lpdiff = demo_lpdiff(metrics) if metrics.exists() else None
    res = {"demo_lpdiff_max": lpdiff, "demo_s": round(time.monotonic() - t, 1),
           "demo_ok": out.returncode == 0 and lpdiff is not None and lpdiff <= LPDIFF_BOUND}
    if not res["demo_ok"]:
        # the project's own culprit line ("error: rank 0 (trainer) failed ..."), else an error
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error: rank")] or [
            ln for ln in out.stderr.splitlines() if re.search(r"\w+Error\b", ln)]
        res["demo_error"] = (lines or [f"exit {out.returncode}, logprob_diff/max {lpdiff}"])[0][:400]
    return res


def check(name: str, base: Path) -> dict:
    pins = pin_set(name)
    venv = venv_dir(name, pins, base)
    row = {"pins": name}
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{name}.log", "w") as log:
        try:
            build(name, pins, venv, base, log)
        except subprocess.CalledProcessError as e:
            return {**row, "ok": False, "error": f"venv build failed ({e}); see {log.name}"}
        python = venv / "bin" / "python"
        row.update(versions(python))
        if "import_error" in row:
            return {**row, "ok": False}
        row.update(fast_tier(name, python, base, log))
        row.update(demo(name, python, base, log))
    fast_ok, demo_ok = row.pop("fast_tier_ok"), row.pop("demo_ok")
    row["ok"] = fast_ok and demo_ok
    row["log"] = str(base / f"{name}.log")
    return row


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    names = [a for a in argv if a != "--dry-run"] or list(PIN_SETS)
    base = Path(os.environ.get("COMPAT_DIR", Path.home() / ".cache" / "grpo-compat"))
    bad = []
    for name in names:
        if dry:
            pins = pin_set(name)
            print(json.dumps({"pins": name, "venv": str(venv_dir(name, pins, base)),
                              "built": venv_dir(name, pins, base).exists(),
                              "packages": [f"{k}=={v}" for k, v in pins.items()]}))
            continue
        row = check(name, base)
        print(json.dumps(row), flush=True)
        if not row["ok"]:
            bad.append(name)
    if bad:
        print(f"compat: NOT ok under pin set(s) {', '.join(bad)} (see each line above)",
              file=sys.stderr)
    if not dry:  # the plain closing count, one per pin set
        print(f"compat: {len(names) - len(bad)} passed, {len(bad)} failed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
