"""Generated docs stay in sync with the tables they come from."""


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
