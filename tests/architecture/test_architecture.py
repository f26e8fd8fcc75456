"""The layers import in one direction: the engine knows no HTTP, the client knows no server, the protocol
layers reach the engine through its facade only, and no package has an import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from support import REPO_ROOT
from support.imports import cycles, graph

ROOT = REPO_ROOT


def _imports(folder: Path) -> set[str]:
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                prefix = "." * node.level
                found.add(prefix + (node.module or ""))
    return found


def test_engine_imports_no_http_and_no_protocol_layer() -> None:
    imports = _imports(ROOT / "server" / "engine")
    forbidden = ("uvicorn", "starlette", "fastapi", "httptools", "http", "asgi", "aiohttp")
    for name in imports:
        assert not name.lstrip(".").split(".")[0] in forbidden, name
    server = graph(ROOT / "server", "server")
    engine = {m for m in server if m.startswith("server.engine")}
    # Its configuration is built from the settings table; the flash tier's storage is a library of its own.
    allowed = engine | {"server.settings", "server.flash"}
    for module in engine:
        assert server[module] <= allowed, (module, server[module] - allowed)


def test_no_import_cycles_type_checking_imports_included() -> None:
    for folder, package in ((ROOT / "server", "server"), (ROOT / "ctxstore", "ctxstore")):
        edges = graph(folder, package)
        assert len(edges) > 10 and sum(map(len, edges.values())) > 20  # the graph was really read
        assert cycles(edges) == [], package


def test_the_protocol_layers_reach_the_engine_through_its_facade() -> None:
    edges = graph(ROOT / "server", "server")
    for module, targets in edges.items():
        if module.startswith("server.engine"):
            continue
        # The facade exports the errors module too: the typed errors are part of what the engine promises.
        inside = sorted(t for t in targets if t.startswith("server.engine.") and t != "server.engine.errors")
        assert inside == [], f"{module} imports engine internals {inside}; use the facade (server.engine)"


def test_bulk_and_s3_share_the_protocol_floor_not_each_other() -> None:
    edges = graph(ROOT / "server", "server")
    for module, targets in edges.items():
        if module.startswith("server.bulk"):
            assert not any(t.startswith("server.s3") for t in targets), module
        if module.startswith("server.s3"):
            assert not any(t.startswith("server.bulk") for t in targets), module
        if module.startswith("server.protocol"):
            assert not any(t.startswith(("server.s3", "server.bulk")) for t in targets), module


def test_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_client_package_imports_nothing_from_the_server() -> None:
    # Only `ctxstore serve` reaches into the server, lazily, from inside the command function.
    for path in (ROOT / "ctxstore").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module-level statements only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("ctxstore_server", "server")), f"{path.name}: {name}"
        if path.name != "cli.py":
            assert "ctxstore_server" not in path.read_text(), path.name


def test_client_package_imports_without_server_dependencies() -> None:
    code = (
        "import sys\n"
        "for mod in ('uvicorn', 'starlette', 'fastapi', 'ctxstore_server'):\n"
        "    sys.modules[mod] = None  # make any import of them fail\n"
        "import ctxstore, ctxstore.hashing, ctxstore.cli\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_every_package_folder_is_listed_in_pyproject() -> None:
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    names = {"ctxstore": "ctxstore", "server": "ctxstore_server"}
    found = set()
    for folder, name in names.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found <= listed, f"missing from [tool.setuptools] packages: {sorted(found - listed)}"


def test_only_the_tier_seam_asks_whether_the_node_has_a_flash_tier() -> None:
    # The engine talks to a lower tier that always exists (NoLowerTier on a RAM-only node): outside the tier
    # itself, nothing compares it with None, and the flash directory is read once, where the tier is chosen.
    seam = {"tier.py", "lower.py", "config.py"}
    chosen: list[str] = []
    for path in sorted((ROOT / "server" / "engine").glob("*.py")):
        if path.name in seam:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops):
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "") for n in
                         [node.left, *node.comparators]}
                assert not names & {"tier", "lower", "flash"}, f"{path.name}:{node.lineno} asks whether there is a tier"
            if isinstance(node, ast.Attribute) and node.attr == "disk_path":
                chosen.append(f"{path.name}:{node.lineno}")
    assert len(chosen) == 1 and chosen[0].startswith("engine.py:"), chosen


def test_test_modules_have_unique_names() -> None:
    # pytest imports test modules by basename (no packages under tests/): two test_x.py in different folders
    # collide ("import file mismatch") as soon as one run collects both.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_no_test_imports_a_conftest_module() -> None:
    # "conftest" is whichever conftest.py pytest imported last (there are several): shared helpers are imported
    # from support.
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert "conftest" not in names, f"{path.relative_to(ROOT)}:{node.lineno} imports conftest"
