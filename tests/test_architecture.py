"""The layers import in one direction: the engine knows no HTTP, the client knows no server."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
        assert not name.startswith(("..s3", "..asgi", "..app")), name


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
