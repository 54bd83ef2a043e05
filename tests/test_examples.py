"""Every example command in README.md, in docs/*.md and in the launch scripts' comments passes
`--dry-run`; the README stays a short page that links every docs page, and the links resolve.

Commands are found, not listed here: README and docs/*.md lines (code blocks and inline `code`)
that start with `torchrun`, `python train.py`, `bash launch/...`, optionally after VAR=value
assignments, and the same in the comment lines of launch/*.sh. A launch script runs for real
with DRY_RUN=1 and a stand-in interpreter that records the train.py arguments and the environment
it would get; the arguments then go through train.main(... --dry-run) in this process (the
config, the device-aware checks and the rank plan), so a documented layout that does not divide
(e.g. 128 episodes over 3 trainers) fails here. The slow test runs each script's dry run with
the real interpreter.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

import train
from tests.util import ROOT

START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:torchrun\s+-|python3?\s+train\.py\b|bash\s+launch/"
                   r"(?!install_cpu\.sh|compat_check\.sh|vlmeval\.sh|npu_preflight\.sh)\S+\.sh\b)")  # these launch no training
# (launch/vlmeval.sh's documented examples: tests/test_vlmeval.py; npu_preflight.sh's: tests/test_preflight.py)


def _joined(lines: list[str]) -> list[str]:
    out, cur = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    return out


DOCS = sorted((ROOT / "docs").glob("*.md"))


def doc_commands(path=None) -> list[str]:
    """The commands of one page, or of README.md and every docs/*.md page."""
    found = []
    for page in [path] if path else [ROOT / "README.md", *DOCS]:
        for line in _joined(page.read_text().splitlines()):
            s = line.strip().removeprefix("$ ")
            if START.match(s):
                found.append(s)
            found += [m for m in re.findall(r"`([^`]+)`", line) if START.match(m.strip())]
    return found


def script_commands() -> list[str]:
    found = []
    for path in sorted((ROOT / "launch").glob("*.sh")):
        comments = [ln.strip().lstrip("#").strip() for ln in path.read_text().splitlines()
                    if ln.strip().startswith("#")]
        for c in _joined(comments):
            # "node 0 (trainers):  MASTER_ADDR=... bash launch/multinode.sh": drop the label
            c = re.sub(r"^[\w ()]+:\s+(?=[A-Z_]+=|bash |torchrun |python)", "", c)
            if START.match(c):
                found.append(c)
    return found


COMMANDS = sorted(set(doc_commands() + script_commands()))


def test_the_commands_are_found():
    """The extraction sees the documented examples (a regex that matched nothing would pass)."""
    have = " | ".join(COMMANDS)
    for needle in ("torchrun --standalone --nproc_per_node 3 train.py --config configs/tiny.toml",
                   "NPROC_PER_NODE=4 GEN_RANKS=2 bash launch/gpu_1node.sh",
                   "NPROC_PER_NODE=16 GEN_RANKS=8 bash launch/npu_1node.sh",
                   "NODE_RANK=1 bash launch/multinode.sh", "bash launch/cpu_demo.sh --run.steps=5",
                   "GRPO_DEVICE=cuda python train.py --config configs/vl3b.toml --dry-run",
                   "configs/tiny.toml --model.lora_rank=8 --run.out_dir=runs/tiny_lora"):
        assert needle in have, needle
    assert len(COMMANDS) >= 15, COMMANDS
    assert DOCS and doc_commands(ROOT / "docs" / "gpu-npu.md"), "docs/*.md are read too"


def _split(cmd: str) -> tuple[dict, list[str]]:
    """(environment assignments, argv) of one shell command line; `# ...` is a comment."""
    words = shlex.split(cmd, comments=True)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    return env, words


def _torchrun_args(words: list[str]) -> list[str]:
    """The train.py arguments of a torchrun line, plus the launched layout for the plan."""
    opts, i = {}, 1
    while i < len(words) and not words[i].endswith(".py"):
        key, eq, val = words[i].partition("=")
        if key in ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port",
                   "--rdzv_backend", "--rdzv_conf", "--rdzv_endpoint"):
            if not eq:
                i += 1
                val = words[i]
            opts[key] = val
        i += 1
    assert i < len(words) and words[i].endswith("train.py"), words
    return [*words[i + 1:], f"--cluster.nnodes={opts.get('--nnodes', '1')}",
            f"--cluster.nproc_per_node={opts.get('--nproc_per_node', '1')}"]


def _script_args(env: dict, words: list[str], tmp_path) -> tuple[dict, list[str]]:
    """Run the launch script with DRY_RUN=1 and a stand-in interpreter; returns the environment
    and train.py arguments it would have run the dry run with."""
    rec = tmp_path / "argv"
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {rec}\nenv -0 > {rec}.env\n")
    fake.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k not in ("GRPO_DEVICE",)}
    e.update(env, DRY_RUN="1", PYTHON=str(fake), HOME=str(tmp_path))  # npu_env.sh: cache dir
    p = subprocess.run(["bash", *words[1:]], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    argv = rec.read_text().split("\0")[:-1]
    assert argv[0] == str(ROOT / "train.py") and argv[-1] == "--dry-run", argv
    got = dict(kv.split("=", 1) for kv in (rec.with_suffix(".env")).read_text().split("\0") if "=" in kv)
    return got, argv[1:]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_example_passes_dry_run(cmd, tmp_path, monkeypatch, capsys):
    env, words = _split(cmd)
    monkeypatch.chdir(ROOT)
    if words[0] == "bash":
        script_env, args = _script_args(env, words, tmp_path)
        env = {k: v for k, v in script_env.items() if k.startswith(("GRPO_", "HCCL_", "VLLM_"))}
    elif words[0] == "torchrun":
        args = _torchrun_args(words)
    else:  # python train.py: a world of one, unless the command is itself a dry run
        args = words[2:]
        if "--dry-run" not in args:
            args += ["--cluster.nnodes=1", "--cluster.nproc_per_node=1"]
    monkeypatch.setenv("GRPO_DEVICE", "cpu")  # what a command without it runs on here
    for k in [k for k in os.environ if k.startswith("HCCL_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = train.main([*args, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, f"{cmd}\n{err}"
    if "--help" not in args:
        assert '"groups"' in out, out[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "launch").glob("*_*.sh")
                                          if p.name not in ("npu_env.sh", "install_cpu.sh",
                                                            "compat_check.sh",  # test_compat.py
                                                            "npu_preflight.sh"))  # test_preflight.py
                         + ["multinode.sh"])
def test_launch_script_dry_run_for_real(script, tmp_path):
    """DRY_RUN=1 runs train.py --dry-run with the real interpreter: the plan comes out."""
    e = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, HOME=str(tmp_path),
             MASTER_ADDR="10.0.0.1", NODE_RANK="0")
    e.pop("GRPO_DEVICE", None)
    p = subprocess.run(["bash", str(ROOT / "launch" / script)], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert '"groups"' in p.stdout and "torchrun" not in p.stderr


@pytest.mark.slow
def test_multinode_node_1_says_what_it_waits_for_and_gives_up_at_the_timeout(tmp_path):
    """Node 1 with nothing at MASTER_ADDR:MASTER_PORT: one line says what it waits for and for
    how long, and torchrun gives up after RDZV_TIMEOUT (it used to print nothing for minutes)."""
    import time
    from tests.util import free_port
    port = free_port()
    e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="1",
             NPROC_PER_NODE="1", RDZV_TIMEOUT="3", GRPO_DEVICE="cpu", OMP_NUM_THREADS="1",
             CONFIG=str(ROOT / "configs" / "tiny.toml"), HOME=str(tmp_path), PYTHON=sys.executable)
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(ROOT / "launch" / "multinode.sh")], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and time.monotonic() - t0 < 60
    assert p.stderr.splitlines()[0] == (f"multinode.sh: node 1 of 2 joins the rendezvous at "
                                        f"127.0.0.1:{port} (node 0); waiting up to 3 s "
                                        "(RDZV_TIMEOUT) for it to answer"), p.stderr[:2000]
    assert f"timed out after 3000ms while trying to connect to (127.0.0.1, {port})" in p.stderr


def test_installer_says_each_stage_and_its_time(tmp_path):
    """launch/install_cpu.sh with a stand-in interpreter (pip does nothing; nothing is installed):
    one line as each stage starts, one with its time as it ends, in order; the vLLM stages run
    against a stand-in build folder."""
    vllm = tmp_path / "vllm-cpu"
    (vllm / "shim").mkdir(parents=True)
    (vllm / "requirements.txt").write_text("")
    (vllm / "vllm-0.23.0+cpu-x.whl").write_text("")
    site = tmp_path / "site"
    site.mkdir()
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f'echo "$*" >> {tmp_path / "calls"}\n'
                    f'case "$*" in *sysconfig*) echo {site};; *"import vllm"*) '
                    'echo "install: vllm 0.23.0";; esac\n')
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(ROOT / "launch" / "install_cpu.sh")], env=dict(
        os.environ, PYTHON=str(fake), VLLM_CPU_DIR=str(vllm)), capture_output=True, text=True,
        timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    starts = [ln for ln in lines if ln.endswith(" ...")]
    ends = [ln for ln in lines if re.search(r" done \(\d+ s\)$", ln)]
    assert len(starts) == 6 and len(ends) == 6 + 1                 # six stages, and "all done"
    assert all(e.startswith(s[:-4]) for s, e in zip(starts, ends))
    assert lines[-1].startswith("install: all done (")
    assert (site / "grpo_vllm_cpu_shim.pth").read_text().strip() == str(vllm / "shim")
    assert "-m pip install -q torch==2.13.0" in (tmp_path / "calls").read_text()


README_MAX_LINES = 450  # a newcomer's page; the reference material is in docs/


def test_readme_is_short_and_links_every_docs_page():
    """The README is a newcomer's page: at most README_MAX_LINES lines, and a link to each page of
    docs/ (where the reference material went), so none is orphaned."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", text))
    assert len(DOCS) >= 5
    for page in DOCS:
        assert f"docs/{page.name}" in linked, f"README.md does not link docs/{page.name}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_links_between_pages_resolve(page):
    """Every relative link of the README and the docs pages names a file that exists, and an
    `#anchor` a heading of that file (a section moved to docs/ leaves no dead `(#...)` link)."""
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{page.name}: ({target}): no such file"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: ({target}): no such heading there"
