"""Where the client's key pair comes from: the arguments, else ``CTXSTORE_ACCESS_KEY``/``CTXSTORE_SECRET_KEY``,
else ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (what ``ctxstore serve`` prints), a pair always taken from one
source; and ``ctxstore bench``, which reads them the same way and says so in its own (command-line) words."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from support.nodes import ACCESS_KEY, SECRET_KEY, Node

from ctxstore import ConfigurationError, ContextStore
from ctxstore.credentials import ENV_PAIRS, resolve_credentials

COMMAND = str(Path(sys.executable).parent / "ctxstore")  # the console script pyproject.toml installs
CREDENTIAL_VARIABLES = [name for pair in ENV_PAIRS for name in pair]
CTX = {"CTXSTORE_ACCESS_KEY": "ctx-key", "CTXSTORE_SECRET_KEY": "ctx-secret"}
AWS = {"AWS_ACCESS_KEY_ID": "aws-key", "AWS_SECRET_ACCESS_KEY": "aws-secret"}


@pytest.mark.parametrize(("args", "environ", "expected"), [
    (("a", "s"), {**CTX, **AWS}, ("a", "s")),  # arguments first
    ((None, None), CTX, ("ctx-key", "ctx-secret")),
    ((None, None), AWS, ("aws-key", "aws-secret")),  # what `ctxstore serve` prints
    ((None, None), {**CTX, **AWS}, ("ctx-key", "ctx-secret")),  # CTXSTORE_* before AWS_*
    (("a", None), {"CTXSTORE_SECRET_KEY": "ctx-secret"}, ("a", "ctx-secret")),  # an argument completed from a pair
    (("a", None), AWS, ("a", "aws-secret")),
])
def test_where_the_pair_comes_from(args: tuple[str | None, str | None], environ: dict[str, str],
                                   expected: tuple[str, str]) -> None:
    assert resolve_credentials(*args, environ=environ) == expected


@pytest.mark.parametrize(("environ", "present", "missing"), [
    ({"CTXSTORE_ACCESS_KEY": "ctx-key", **AWS}, "CTXSTORE_ACCESS_KEY", "CTXSTORE_SECRET_KEY"),
    ({"CTXSTORE_SECRET_KEY": "ctx-secret", **AWS}, "CTXSTORE_SECRET_KEY", "CTXSTORE_ACCESS_KEY"),
    ({"AWS_ACCESS_KEY_ID": "aws-key"}, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
])
def test_a_half_set_pair_is_never_completed_from_the_other(environ: dict[str, str], present: str,
                                                           missing: str) -> None:
    with pytest.raises(ConfigurationError, match=f"{present} is set but {missing} is not"):
        resolve_credentials(None, None, environ=environ)


def test_no_credentials_says_every_way_to_give_them() -> None:
    with pytest.raises(ConfigurationError) as info:
        resolve_credentials(None, None, environ={})
    text = str(info.value)
    for name in ("access_key=", "secret_key=", *CREDENTIAL_VARIABLES):
        assert name in text, text
    with pytest.raises(ConfigurationError, match="pass --access-key and --secret-key, or set"):
        resolve_credentials(None, None, environ={}, how="pass --access-key and --secret-key")


def test_the_client_uses_the_pair_ctxstore_serve_prints(server: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    with ContextStore(server.endpoint, strict=True) as store:
        ns = store.namespace("creds-" + secrets.token_hex(4), model="m", block_size=4)
        assert ns.save(list(range(8)), [b"a" * 32, b"b" * 32]).stored == 2
        assert ns.lookup(list(range(8))) == 2
        assert store._async.signer.access_key == ACCESS_KEY


# ---------------------------------------------------------------------------- ctxstore bench


def bench(server: Node, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARIABLES}
    return subprocess.run([COMMAND, "bench", "--nodes", f"127.0.0.1:{server.port}", "--json", "--quiet",
                           "--ops", "save,lookup", "--count", "2", "--blocks", "2", "--block-size", "1KiB", *args],
                          env={**base, **env}, capture_output=True, text=True, timeout=120, check=False)


def test_bench_reads_the_aws_pair_too(server: Node) -> None:
    out = bench(server, "--namespace", "bench-aws-" + secrets.token_hex(4),
                env={"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [op["failed"] for op in report["operations"]] == [0, 0]


def test_bench_takes_the_pair_as_flags(server: Node) -> None:
    out = bench(server, "--namespace", "bench-flags-" + secrets.token_hex(4), "--access-key", ACCESS_KEY,
                "--secret-key", SECRET_KEY, env={})
    assert out.returncode == 0, out.stderr


def test_bench_without_credentials_names_its_flags_and_the_variables(server: Node) -> None:
    out = bench(server, "--namespace", "bench-none", env={})
    assert out.returncode == 2
    message = out.stderr.strip()
    assert message.startswith("ctxstore bench: no credentials: pass --access-key and --secret-key"), message
    for name in CREDENTIAL_VARIABLES:
        assert name in message, message
    assert "access_key=" not in message and "access_key/" not in message  # no Python wording on a command line


def test_bench_refuses_a_bad_namespace_before_anything_is_sent(server: Node) -> None:
    out = bench(server, "--namespace", "Bench_Bad", env={"CTXSTORE_ACCESS_KEY": ACCESS_KEY,
                                                         "CTXSTORE_SECRET_KEY": SECRET_KEY})
    assert out.returncode == 2
    assert "--namespace 'Bench_Bad': an S3 bucket name has only lowercase letters" in out.stderr, out.stderr
