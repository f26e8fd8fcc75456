"""The flash package stands alone: it imports nothing from the rest of the server (whose engine is rewritten
independently) and only numpy and xxhash from outside the standard library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FLASH = Path(__file__).resolve().parents[2] / "server" / "flash"
ALLOWED_THIRD_PARTY = {"numpy", "xxhash"}


def test_flash_imports_only_itself_the_standard_library_numpy_and_xxhash() -> None:
    for path in FLASH.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name}: from {'.' * node.level}{node.module} leaves the package"
                continue
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY, f"{path.name}: {name}"


def test_flash_imports_without_the_rest_of_the_server() -> None:
    code = (
        "import sys\n"
        "for mod in ('uvicorn', 'starlette', 'fastapi', 'msgpack', 'sortedcontainers', 'ctxstore'):\n"
        "    sys.modules[mod] = None  # any import of them fails\n"
        "import ctxstore_server.flash\n"
        "others = sorted(m for m in sys.modules if m.startswith('ctxstore_server.')\n"
        "                and not m.startswith('ctxstore_server.flash'))\n"
        "print(others)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
