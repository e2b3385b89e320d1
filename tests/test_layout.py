"""The package's layering and the house rule of no module-level mutable state, checked on the source."""

import ast
import pathlib

import pytest

import sb3_influence

ROOT = pathlib.Path(sb3_influence.__file__).parent
# Lowest first: a module may import only from modules of its own layer or the layers before it
LAYERS = [
    [
        "common.sb3_compat",
        "common.targets",
        "common.extractors",
        "common.command_line",
        "common.units",
        "common.progress",
        "common.files",
        "common.stats",
    ],
    ["common.buffers", "common.state", "common.scoring.layers", "common.scoring.update_maps"],
    ["common.round", "common.scoring.engine"],
    [
        "common.scoring.multi",
        "common.scoring.optimizer_aware",
        "common.scoring.trajectory",
        "common.filters",
        "common.snapshots.reader",
        "common.snapshots.runs",
        "common.snapshots.frames",
        "common.snapshots.records",
        "common.snapshots.writer",
        "common.snapshots",
    ],
    ["common.scoring.unrolled", "common.scoring"],
    ["common.callbacks", "common.algorithm", "common.ppo_update"],
    ["common.dtv"],
]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "sb3_influence.common":
            names.update(f"common.{alias.name}" for alias in node.names)  # from sb3_influence.common import sb3_compat
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sb3_influence."):
            names.add(node.module[len("sb3_influence.") :])
        elif isinstance(node, ast.Import):
            prefix = "sb3_influence."
            names.update(alias.name[len(prefix) :] for alias in node.names if alias.name.startswith(prefix))
    return names


def _layer(module: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if module in layer:
            return index
    return None


@pytest.mark.parametrize("path", sorted((ROOT / "common").rglob("*.py")), ids=lambda p: _module_name(p))
def test_common_imports_only_downwards(path):
    module = _module_name(path)
    own = _layer(module)
    if module == "common":
        return
    assert own is not None, f"{module} is not placed in tests/test_layout.py's LAYERS: add it to the right layer"
    for imported in _imports(path):
        assert imported.startswith("common"), f"{module} imports {imported}: common/ must not import the layers above it"
        layer = _layer(imported)
        assert layer is not None and layer <= own, f"{module} (layer {own}) imports {imported} (layer {layer})"


def test_no_module_level_mutable_containers():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    continue
                value = node.value
                mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                    isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("dict", "list", "set")
                )
                if mutable:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"module-level mutable containers (use a tuple or types.MappingProxyType): {offenders}"
