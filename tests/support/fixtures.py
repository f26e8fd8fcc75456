"""Fixtures of the suites that run against a node in the test process (:class:`support.inprocess.InProcessNode`:
the real application, its requests through ASGI, no socket), set up as the session's real node is (see
:func:`support.inprocess.like_the_session_node`). A folder's conftest imports them, replacing tests/conftest.py's
``s3``, ``s3_other`` and ``bucket`` there.

A test that needs a real process (sockets, uvicorn, the direct path, clients other than boto3) asks for the
session's ``server``: its ``s3``, ``s3_other`` and ``bucket`` are then that node's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .inprocess import InProcessNode, like_the_session_node, scratch_bucket
from .nodes import OTHER_ACCESS_KEY, OTHER_SECRET_KEY, Node, make_client


def wants_real_node(request: pytest.FixtureRequest) -> bool:
    """Whether the test asks for the session's real node (then its clients are that node's)."""
    return "server" in request.fixturenames


@pytest.fixture(scope="session")
def inprocess() -> Iterator[InProcessNode]:
    node = like_the_session_node()
    yield node
    node.close()


@pytest.fixture(scope="session")
def inprocess_s3(inprocess: InProcessNode) -> Any:
    return inprocess.client()


@pytest.fixture(scope="session")
def inprocess_s3_other(inprocess: InProcessNode) -> Any:
    return inprocess.other_client()


@pytest.fixture(scope="session")
def real_s3(server: Node) -> Any:
    return make_client(server.endpoint)


@pytest.fixture(scope="session")
def real_s3_other(server: Node) -> Any:
    return make_client(server.endpoint, OTHER_ACCESS_KEY, OTHER_SECRET_KEY)


@pytest.fixture
def s3(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("real_s3" if wants_real_node(request) else "inprocess_s3")


@pytest.fixture
def s3_other(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("real_s3_other" if wants_real_node(request) else "inprocess_s3_other")


@pytest.fixture
def bucket(s3: Any) -> Iterator[str]:
    with scratch_bucket(s3, "test") as name:
        yield name
