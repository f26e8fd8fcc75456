"""Generated docs stay in sync with the tables they come from, and the docs' commands are ones that work."""

import os
import re

from support import REPO_ROOT

from ctxstore_server import settings
from ctxstore_server.s3 import router

DOCS = REPO_ROOT / "docs"


def test_configuration_doc_is_generated_from_the_settings_table() -> None:
    assert (DOCS / "configuration.md").read_text() == settings.markdown(), (
        "regenerate: python -m ctxstore_server.settings > docs/configuration.md"
    )


def test_s3_compatibility_doc_is_generated_from_the_routing_table() -> None:
    assert (DOCS / "s3-compatibility.md").read_text() == router.markdown(), (
        "regenerate: python -m ctxstore_server.s3.router > docs/s3-compatibility.md"
    )


def test_every_route_is_documented() -> None:
    text = (DOCS / "s3-compatibility.md").read_text()
    for route in router.ROUTES:
        assert route.operation in text


def test_no_doc_or_message_installs_ctxstore_from_the_package_index() -> None:
    # ctxstore is not on the public index: `pip install ctxstore` (or 'ctxstore[server]') fails for every reader
    # who copies it. Installs name a checkout or a git URL (README, "Installing").
    unpublished = re.compile(r"pip install (--\S+ )*['\"]?ctxstore(\[[a-z,]+\])?['\"]?(?!\s*@)(\s|`|$)")
    texts = [REPO_ROOT / "README.md", *DOCS.glob("*.md"), *REPO_ROOT.glob("deploy/**/*"),
             *REPO_ROOT.glob("ctxstore/**/*.py"), *REPO_ROOT.glob("server/**/*.py")]
    found = [f"{path.relative_to(REPO_ROOT)}: {line.strip()}" for path in texts if path.is_file()
             for line in path.read_text(errors="replace").splitlines() if unpublished.search(line)]
    assert found == []


def test_the_ctxstore_command_runs_from_a_checkout() -> None:
    # The docs write `ctxstore admin ...`; in a checkout that is scripts/ctxstore, in scripts/serve's venv.
    script = REPO_ROOT / "scripts" / "ctxstore"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert "ensure_venv server" in text and 'exec "$VENV/bin/ctxstore" "$@"' in text
    assert "scripts/ctxstore" in (DOCS / "operations.md").read_text()
    assert "scripts/ctxstore" in (REPO_ROOT / "README.md").read_text()
