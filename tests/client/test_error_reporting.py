"""What the client says when a node refuses a call: the exception names node, HTTP status, S3 code and message
(not the raw XML cut off in the middle of a signature), and a refused call on the lenient path (a wrong secret
with ``create=False``: every lookup 0, every save failed) is recorded in the node's ``last_error`` and logged at
WARNING once per node and error code, at most once a minute."""

from __future__ import annotations

import logging
import secrets

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node

import ctxstore.core
from ctxstore import AuthenticationError, ContextStore, NoSuchBucket, ServerError
from ctxstore.errors import MAX_MESSAGE_CHARS, s3_error

TOKENS = list(range(64))  # 4 blocks of 16 tokens
BLOCKS = [bytes([i]) * 256 for i in range(4)]
WRONG_SECRET = "not-the-secret-0000"


def refused(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ctxstore.client" and "refused" in r.getMessage()
            and r.levelno == logging.WARNING]


def health(store: ContextStore, node: Node) -> dict[str, object]:
    nodes = store.metrics_snapshot()["nodes"]
    assert isinstance(nodes, dict)
    entry: dict[str, object] = nodes[f"127.0.0.1:{node.port}"]
    return entry


def test_a_refused_create_says_status_code_and_message_not_xml(server: Node) -> None:
    with ContextStore(server.endpoint, access_key=ACCESS_KEY, secret_key=WRONG_SECRET) as store, \
            pytest.raises(AuthenticationError) as info:
        store.namespace("errs-" + secrets.token_hex(4), model="m")
    error = info.value
    text = str(error)
    assert text == (f"127.0.0.1:{server.port}: 403 SignatureDoesNotMatch: The request signature we calculated "
                    "does not match the signature you provided."), text
    assert (error.status, error.code, error.node) == (403, "SignatureDoesNotMatch", f"127.0.0.1:{server.port}")
    assert error.message.startswith("The request signature we calculated does not match")


def test_a_wrong_secret_on_the_lenient_path_is_recorded_and_logged_once(
        server: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ctxstore.client")
    with ContextStore(server.endpoint, access_key=ACCESS_KEY, secret_key=WRONG_SECRET) as store:
        ns = store.namespace("errs-" + secrets.token_hex(4), model="m", create=False)
        for _ in range(3):
            assert ns.lookup(TOKENS) == 0
            assert ns.save(TOKENS, BLOCKS).failed == 4
        entry = health(store, server)
        assert entry["up"] is True  # the node is fine: the call was wrong
        last_error = str(entry["last_error"])
        assert "403 SignatureDoesNotMatch: The request signature we calculated" in last_error, last_error
        logged = refused(caplog)
        assert len(logged) == 1, logged  # six refused calls, one line
        assert f"127.0.0.1:{server.port}" in logged[0] and "403 SignatureDoesNotMatch" in logged[0]


def test_each_error_code_is_logged_on_its_own(server: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ctxstore.client")
    missing = "errs-missing-" + secrets.token_hex(4)
    with ContextStore(server.endpoint, access_key=ACCESS_KEY, secret_key=WRONG_SECRET) as wrong, \
            ContextStore(server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as right:
        assert wrong.namespace(missing, model="m", create=False).lookup(TOKENS) == 0
        for _ in range(2):
            assert right.namespace(missing, model="m", create=False).lookup(TOKENS) == 0  # no such bucket
        assert "404 NoSuchBucket" in str(health(right, server)["last_error"])
        with ContextStore(server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, strict=True) as strict, \
                pytest.raises(NoSuchBucket, match="404 NoSuchBucket"):
            strict.namespace(missing, model="m", create=False).lookup(TOKENS)
    logged = refused(caplog)
    assert sum("SignatureDoesNotMatch" in m for m in logged) == 1, logged
    assert sum("NoSuchBucket" in m for m in logged) == 2, logged  # one per client: each keeps its own account


def test_a_refusal_is_logged_again_once_the_interval_has_passed(
        server: Node, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctxstore.core, "REFUSAL_LOG_INTERVAL", 0.0)  # every refusal is "a minute later"
    caplog.set_level(logging.WARNING, logger="ctxstore.client")
    with ContextStore(server.endpoint, access_key=ACCESS_KEY, secret_key=WRONG_SECRET) as store:
        ns = store.namespace("errs-" + secrets.token_hex(4), model="m", create=False)
        assert ns.lookup(TOKENS) == 0 and ns.lookup(TOKENS) == 0
    assert len(refused(caplog)) == 2


# ---------------------------------------------------------------------------- S3 error documents

SIGNATURE_ERROR = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code><Message>The '
                   b'request signature we calculated does not match the signature you provided.</Message>'
                   b'<AWSAccessKeyId>AK</AWSAccessKeyId><SignatureProvided>f9b4</SignatureProvided>'
                   b'<StringToSign>AWS4-HMAC-SHA256\n20260101T000000Z</StringToSign></Error>')


def test_an_s3_error_document_becomes_its_code_and_message() -> None:
    error = s3_error("n:1", 403, SIGNATURE_ERROR)
    assert isinstance(error, AuthenticationError)
    assert str(error) == ("n:1: 403 SignatureDoesNotMatch: The request signature we calculated does not match the "
                          "signature you provided.")
    namespaced = b'<Error xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Code>NoSuchBucket</Code></Error>'
    assert isinstance(s3_error("n:1", 404, namespaced), NoSuchBucket)


def test_a_body_that_is_not_an_error_document_keeps_its_first_line() -> None:
    error = s3_error("n:1", 400, b"Invalid HTTP request received.\nmore")
    assert (error.code, error.message) == ("HTTP", "Invalid HTTP request received.")
    assert s3_error("n:1", 502, b"").message == "Bad Gateway"
    assert len(s3_error("n:1", 400, b"x" * 10_000).message) == MAX_MESSAGE_CHARS
    long = b"<Error><Code>SlowDown</Code><Message>" + b"y" * 5000 + b"</Message></Error>"
    assert len(s3_error("n:1", 503, long).message) == MAX_MESSAGE_CHARS


def test_a_document_with_a_dtd_is_not_parsed() -> None:
    bomb = (b'<?xml version="1.0"?><!DOCTYPE e [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;">]>'
            b"<Error><Code>&b;</Code><Message>&b;</Message></Error>")
    error = s3_error("n:1", 400, bomb)
    assert type(error) is ServerError and error.code == "HTTP"
