"""The import direction of attnjax/, read from the source with ``ast``: nothing imports upwards.

Layers, bottom to top (a module may import its own layer and those below, never above):

    0    attention, positional                  pure functions
    1    vit, vqgan, vqgan_loss, lpips, prior,  Linen modules (among themselves: no cycles)
         sampling, images, transformer,
         quantizers
    2    convert/*                              weights from PyTorch and Google files
    3    data, parallel, checkpoint             infrastructure
    4.0  tasks/optim, tasks/report              what every task uses
    4.1  tasks/classification, tasks/vqgan,     the tasks and their registry
         tasks/prior, tasks/__init__
    4.2  tasks/loop                             the training loop
    4.3  export, sample                         inference on trained runs (export.load: jax only)
    5    train.py, demo.py, benchmarks/         outside the package

Only attnjax/convert/ may import PyTorch or its ecosystem.
"""
import ast
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attnjax"

LAYERS = {
    "attnjax": 0,  # the package __init__: a docstring and a version
    "attnjax.blocked_attention": 0,
    "attnjax.convolution": 0,
    "attnjax.attention": 0.1,
    "attnjax.positional": 0,
    **{f"attnjax.{name}": 1 for name in ("vit", "vqgan", "vqgan_loss", "lpips", "prior", "sampling", "transformer",
                                         "images", "quantizers")},
    "attnjax.convert": 2,
    **{f"attnjax.{name}": 3 for name in ("data", "sharding", "parallel", "checkpoint", "checkpoint_integrity",
                                         "nonfinite", "preemption", "workdir_lock")},
    "attnjax.tasks.optim": 4.0,
    "attnjax.tasks.report": 4.0,
    **{f"attnjax.tasks.{name}": 4.1 for name in ("classification", "vqgan", "prior")},
    "attnjax.tasks": 4.1,
    "attnjax.tasks.loop": 4.2,
    "attnjax.export": 4.3,
    "attnjax.sample": 4.3,
    "attnjax.launch": 5,
}
TORCH_WORLD = ("torch", "torchvision", "timm", "lpips", "taming")
MAY_IMPORT_TORCH = ("attnjax.convert",)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str):
    """The layer of ``module`` (its longest listed prefix), or None for an unlisted module."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYERS and (end == len(parts) or name != "attnjax"):
            return LAYERS[name]
    return None


def imports_of(source: str, module: str, is_package: bool):
    """``(line, imported module, statement text)`` for every import in ``source``, lazy ones
    (inside functions) included; ``from a import b`` counts as ``a.b`` when that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, f"import {alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                target = candidate if _is_module(candidate) else base
                found.append((node.lineno, target, f"from {'.' * node.level}{node.module or ''} "
                                                   f"import {alias.name}"))
    return found


def _is_module(name: str) -> bool:
    if not name.startswith("attnjax"):
        return False
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def violations(files: dict[str, tuple[str, bool]]) -> list[str]:
    """Messages for every upward import, same-layer cycle and stray torch import in ``files``
    (``{relative path: (source, is_package)}``)."""
    problems, graph = [], {}
    for relative, (source, is_package) in sorted(files.items()):
        module = module_name(ROOT / relative)
        own = layer_of(module)
        if own is None:
            problems.append(f"{relative}: module {module} has no layer; add it to LAYERS in "
                            f"tests/test_layering.py")
            continue
        for line, target, text in imports_of(source, module, is_package):
            top = target.split(".")[0]
            if top in TORCH_WORLD and not module.startswith(MAY_IMPORT_TORCH):
                problems.append(f"{relative}:{line}: `{text}` imports {top}; only attnjax/convert/ "
                                f"may import PyTorch and its packages")
            if top != "attnjax" or target == module:
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                problems.append(f"{relative}:{line}: `{text}` imports {target} (layer {theirs}) "
                                f"from {module} (layer {own}): imports must point down")
            graph.setdefault(module, set()).add(target)
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def package_files() -> dict[str, tuple[str, bool]]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        files[str(path.relative_to(ROOT))] = (path.read_text(), path.name == "__init__.py")
    return files


def test_no_module_imports_upwards_or_torch_outside_convert():
    problems = violations(package_files())
    assert not problems, "\n".join(problems)


def test_the_checker_flags_upward_imports_cycles_and_torch():
    files = package_files()
    files[os.path.join("attnjax", "attention.py")] = (
        files[os.path.join("attnjax", "attention.py")][0]
        + "\n\ndef _late():\n    from attnjax import checkpoint\n    import torch\n", False)
    files[os.path.join("attnjax", "positional.py")] = (
        files[os.path.join("attnjax", "positional.py")][0] + "\nfrom . import attention\n", False)
    files[os.path.join("attnjax", "attention.py")] = (
        files[os.path.join("attnjax", "attention.py")][0] + "\nfrom attnjax import positional\n",
        False)
    problems = violations(files)
    assert any("attnjax/attention.py:" in p and "`from attnjax import checkpoint`" in p
               and "layer 3" in p for p in problems), problems
    assert any("attnjax/attention.py:" in p and "`import torch`" in p for p in problems), problems
    assert any(p.startswith("import cycle:") and "attnjax.attention" in p
               and "attnjax.positional" in p for p in problems), problems



MAX_MODULE_LINES = 500  # a reader finds any model in one file and reads it in one sitting


def test_no_module_is_over_500_lines():
    long = {str(path.relative_to(ROOT)): n for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"
