"""ctxstore: the worker's client for a pod of ctxstore nodes.

    from ctxstore import ContextStore
    store = ContextStore("node-a:9000,node-b:9000", access_key=..., secret_key=...)
    ns = store.namespace("kv-llama3-8b", model="meta-llama/Meta-Llama-3-8B", kv_dtype="bfloat16")
    ns.save(tokens, blocks)                 # one buffer per full block of tokens
    n = ns.lookup(tokens)                   # leading full blocks the pod holds
    result = ns.restore(tokens, out=buf)    # straight into your buffer
"""

from .core import AsyncContextStore, AsyncNamespace, Limits, QueryResult, RestoreResult, SaveResult, Timeouts
from .errors import (
    AuthenticationError,
    ConfigurationError,
    ContextStoreError,
    IntegrityError,
    LimitExceeded,
    NoSuchBucket,
    NodeTimeout,
    NodeUnavailable,
    ProtocolError,
    ServerError,
    SlowDown,
)
from .hashing import Fingerprint, block_hashes
from .sync import ContextStore, Namespace

__all__ = [
    "AsyncContextStore", "AsyncNamespace", "AuthenticationError", "ConfigurationError", "ContextStore",
    "ContextStoreError", "Fingerprint", "IntegrityError", "LimitExceeded", "Limits", "Namespace", "NoSuchBucket",
    "NodeTimeout", "NodeUnavailable", "ProtocolError", "QueryResult", "RestoreResult", "SaveResult", "ServerError",
    "SlowDown", "Timeouts", "block_hashes",
]
__version__ = "0.1.0"
