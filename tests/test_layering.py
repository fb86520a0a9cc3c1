"""One import direction: server -> engine -> models -> layers -> kernels -> common (tools sits on models, the
offline llm.py beside the server). Every module under lightllm/ is ast-parsed, imports inside functions included."""

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

import lightllm

ROOT = Path(lightllm.__file__).parent
# Floor of each top-level package (llm is lightllm/llm.py); a module imports its own package and lower floors only.
FLOORS = {"common": 0, "kernels": 1, "layers": 2, "models": 3, "tools": 4, "engine": 5, "llm": 6, "server": 6}
# What code above models/ may import from it: the registry and the family-neutral parts, never a family's folder.
MODELS_API = ("lightllm.models.registry", "lightllm.models.hf_config", "lightllm.models.family")
AUTOTUNER_MAY_IMPORT = ("lightllm.common.autotuner", "lightllm.common.envs")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(name: str, source: str, is_package: bool = False) -> Iterator[str]:
    """Every ``lightllm`` module (or module attribute) that ``source`` imports, relative imports resolved."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            yield from (f"{base}.{a.name}" for a in node.names)


def _within(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def violations(name: str, source: str, is_package: bool = False) -> List[Tuple[str, str]]:
    """(module, imported) pairs that break the direction rules."""
    parts = name.split(".")
    if len(parts) < 2:  # lightllm/__init__.py: the lazy public facade over everything
        return []
    own, bad = parts[1], []
    if own not in FLOORS:
        return [(name, f"nothing: give package {own!r} a floor in FLOORS")]
    for target in imports(name, source, is_package):
        t = target.split(".")
        if t[0] != "lightllm":
            continue
        if _within(name, ["lightllm.common.autotuner"]):
            if not _within(target, AUTOTUNER_MAY_IMPORT):
                bad.append((name, target))
        elif len(t) < 2 or t[1] not in FLOORS or t[1] == own:  # `import lightllm`, the same package
            continue
        elif FLOORS[t[1]] >= FLOORS[own]:
            bad.append((name, target))
        elif t[1] == "models" and own != "tools" and not _within(target, MODELS_API):
            bad.append((name, target))
    return bad


def tree_violations() -> List[Tuple[str, str]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += violations(module_name(path), path.read_text(encoding="utf-8"), path.name == "__init__.py")
    return found


def test_every_module_imports_only_downward():
    unexpected = tree_violations()
    assert not unexpected, "imports against server -> engine -> models -> layers -> kernels -> common:\n" + "\n".join(
        f"  {m} imports {t}" for m, t in unexpected
    )


def test_the_checker_catches_each_rule():
    assert violations("lightllm.models.qwen3.model", "from lightllm.engine.attention import X") == [
        ("lightllm.models.qwen3.model", "lightllm.engine.attention.X")
    ]
    assert violations("lightllm.layers.attention", "def f():\n    import lightllm.models.registry") == [
        ("lightllm.layers.attention", "lightllm.models.registry")
    ]
    assert violations("lightllm.engine.model_runner", "from lightllm.models.qwen3.model import Qwen3Model") == [
        ("lightllm.engine.model_runner", "lightllm.models.qwen3.model.Qwen3Model")
    ]
    assert violations("lightllm.llm", "from lightllm.server.scheduler import Scheduler") == [
        ("lightllm.llm", "lightllm.server.scheduler.Scheduler")
    ]
    assert violations("lightllm.common.autotuner.tuner", "from lightllm.common.kv_cache import KVPool") == [
        ("lightllm.common.autotuner.tuner", "lightllm.common.kv_cache.KVPool")
    ]
    assert violations("lightllm.layers.attention", "from ..engine import infer_state") == [
        ("lightllm.layers.attention", "lightllm.engine.infer_state")
    ]
    assert violations("lightllm.models", "from ..server import args", is_package=True) == [
        ("lightllm.models", "lightllm.server.args")
    ]
    assert violations("lightllm.extras.x", "") == [
        ("lightllm.extras.x", "nothing: give package 'extras' a floor in FLOORS")
    ]
    # allowed: downward, the registry from above, the autotuner's envs, a family inside models/
    assert violations("lightllm.server.args", "from lightllm.models.registry import read_model_config") == []
    assert violations("lightllm.common.autotuner.phase", "from lightllm.common import envs") == []
    assert violations("lightllm.models.registry", "from lightllm.models.qwen3.family import Qwen3Family") == []
    assert violations("lightllm.tools.make_tiny_model", "from lightllm.models.qwen3.config import X") == []
    assert violations("lightllm.layers", "from .attention import AttentionBackend", is_package=True) == []
