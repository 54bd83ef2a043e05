"""The shape of the code: imports between the project's modules run one way (no circles)."""
from __future__ import annotations

import ast
import re

from tests.util import ROOT


def _imports() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file (top level or inside a
    function: a lazy import closes a circle as surely as a top-level one)."""
    files = sorted(ROOT.glob("*.py")) + sorted((ROOT / "rewards").glob("*.py"))

    def name(p) -> str:
        if p.parent.name == "rewards":
            return "rewards" if p.stem == "__init__" else f"rewards.{p.stem}"
        return p.stem

    names = {name(p) for p in files}
    graph = {}
    for p in files:
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps.add(f"rewards.{node.module}" if node.level == 1 else node.module)
        graph[name(p)] = {d for d in deps if d in names and d != name(p)}
    return graph


def test_imports_run_one_way():
    graph = _imports()
    assert "synthetic" in graph["data"] and "config" in graph["tracking"]   # the graph is read
    cycles, state = [], {}

    def visit(u: str, path: list[str]) -> None:
        state[u] = "open"
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = "done"

    for u in sorted(graph):
        if u not in state:
            visit(u, [u])
    assert not cycles, cycles


def test_the_moved_names_are_still_where_callers_look():
    import config
    import data
    import synthetic
    assert data.Problem is synthetic.Problem and data.SPLITS == synthetic.SPLITS
    assert config.TRACKERS == ("tensorboard", "wandb", "swanlab")


FAMILY_WORDS = re.compile(r"qwen[0-9_]|Qwen[0-9]|<\|im_|<\|vision|<\|endoftext|<\|image_pad|<\|video_pad")


def test_no_family_name_or_special_token_outside_families_py():
    """A family's model_type or name and the chat / vision special tokens are written once, in
    families.py (the table); the rest of the core asks the config or the table."""
    files = [p for p in sorted(ROOT.glob("*.py")) + sorted((ROOT / "rewards").glob("*.py"))
             + sorted((ROOT / "launch").glob("*.py")) if p.name != "families.py"]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if FAMILY_WORDS.search(line)]
    assert not hits, "\n".join(hits)


def test_rooms_are_small():
    """Every core module (top-level *.py, rewards/) at most 600 lines; every function in it
    (nested ones too) at most 60 lines of code, from its first statement after the docstring to
    its end, and at most 10 parameters (self / cls aside)."""
    big = []
    for p in sorted(ROOT.glob("*.py")) + sorted((ROOT / "rewards").glob("*.py")):
        name, text = p.relative_to(ROOT).as_posix(), p.read_text()
        if len(text.splitlines()) > 600:
            big.append(f"{name}: {len(text.splitlines())} lines")
        for f in ast.walk(ast.parse(text)):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = f.body[1:] if len(f.body) > 1 and ast.get_docstring(f) is not None else f.body
            a = f.args
            params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]
            n_params = len(params) - (params[:1] in (["self"], ["cls"]))
            if f.end_lineno - body[0].lineno + 1 > 60:
                big.append(f"{name}:{f.name}: {f.end_lineno - body[0].lineno + 1} lines")
            if n_params > 10:
                big.append(f"{name}:{f.name}: {n_params} parameters")
    assert not big, "\n".join(big)


def _engine_protocol() -> set[str]:
    """Every member the engine protocols of episode.py declare (Engine, LocalEngine, AheadEngine)."""
    tree = ast.parse((ROOT / "episode.py").read_text())
    names = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Engine")):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
    return names


ENGINE_ROOMS = ("episode.py", "hf_engine.py", "vllm_engine.py", "vllm_ahead.py", "vllm_worker.py")


def _is_engine(node) -> bool:
    """An expression that names an engine: `engine`, `eng`, `x.engine`."""
    return ((isinstance(node, ast.Name) and node.id in ("engine", "eng"))
            or (isinstance(node, ast.Attribute) and node.attr == "engine"))


def test_no_engine_member_is_used_outside_the_engines_and_their_protocol():
    """Outside the engines' own modules an engine is used only through what episode.py's
    protocols declare, and nothing is set on it (no hook attributes, no proxies)."""
    declared = _engine_protocol()
    assert {"generate", "receive_weights", "weight_version", "receive_ahead", "load_weights"} <= declared
    bad = []
    for p in sorted(ROOT.glob("*.py")):
        if p.name in ENGINE_ROOMS:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and _is_engine(node.value):
                if not isinstance(node.ctx, ast.Load) or node.attr not in declared:
                    bad.append(f"{p.name}:{node.lineno}: engine.{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and node.args
                  and _is_engine(node.args[0])):
                bad.append(f"{p.name}:{node.lineno}: {node.func.id}(engine, ...)")
    assert not bad, "\n".join(bad)


def test_the_generation_rooms_import_little():
    """episode.py (records and the engine contract) is a leaf; rollout.py imports at most six
    project modules; the engine twins keep their contract in episode.py."""
    graph = _imports()
    assert graph["episode"] == set(), graph["episode"]
    assert len(graph["rollout"]) <= 6, sorted(graph["rollout"])
    assert "rollout" not in graph["hf_engine"] | graph["vllm_engine"] | graph["vllm_worker"]
