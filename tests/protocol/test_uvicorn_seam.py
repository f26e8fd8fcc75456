"""The uvicorn internals the node relies on (server/protocol/uvicorn_seam.py) exist in the installed uvicorn.

The node's HTTP protocol and the data path below ASGI use attributes and methods of uvicorn's httptools
protocol, request cycle and flow control that are not uvicorn's public API. They are all declared in the seam;
here each one is looked up on real uvicorn objects (a protocol serving a request on a socket pair), so an upgrade
that renames or drops one fails with the name of what went missing. And the node's protocol class uses no name
of uvicorn's that the seam does not declare.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httptools
import pytest
import uvicorn
from uvicorn.server import ServerState as UvicornServerState

from ctxstore_server.protocol import direct, http, uvicorn_seam
from ctxstore_server.protocol.uvicorn_seam import Connection, Cycle, Flow, HttpToolsProtocol, ServerState

HTTP_MODULE = Path(http.__file__)


def members(protocol: type) -> dict[str, Any]:
    """The names a typing.Protocol declares (annotated attributes, properties, methods) and their definitions."""
    names: dict[str, Any] = {name: None for name in protocol.__dict__.get("__annotations__", {})}
    for name, value in protocol.__dict__.items():
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
            names[name] = value
    return names


class Served:
    """A real uvicorn httptools protocol that has parsed a request's head and is running its application."""

    def __init__(self, protocol: HttpToolsProtocol, cycle: Any) -> None:
        self.protocol = protocol
        self.cycle = cycle


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    async def scenario() -> Served:
        release = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await release.wait()

        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        config.load()
        protocol = HttpToolsProtocol(config=config, server_state=UvicornServerState(), app_state={},
                                     _loop=asyncio.get_running_loop())
        ours, theirs = socket.socketpair()
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, ours)
        theirs.sendall(b"PUT /x HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\n12345")
        for _ in range(200):
            if protocol.cycle is not None:
                break
            await asyncio.sleep(0.005)
        found = Served(protocol, protocol.cycle)
        release.set()
        transport.close()
        theirs.close()
        await asyncio.sleep(0.01)
        return found

    yield asyncio.run(scenario())


def check(subject: object, declared: type, where: str) -> None:
    missing = [name for name in members(declared) if not hasattr(subject, name)]
    assert not missing, (f"uvicorn {uvicorn.__version__}: {where} has no {', '.join(missing)} "
                         f"(declared in server/protocol/uvicorn_seam.py, {declared.__name__})")
    for name, definition in members(declared).items():
        if not inspect.isfunction(definition):
            continue
        theirs = getattr(subject, name)
        if not callable(theirs):
            raise AssertionError(f"uvicorn {uvicorn.__version__}: {where}.{name} is no longer callable")
        if inspect.isfunction(theirs) or inspect.ismethod(theirs):
            expected = [p for p in inspect.signature(definition).parameters if p != "self"]
            actual = list(inspect.signature(theirs).parameters)
            assert actual == expected, f"uvicorn {uvicorn.__version__}: {where}.{name}{tuple(actual)}, " \
                                       f"the seam expects {tuple(expected)}"


def test_the_protocol_has_every_declared_attribute_and_method(served: Served) -> None:
    check(served.protocol, Connection, "HttpToolsProtocol")


def test_the_request_cycle_has_every_declared_attribute_and_method(served: Served) -> None:
    assert served.cycle is not None, "uvicorn made no request cycle for a request head (HttpToolsProtocol.cycle)"
    check(served.cycle, Cycle, "RequestResponseCycle")
    assert served.cycle.scope is served.protocol.scope, "the cycle's scope is no longer the protocol's scope"


def test_flow_control_and_server_state_have_every_declared_member(served: Served) -> None:
    check(served.protocol.flow, Flow, "FlowControl")
    check(served.protocol.server_state, ServerState, "ServerState")


def test_the_pipeline_holds_cycle_and_app_pairs(served: Served) -> None:
    pipeline = served.protocol.pipeline
    assert hasattr(pipeline, "__iter__") and len(pipeline) == 0


def test_a_fresh_parser_calls_back_into_the_connection(served: Served) -> None:
    parser = uvicorn_seam.new_parser(uvicorn_seam.as_connection(served.protocol))
    assert isinstance(parser, httptools.HttpRequestParser)
    parser.feed_data(b"GET / HTTP/1.1\r\nhost: t\r\n")  # calls the protocol's on_message_begin, on_url, ...


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes read or written as ``self.X`` and ``super().X`` in a class body."""
    found: set[str] = set()
    for node in ast.walk(cls):
        if not isinstance(node, ast.Attribute):
            continue
        target = node.value
        if isinstance(target, ast.Name) and target.id == "self":
            found.add(node.attr)
        elif isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
            found.add(node.attr)
    return found


def own_names(cls: ast.ClassDef) -> set[str]:
    """What the class defines itself: its methods and the attributes its __init__ assigns."""
    names = {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
    [init] = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    for node in ast.walk(init):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    names.add(target.attr)
    return names


def test_the_node_protocol_uses_only_names_the_seam_declares() -> None:
    tree = ast.parse(HTTP_MODULE.read_text())
    [cls] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "NodeHttpProtocol"]
    declared = set(members(Connection)) | set(members(direct.HttpConnection))
    inherited = self_attributes(cls) - own_names(cls) - {"__init__"}
    undeclared = sorted(inherited - declared)
    assert not undeclared, f"NodeHttpProtocol uses uvicorn's {undeclared}: declare them in uvicorn_seam.Connection"
    # and what it overrides of uvicorn's is declared too
    overridden = {node.name for node in cls.body if isinstance(node, ast.FunctionDef)} & set(dir(HttpToolsProtocol))
    assert overridden - {"__init__"} <= declared, sorted(overridden - declared - {"__init__"})


def test_the_node_protocol_is_a_connection_the_data_path_accepts() -> None:
    assert issubclass(http.NodeHttpProtocol, HttpToolsProtocol)
    for name in members(direct.HttpConnection):
        assert callable(getattr(http.NodeHttpProtocol, name, None)), name
