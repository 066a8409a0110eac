"""tqkv.aio: the tqkv client over grpc.aio, for asyncio engines.

    async with tqkv.aio.AsyncClient("localhost:50051") as c:
        await c.append_stream("chat-1", [(k, v)])        # prefill, all layers
        async with c.decode_stream() as s:
            for layer in range(layers):
                r = await s.step(layer, [("chat-1", pos, k_l, v_l, q_l)])

The same calls, arguments, results, errors, retries and routing header as
tqkv.Client (client.py); every call is a coroutine. AsyncDecodeStream has the
shape and contract of tqkv.DecodeStream (_stream.py): send() queues and never
waits, recv() returns the responses in order, step() is both, resume()
reopens and resends the unanswered requests (recv() does it by itself on
UNAVAILABLE). A client and its streams belong to the event loop they were
created in.
"""
import asyncio
import random
from typing import Iterable, List, Optional, Sequence

import grpc
import grpc.aio
import numpy as np

from tqkv import _messages, _tensors
from tqkv._errors import (AlreadyExists, Cancelled, FailedPrecondition, InvalidArgument,
                          NotFound, TqkvError, from_rpc_error)
from tqkv._messages import AppendAttendResult, route_key
from tqkv._stream import _RESUMABLE, _Book, stream_error
from tqkv.client import (ROUTE_KEY_HEADER, AppendResult, AttendItem, AttendResult, ScoreResult,
                         SequenceInfo, _sendable_header_value, channel_options)
from tqkv.v1 import kvcache_pb2 as pb
from tqkv.v1 import kvcache_pb2_grpc as pb_grpc


class AsyncClient:
    """tqkv.Client over grpc.aio: the same constructor arguments (channel: a
    grpc.aio.Channel)."""

    def __init__(self, target: str = "localhost:50051", *, cache: str = "",
                 auth_token: Optional[str] = None, tls: bool = False,
                 root_certificates: Optional[bytes] = None,
                 server_name_override: Optional[str] = None, timeout: float = 60.0,
                 max_attempts: int = 4, initial_backoff: float = 0.05,
                 max_backoff: float = 2.0, max_message_bytes: int = 64 << 20,
                 channel: Optional[grpc.aio.Channel] = None):
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
                channel = grpc.aio.secure_channel(target, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(target, options=options)
        self._channel = channel
        self._stub = pb_grpc.KvCacheStub(channel)
        self._jitter = random.Random()

    async def close(self):
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # -- plumbing ---------------------------------------------------------

    def _metadata_for_key(self, key):
        if key is None or not _sendable_header_value(key):
            return self._auth
        return self._auth + ((ROUTE_KEY_HEADER, key),)

    def _metadata(self, sequence_id):
        return self._auth if sequence_id is None else self._metadata_for_key(
            route_key(sequence_id))

    def _cache(self, cache):
        return self.cache if cache is None else cache

    async def _call(self, method, request, sequence_id):
        """(response, attempts, error), retrying UNAVAILABLE like Client._call."""
        backoff = self.initial_backoff
        metadata = self._metadata(sequence_id)
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await method(request, timeout=self.timeout, metadata=metadata), attempt, None
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.max_attempts:
                    return None, attempt, from_rpc_error(error)
            await asyncio.sleep(backoff * self._jitter.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.max_backoff)
        raise AssertionError("unreachable")

    # -- rpcs (as in tqkv.Client) ------------------------------------------

    async def append(self, sequence_id: str, keys, values, *, start: int = 0,
                     layer_begin: int = 0, layer_end: int = 0, create: bool = True,
                     wire_dtype: Optional[str] = None,
                     cache: Optional[str] = None) -> AppendResult:
        request = _messages.append_request(self._cache(cache), sequence_id, keys, values, start,
                                           layer_begin, layer_end, create, wire_dtype)
        response, _, error = await self._call(self._stub.Append, request, sequence_id)
        if error is None:
            return AppendResult(SequenceInfo.from_proto(response.sequence),
                                response.stored_bytes, response.stored_bytes_bf16,
                                response.already_stored)
        raise error

    async def append_stream(self, sequence_id: str, chunks: Iterable, *, start: int = 0,
                            layer_begin: int = 0, layer_end: int = 0, create: bool = True,
                            wire_dtype: Optional[str] = None,
                            cache: Optional[str] = None) -> AppendResult:
        """chunks: an iterable (not async) of Chunk or (keys, values). Not retried."""
        state = {}

        def build(keys, values, position):
            return _messages.append_request(self._cache(cache), sequence_id, keys, values,
                                            position, layer_begin, layer_end, create,
                                            wire_dtype)

        try:
            response = await self._stub.AppendStream(
                _messages.chunk_requests(chunks, start, build, state), timeout=self.timeout,
                metadata=self._metadata(sequence_id))
        except grpc.RpcError as error:
            if "error" in state:
                raise state["error"]
            raise from_rpc_error(error)
        if "error" in state:
            raise state["error"]
        return AppendResult(SequenceInfo.from_proto(response.sequence), response.stored_bytes,
                            response.stored_bytes_bf16)

    async def score(self, sequence_id: str, layer: int, queries, *, token_begin: int = 0,
                    token_end: int = 0, scale: float = 0.0, top_k: int = 0,
                    cache: Optional[str] = None, logit_softcap: float = 0.0) -> ScoreResult:
        request = pb.ScoreQueryRequest(cache=self._cache(cache), sequence_id=sequence_id,
                                       layer=layer,
                                       queries=_tensors.encode("queries", queries, 2),
                                       token_begin=token_begin, token_end=token_end,
                                       scale=scale, top_k=top_k, logit_softcap=logit_softcap)
        response, _, error = await self._call(self._stub.ScoreQuery, request, sequence_id)
        if error is not None:
            raise error
        logits = _tensors.decode(response.logits)
        positions = None
        if top_k > 0:
            positions = np.asarray(response.positions, dtype=np.int64).reshape(logits.shape)
        return ScoreResult(logits, positions)

    async def attend(self, items: Sequence, *, scale: float = 0.0, return_lse: bool = False,
                     output_dtype: str = _tensors.F32, sink_logits=None,
                     cache: Optional[str] = None, logit_softcap: float = 0.0) -> List[AttendResult]:
        request, first = _messages.attend_request(self._cache(cache), items, scale, return_lse,
                                                  output_dtype, sink_logits, AttendItem,
                                                  logit_softcap)
        response, _, error = await self._call(self._stub.Attend, request, first)
        if error is not None:
            raise error
        return _messages.attend_results(response, return_lse, AttendResult)

    async def append_attend(self, layer: int, items: Sequence, *, scale: float = 0.0,
                            return_lse: bool = False, output_dtype: str = _tensors.F32,
                            sink_logits=None, wire_dtype: Optional[str] = None,
                            cache: Optional[str] = None,
                            logit_softcap: float = 0.0) -> AppendAttendResult:
        request, first = _messages.append_attend_request(
            self._cache(cache), layer, items, scale, return_lse, output_dtype, sink_logits,
            wire_dtype, logit_softcap)
        response, _, error = await self._call(self._stub.AppendAttend, request, first)
        if error is not None:
            raise error
        return _messages.append_attend_result(response, return_lse)

    async def create_sequence(self, sequence_id: str, *,
                              cache: Optional[str] = None) -> SequenceInfo:
        request = pb.CreateSequenceRequest(cache=self._cache(cache), sequence_id=sequence_id)
        response, attempts, error = await self._call(self._stub.CreateSequence, request,
                                                     sequence_id)
        if error is None:
            return SequenceInfo.from_proto(response)
        if isinstance(error, AlreadyExists) and attempts > 1:
            return await self.get_sequence(sequence_id, cache=cache)
        raise error

    async def fork(self, parent_id: str, child_id: str, *,
                   cache: Optional[str] = None) -> SequenceInfo:
        request = pb.ForkSequenceRequest(cache=self._cache(cache), parent_id=parent_id,
                                         child_id=child_id)
        response, attempts, error = await self._call(self._stub.ForkSequence, request,
                                                     parent_id)
        if error is None:
            return SequenceInfo.from_proto(response)
        if isinstance(error, AlreadyExists) and attempts > 1:
            return await self.get_sequence(child_id, cache=cache)
        raise error

    async def drop(self, sequence_id: str, *, cache: Optional[str] = None) -> None:
        request = pb.DropSequenceRequest(cache=self._cache(cache), sequence_id=sequence_id)
        _, attempts, error = await self._call(self._stub.DropSequence, request, sequence_id)
        if error is None or (isinstance(error, NotFound) and attempts > 1):
            return
        raise error

    async def get_sequence(self, sequence_id: str, *,
                           cache: Optional[str] = None) -> SequenceInfo:
        request = pb.GetSequenceRequest(cache=self._cache(cache), sequence_id=sequence_id)
        response, _, error = await self._call(self._stub.GetSequence, request, sequence_id)
        if error is not None:
            raise error
        return SequenceInfo.from_proto(response)

    async def info(self) -> "pb.ServerInfo":
        response, _, error = await self._call(self._stub.GetServerInfo,
                                              pb.GetServerInfoRequest(), None)
        if error is not None:
            raise error
        return response

    def decode_stream(self, *, route_key: Optional[str] = None,
                      timeout: Optional[float] = None,
                      cache: Optional[str] = None) -> "AsyncDecodeStream":
        """As Client.decode_stream; the stream opens at the first send."""
        return AsyncDecodeStream(self._stub, self._cache(cache), self._metadata_for_key,
                                 route_key, timeout, self.max_attempts, self.initial_backoff,
                                 self.max_backoff)


async def _requests(source: "asyncio.Queue"):
    """The request iterator grpc.aio's writer drains; None ends it."""
    while True:
        message = await source.get()
        if message is None:
            return
        yield message


class AsyncDecodeStream:
    """tqkv.DecodeStream over grpc.aio (the contract is in tqkv/_stream.py).
    Used from one event loop; send() may run in one task while recv() waits in
    another."""

    def __init__(self, stub, cache, metadata_for, route_key_value, timeout, max_attempts,
                 initial_backoff, max_backoff):
        self._stub = stub
        self._book = _Book(cache)
        self._metadata_for = metadata_for
        self._route_key = route_key_value
        self._metadata = None
        self._timeout = timeout
        self._max_attempts = max_attempts
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._call = None
        self._queue = None
        self._closed = False
        self._jitter = random.Random()
        self.resumes = 0

    async def send(self, layer: int, items: Sequence, *, scale: float = 0.0,
                   return_lse: bool = False, output_dtype: str = _tensors.F32,
                   sink_logits=None, wire_dtype: Optional[str] = None,
                   cache: Optional[str] = None, logit_softcap: float = 0.0) -> int:
        """Queues one AppendAttend; returns its request_id. Never waits for the
        server (a coroutine for symmetry with recv)."""
        if self._closed:
            raise FailedPrecondition("send on a closed decode stream")
        request_id, message, first = self._book.add(layer, items, scale, return_lse,
                                                    output_dtype, sink_logits, wire_dtype, cache,
                                                    logit_softcap)
        if self._call is None:
            key = self._route_key if self._route_key is not None else route_key(first)
            self._metadata = self._metadata_for(key)
            self._open([])
        self._queue.put_nowait(message)
        return request_id

    async def recv(self) -> AppendAttendResult:
        """The response to the oldest unanswered request (see DecodeStream.recv)."""
        failures = 0
        backoff = self._initial_backoff
        while True:
            if not self._book.unanswered:
                raise FailedPrecondition("recv with no request awaiting a response")
            call = self._call
            try:
                response = await call.read()
            except grpc.RpcError as rpc_error:
                error = stream_error(rpc_error)
                if call is not self._call:
                    continue
                failures += 1
                if error.code not in _RESUMABLE or failures >= self._max_attempts:
                    raise error
                await asyncio.sleep(backoff * self._jitter.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self._max_backoff)
                self.resume()
                continue
            except asyncio.CancelledError:
                # grpc.aio raises this from a read of a call cancelled here
                # (cancel(), resume()); a cancelled task raises it too.
                if not call.cancelled():
                    raise
                if call is not self._call:
                    continue
                error = Cancelled("the decode stream was cancelled")
                error.request_id = None
                raise error
            if call is not self._call:
                continue
            if response is grpc.aio.EOF:
                raise self._book.ended_early()
            return self._book.answer(response)

    async def step(self, layer: int, items: Sequence, **options) -> AppendAttendResult:
        """send() then recv(), with nothing else in flight."""
        if self._book.unanswered:
            raise FailedPrecondition("step with %d response(s) owed: recv() them first"
                                     % len(self._book.unanswered))
        await self.send(layer, items, **options)
        return await self.recv()

    @property
    def unanswered(self) -> List[int]:
        return [request_id for request_id, _, _ in self._book.unanswered]

    def _open(self, backlog):
        self._queue = asyncio.Queue()
        for message in backlog:
            self._queue.put_nowait(message)
        self._call = self._stub.DecodeStream(_requests(self._queue), metadata=self._metadata,
                                             timeout=self._timeout)

    def _end_call(self):
        if self._call is not None:
            self._call.cancel()
            self._queue.put_nowait(None)

    def resume(self):
        """Opens a new stream that resends every unanswered request, in order."""
        if self._closed:
            raise FailedPrecondition("resume on a closed decode stream")
        if self._call is None:
            return
        self._end_call()
        self._open(self._book.messages())
        self.resumes += 1

    def cancel(self):
        """Ends the stream at once; unanswered requests stay for resume()."""
        if self._call is not None:
            self._end_call()

    async def close(self):
        """Half-closes and waits for the server to answer what it was sent;
        those answers are dropped."""
        if self._closed:
            return
        self._closed = True
        if self._call is None:
            return
        self._queue.put_nowait(None)
        try:
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        self._book.unanswered.clear()

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb):
        if exc_type is None:
            await self.close()
        else:
            self.cancel()
            self._closed = True

