"""Store events for routers and indexers: which blocks a node holds, as a stream (docs/events.md).

:mod:`.hub` numbers and fans out the engine's events, :mod:`.stream` serves them over HTTP (with a snapshot),
:mod:`.zmq` publishes them in vLLM's KV-event format, :mod:`.routes` keeps what a router's index needs of each
block beyond its key, :mod:`.model` is the event record and its frames."""

from ctxstore.admin_schema import EVENTS_PATH

from .hub import EventHub
from .model import REMOVED, STORED, STREAM_CONTENT_TYPE, Event, decode_frames, encode_event
from .routes import Route, RouteBook
from .stream import SNAPSHOT_PATH, EventStream
from .zmq import (
    END_SEQ, ZmqPublisher, block_hash, llmd_batch, llmd_event, llmd_topic, mooncake_batch, mooncake_event,
    routed_stored, vllm_batch, vllm_event,
)

__all__ = [
    "END_SEQ", "EVENTS_PATH", "REMOVED", "SNAPSHOT_PATH", "STORED", "STREAM_CONTENT_TYPE", "Event", "EventHub",
    "EventStream", "Route", "RouteBook", "ZmqPublisher", "block_hash", "decode_frames", "encode_event",
    "llmd_batch", "llmd_event", "llmd_topic", "mooncake_batch", "mooncake_event", "routed_stored", "vllm_batch",
    "vllm_event",
]
