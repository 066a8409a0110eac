"""tqkv.Client: the tqkv.v1.KvCache service over numpy arrays.

Mirrors the C++ client (client/cpp/tqkv_client.h):

Retries. A call that fails with UNAVAILABLE is retried with exponential
backoff and +-20% jitter, up to `max_attempts` tries. That is safe for every
rpc: reads change nothing; every Append (and AppendAttend item) carries an
idempotency key derived from its content (sequence, position, layers, K/V),
so an append that landed before the connection broke is answered
already_stored on retry (stored_bytes 0), and another writer's append at the
same position is not mistaken for it (that one is FAILED_PRECONDITION);
CreateSequence / ForkSequence answered ALREADY_EXISTS, and DropSequence
answered NOT_FOUND, on a retry count as success. append_stream
is not retried: resend the missing tail with append, from get_sequence's
lengths. A decode stream reopens itself on UNAVAILABLE and resends what was
not answered (tqkv/_stream.py).

Sharding. Every call that names a sequence sends the gRPC metadata
`tqkv-route-key: route_key(sequence_id)` so that a proxy can hash it onto a
server: fork sends the parent's key, attend and append_attend the key of
their first item, a decode stream the key of its first request's first item
(or the route_key given) at stream start, info none.

Thread safety: a Client may be shared by threads (gRPC channels are).
"""
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence

import grpc
import numpy as np

from tqkv import _messages, _tensors
from tqkv._errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound,
                          TqkvError, from_rpc_error)
from tqkv._messages import (  # noqa: F401 (re-exported by tqkv)
    AppendAttendItem, AppendAttendItemResult, AppendAttendResult, Chunk, route_key)
from tqkv._stream import DecodeStream
from tqkv.v1 import kvcache_pb2 as pb
from tqkv.v1 import kvcache_pb2_grpc as pb_grpc

ROUTE_KEY_HEADER = "tqkv-route-key"


def _sendable_header_value(value: str) -> bool:
    """Visible ASCII with inner spaces, nothing at the edges: what an HTTP/2
    header value may hold."""
    return (bool(value) and value[0] != " " and value[-1] != " "
            and all(0x20 <= ord(c) <= 0x7E for c in value))


def channel_options(max_message_bytes, server_name_override):
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    if server_name_override:
        options.append(("grpc.ssl_target_name_override", server_name_override))
    return options


@dataclass
class SequenceInfo:
    cache: str
    sequence_id: str
    layer_tokens: List[int]  # tokens held per layer
    pages: int
    # The oldest token each layer still holds: 0, except in sliding-window
    # layers, which give older tokens back.
    layer_oldest_token: List[int] = field(default_factory=list)
    # The bytes the sequence holds as the pool counts them (compressed tokens,
    # exact copies, key means), and its tokens in bf16.
    stored_bytes: int = 0
    stored_bytes_bf16: int = 0

    @classmethod
    def from_proto(cls, info):
        return cls(info.cache, info.sequence_id, list(info.layer_tokens), info.pages,
                   list(info.layer_oldest_token), int(info.stored_bytes),
                   int(info.stored_bytes_bf16))


@dataclass
class AppendResult:
    sequence: SequenceInfo
    # What this call changed in the sequence's bytes as the pool counts them
    # (SequenceInfo.stored_bytes; exact copies and key means included, less
    # what it released: can be negative), and the same for its tokens in
    # bf16; 0 when already_stored.
    stored_bytes: int
    stored_bytes_bf16: int
    already_stored: bool = False  # this append had landed (a retry or a resend): stored once


@dataclass
class ScoreResult:
    logits: np.ndarray                  # float32 [query_heads, tokens or top_k]
    positions: Optional[np.ndarray]     # int64 [query_heads, top_k] with top_k, else None


@dataclass
class AttendResult:
    output: np.ndarray               # [query_tokens, query_heads, head_dim] in output_dtype
    lse: Optional[np.ndarray] = None  # float32 [query_tokens, query_heads] with return_lse


@dataclass
class AttendItem:
    sequence_id: str
    layer: int
    # [query_tokens, query_heads, head_dim], or [query_heads, head_dim] for one token.
    queries: np.ndarray
    # None: the query tokens are the layer's last stored ones. Else query
    # token i sits at this position + i and sees the stored tokens up to it
    # (a prefill over a stored prefix; merge with its own part by lse).
    first_query_position: Optional[int] = None


class Client:
    """A client for one tqkv-server.

    target: host:port. cache: the default cache name of every call ("" is the
    server's first cache). auth_token: sent as `authorization: Bearer <token>`.
    TLS: tls=True (system roots) or root_certificates (PEM bytes);
    server_name_override when the certificate names another host. timeout:
    seconds per attempt. max_message_bytes: match the server's
    --max_message_bytes. channel: use this grpc.Channel instead (tests).
    """

    def __init__(self, target: str = "localhost:50051", *, cache: str = "",
                 auth_token: Optional[str] = None, tls: bool = False,
                 root_certificates: Optional[bytes] = None,
                 server_name_override: Optional[str] = None, timeout: float = 60.0,
                 max_attempts: int = 4, initial_backoff: float = 0.05,
                 max_backoff: float = 2.0, max_message_bytes: int = 64 << 20,
                 channel: Optional[grpc.Channel] = None):
        if max_attempts < 1:
            raise InvalidArgument("max_attempts must be >= 1, got %d" % max_attempts)
        self.cache = cache
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self._auth = (("authorization", "Bearer " + auth_token),) if auth_token else ()
        if channel is None:
            options = channel_options(max_message_bytes, server_name_override)
            if tls or root_certificates:
                credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
                channel = grpc.secure_channel(target, credentials, options=options)
            else:
                channel = grpc.insecure_channel(target, options=options)
        self._channel = channel
        self._stub = pb_grpc.KvCacheStub(channel)
        self._jitter = random.Random()

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- plumbing ---------------------------------------------------------

    def _metadata(self, sequence_id):
        if sequence_id is None:
            return self._auth
        return self._metadata_for_key(route_key(sequence_id))

    def _metadata_for_key(self, key):
        """Call metadata with the routing key `key` (None: no routing header)."""
        if key is None or not _sendable_header_value(key):
            # Like the C++ client: a key HTTP/2 cannot carry goes without the
            # header (the call still works; a router cannot pin it).
            return self._auth
        return self._auth + ((ROUTE_KEY_HEADER, key),)

    def _call(self, method, request, sequence_id):
        """(response, attempts, error): runs with retries on UNAVAILABLE."""
        backoff = self.initial_backoff
        metadata = self._metadata(sequence_id)
        for attempt in range(1, self.max_attempts + 1):
            try:
                return method(request, timeout=self.timeout, metadata=metadata), attempt, None
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.max_attempts:
                    return None, attempt, from_rpc_error(error)
            time.sleep(backoff * self._jitter.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.max_backoff)
        raise AssertionError("unreachable")

    def _cache(self, cache):
        return self.cache if cache is None else cache

    # -- rpcs ---------------------------------------------------------------

    def _append_request(self, sequence_id, keys, values, start, layer_begin, layer_end, create,
                        wire_dtype, cache):
        return _messages.append_request(self._cache(cache), sequence_id, keys, values, start,
                                        layer_begin, layer_end, create, wire_dtype)

    def append(self, sequence_id: str, keys, values, *, start: int = 0, layer_begin: int = 0,
               layer_end: int = 0, create: bool = True, wire_dtype: Optional[str] = None,
               cache: Optional[str] = None) -> AppendResult:
        """Stores K/V [layers, tokens, kv_heads, head_dim] for the tokens from `start`
        (which must equal the sequence's length in every layer of [layer_begin,
        layer_end); layer_end 0 means all layers). Creates the sequence unless
        create=False. All-or-nothing."""
        request = self._append_request(sequence_id, keys, values, start, layer_begin,
                                       layer_end, create, wire_dtype, cache)
        response, _, error = self._call(self._stub.Append, request, sequence_id)
        if error is None:
            return AppendResult(SequenceInfo.from_proto(response.sequence),
                                response.stored_bytes, response.stored_bytes_bf16,
                                response.already_stored)
        raise error

    def append_stream(self, sequence_id: str, chunks: Iterable, *, start: int = 0,
                      layer_begin: int = 0, layer_end: int = 0, create: bool = True,
                      wire_dtype: Optional[str] = None,
                      cache: Optional[str] = None) -> AppendResult:
        """A long prefill in one client stream. `chunks` yields Chunk or (keys,
        values) pairs of consecutive tokens; start positions advance from `start`
        by each chunk's token count. Chunks before a failing one remain stored
        (each is all-or-nothing). Not retried."""
        state = {}

        def build(keys, values, position):
            return self._append_request(sequence_id, keys, values, position, layer_begin,
                                        layer_end, create, wire_dtype, cache)

        try:
            response = self._stub.AppendStream(_messages.chunk_requests(chunks, start, build,
                                                                        state),
                                               timeout=self.timeout,
                                               metadata=self._metadata(sequence_id))
        except grpc.RpcError as error:
            if "error" in state:
                raise state["error"]
            raise from_rpc_error(error)
        if "error" in state:
            # The stream ended early on a client-side check; what was sent is stored.
            raise state["error"]
        return AppendResult(SequenceInfo.from_proto(response.sequence), response.stored_bytes,
                            response.stored_bytes_bf16)

    def score(self, sequence_id: str, layer: int, queries, *, token_begin: int = 0,
              token_end: int = 0, scale: float = 0.0, top_k: int = 0,
              cache: Optional[str] = None, logit_softcap: float = 0.0) -> ScoreResult:
        """Logits q.k*scale (scale 0: 1/sqrt(head_dim)) of queries [query_heads,
        head_dim] against the layer's keys in [token_begin, token_end) (0: the
        layer's length); with top_k, only the top_k per head and their positions.
        logit_softcap > 0: each logit x returned as cap * tanh(x / cap)."""
        request = pb.ScoreQueryRequest(cache=self._cache(cache), sequence_id=sequence_id,
                                       layer=layer,
                                       queries=_tensors.encode("queries", queries, 2),
                                       token_begin=token_begin, token_end=token_end,
                                       scale=scale, top_k=top_k, logit_softcap=logit_softcap)
        response, _, error = self._call(self._stub.ScoreQuery, request, sequence_id)
        if error is not None:
            raise error
        logits = _tensors.decode(response.logits)
        positions = None
        if top_k > 0:
            positions = np.asarray(response.positions, dtype=np.int64).reshape(logits.shape)
        return ScoreResult(logits, positions)

    def attend(self, items: Sequence, *, scale: float = 0.0, return_lse: bool = False,
               output_dtype: str = _tensors.F32, sink_logits=None,
               cache: Optional[str] = None, logit_softcap: float = 0.0) -> List[AttendResult]:
        """Fused attention for a batch of items: AttendItem or (sequence_id, layer,
        queries[, first_query_position]) tuples, queries [query_tokens,
        query_heads, head_dim] (or [query_heads, head_dim] for one token).
        Query token i of n sees the sequence's tokens [0, length - n + 1 + i);
        with first_query_position p, the stored tokens [0, min(length, p + i +
        1)) (a sliding-window layer: from p + i + 1 - window on; none seen:
        output 0, lse -inf). Returns one AttendResult per
        item, output in output_dtype ('f32' float32, 'f16' float16, 'bf16'
        uint16 bits). sink_logits: learned attention-sink logits [query_heads]
        (gpt-oss), one extra unscaled logit per head with a zero value.
        logit_softcap: Gemma 2's attn_logit_softcapping (0: none); each scaled
        logit x becomes cap * tanh(x / cap) before the softmax."""
        request, first = _messages.attend_request(self._cache(cache), items, scale, return_lse,
                                                  output_dtype, sink_logits, AttendItem,
                                                  logit_softcap)
        response, _, error = self._call(self._stub.Attend, request, first)
        if error is not None:
            raise error
        return _messages.attend_results(response, return_lse, AttendResult)

    def append_attend(self, layer: int, items: Sequence, *, scale: float = 0.0,
                      return_lse: bool = False,
                      output_dtype: str = _tensors.F32, sink_logits=None,
                      wire_dtype: Optional[str] = None,
                      cache: Optional[str] = None,
                      logit_softcap: float = 0.0) -> AppendAttendResult:
        """One layer of a decode step: stores each item's new tokens in `layer`
        and attends with their queries over everything the layer holds, them
        included (query i of an item sees positions [0, start_position + i]).

        items: AppendAttendItem or (sequence_id, start_position, keys
        [tokens, kv_heads, head_dim], values, queries [tokens, query_heads,
        head_dim][, do_not_create]); one token may drop its tokens axis. At most
        one item per sequence.

        A malformed call raises (InvalidArgument, NotFound for an unknown
        cache). Otherwise each item stands alone: its result's .error holds
        its NotFound / FailedPrecondition / ResourceExhausted (not raised) and
        the other items are stored and attended. Retried on UNAVAILABLE: an
        append that had landed is answered already_stored. logit_softcap as
        in attend."""
        request, first = _messages.append_attend_request(
            self._cache(cache), layer, items, scale, return_lse, output_dtype, sink_logits,
            wire_dtype, logit_softcap)
        response, _, error = self._call(self._stub.AppendAttend, request, first)
        if error is not None:
            raise error
        return _messages.append_attend_result(response, return_lse)

    def decode_stream(self, *, route_key: Optional[str] = None,
                      timeout: Optional[float] = None,
                      cache: Optional[str] = None) -> DecodeStream:
        """A DecodeStream: send()/recv() or step() one AppendAttend per layer
        over one bidirectional stream (tqkv/_stream.py has the contract). The
        stream opens at the first send, with the routing key `route_key` or
        else that of the first item's sequence id. timeout: a deadline for the
        whole stream in seconds (None: none; a decode loop is long-lived).
        Ends with close() or the with-block."""
        return DecodeStream(self._stub, self._cache(cache), self._metadata_for_key, route_key,
                            timeout, self.max_attempts, self.initial_backoff, self.max_backoff)

    def create_sequence(self, sequence_id: str, *, cache: Optional[str] = None) -> SequenceInfo:
        request = pb.CreateSequenceRequest(cache=self._cache(cache), sequence_id=sequence_id)
        response, attempts, error = self._call(self._stub.CreateSequence, request, sequence_id)
        if error is None:
            return SequenceInfo.from_proto(response)
        if isinstance(error, AlreadyExists) and attempts > 1:
            return self.get_sequence(sequence_id, cache=cache)
        raise error

    def fork(self, parent_id: str, child_id: str, *,
             cache: Optional[str] = None) -> SequenceInfo:
        """A child sharing the parent's tokens (pages shared copy-on-write)."""
        request = pb.ForkSequenceRequest(cache=self._cache(cache), parent_id=parent_id,
                                         child_id=child_id)
        response, attempts, error = self._call(self._stub.ForkSequence, request, parent_id)
        if error is None:
            return SequenceInfo.from_proto(response)
        if isinstance(error, AlreadyExists) and attempts > 1:
            return self.get_sequence(child_id, cache=cache)
        raise error

    def drop(self, sequence_id: str, *, cache: Optional[str] = None) -> None:
        request = pb.DropSequenceRequest(cache=self._cache(cache), sequence_id=sequence_id)
        _, attempts, error = self._call(self._stub.DropSequence, request, sequence_id)
        if error is None or (isinstance(error, NotFound) and attempts > 1):
            return
        raise error

    def get_sequence(self, sequence_id: str, *, cache: Optional[str] = None) -> SequenceInfo:
        request = pb.GetSequenceRequest(cache=self._cache(cache), sequence_id=sequence_id)
        response, _, error = self._call(self._stub.GetSequence, request, sequence_id)
        if error is not None:
            raise error
        return SequenceInfo.from_proto(response)

    def list_sequences(self, *, prefix: str = "", cache: Optional[str] = None) -> List[str]:
        """Every sequence id of the cache starting with `prefix`, in byte order
        (ListSequences, page by page; a tenant's token sees its namespace)."""
        ids: List[str] = []
        request = pb.ListSequencesRequest(cache=self._cache(cache), id_prefix=prefix, max_ids=10000)
        while True:
            response, _, error = self._call(self._stub.ListSequences, request, None)
            if error is not None:
                raise error
            ids.extend(response.sequence_ids)
            if not response.more or not response.sequence_ids:
                return ids
            request.start_after = ids[-1]

    def export_sequences(self, *, sequence_ids: Sequence[str] = (), prefix: str = "",
                         all: bool = False, cache: Optional[str] = None,
                         timeout: Optional[float] = None) -> Iterator["pb.ExportChunk"]:
        """ExportSequences: yields the stream's messages (a header, per sequence
        its state and pages, a trailer; docs/export_format.md). Feed them to
        import_sequences on another client to move the sequences."""
        request = pb.ExportRequest(cache=self._cache(cache), sequence_ids=list(sequence_ids),
                                   id_prefix=prefix, all=all)
        route = sequence_ids[0] if sequence_ids else (prefix or None)
        try:
            yield from self._stub.ExportSequences(request, timeout=timeout,
                                                  metadata=self._metadata(route))
        except grpc.RpcError as error:
            raise from_rpc_error(error)

    def import_sequences(self, chunks: Iterable["pb.ExportChunk"], *,
                         timeout: Optional[float] = None) -> "pb.ImportResponse":
        """ImportSequences from an export's messages (from export_sequences, or
        read back from storage). Each sequence lands whole or not at all."""
        try:
            return self._stub.ImportSequences(iter(chunks), timeout=timeout, metadata=self._auth)
        except grpc.RpcError as error:
            raise from_rpc_error(error)

    def pull_sequences(self, source: str, *, sequence_ids: Sequence[str] = (), prefix: str = "",
                       all: bool = False, source_auth_token: str = "", cache: Optional[str] = None,
                       target_cache: str = "", timeout: Optional[float] = None) -> "pb.ImportResponse":
        """PullSequences (admin token): this client's server exports from
        `source` (host:port) and imports the stream itself, with no relay."""
        request = pb.PullSequencesRequest(
            source=source, source_auth_token=source_auth_token, target_cache=target_cache,
            export_request=pb.ExportRequest(cache=self._cache(cache), sequence_ids=list(sequence_ids),
                                            id_prefix=prefix, all=all))
        try:
            return self._stub.PullSequences(request, timeout=timeout, metadata=self._auth)
        except grpc.RpcError as error:
            raise from_rpc_error(error)

    def save_snapshot(self) -> "pb.SaveSnapshotResponse":
        """SaveSnapshot (admin token): writes every sequence to the server's
        --data_dir now."""
        response, _, error = self._call(self._stub.SaveSnapshot, pb.SaveSnapshotRequest(), None)
        if error is not None:
            raise error
        return response

    def info(self) -> "pb.ServerInfo":
        """GetServerInfo: backend, device, caches (layout and usage), presets,
        kernel and rpc timings, as the tqkv.v1.ServerInfo message."""
        response, _, error = self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), None)
        if error is not None:
            raise error
        return response
