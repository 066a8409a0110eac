"""DecodeStream: an engine's decode loop on one bidirectional stream.

Each send() is one AppendAttend (one layer of one step, batched over the
sequences of the batch) and gets one response, in the order sent; recv()
returns the next one. The contract (proto/tqkv/v1/kvcache.proto, "DecodeStream:
ordering, flow control, errors, resuming") in client terms:

  * Order. Responses come in the order of the sends; each carries the
    request_id send() returned, and recv() checks it.
  * Pipelining. send() never waits: it queues the request, which gRPC writes
    as the server's flow control allows (the server reads a request only when
    at most 4 of its responses are waiting). What was sent and not yet
    answered is kept here until answered (that is what resume() resends), so
    the memory held is what the caller sent ahead.
  * Errors. A request the server refuses as a whole (a bad shape, an unknown
    cache, a full queue) makes recv() raise its TqkvError with .request_id
    set; the stream goes on and the next recv() returns the next response.
    Per-item errors (NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED) are
    in the result's items, not raised. An error that ends the stream
    (UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, UNAUTHENTICATED) is raised with
    .request_id None, and the unanswered requests stay queued for resume().
  * Resuming. Nothing but the cache's contents outlives a stream. resume()
    opens a new stream (with the same routing key) and resends every
    unanswered request in order: an append that had landed is recognized by
    its start position and answered already_stored, without being stored
    twice. recv() does this by itself when the stream ends with UNAVAILABLE,
    up to the client's max_attempts times in a row, with its backoff. That is
    idempotent as long as no later request for the same (sequence, layer) has
    landed after the unanswered one (a layer that holds more than
    start_position + tokens tokens answers FAILED_PRECONDITION); a decode loop,
    which sends layer l of step s+1 only after step s, never has that.
  * Routing. The tqkv-route-key header is sent at stream start: the route
    key given to decode_stream(), else that of the first item of the first
    request. Behind a router, a stream should carry only sequences that share
    that key.

Thread safety: one thread may send while another receives; resume(),
cancel() and close() may be called from either. The stream object is not
meant to be shared by more senders than that.
"""
import collections
import queue
import random
import threading
import time
from typing import List, Optional, Sequence

import grpc

from tqkv import _messages, _tensors
from tqkv._errors import FailedPrecondition, Internal, TqkvError, Unknown, from_rpc_error
from tqkv.v1 import kvcache_pb2 as pb

# Codes after which recv() reopens the stream on its own.
_RESUMABLE = (grpc.StatusCode.UNAVAILABLE,)


class _Book:
    """What a stream has sent and not yet had answered, in order, and how to
    match and parse answers. Shared by the blocking and the asyncio stream;
    not locked (the callers lock)."""

    def __init__(self, cache: str):
        self.cache = cache
        self.next_id = 1
        # (request_id, DecodeStreamRequest, return_lse), oldest first.
        self.unanswered = collections.deque()

    def add(self, layer, items, scale, return_lse, output_dtype, sink_logits, wire_dtype, cache,
            logit_softcap=0.0):
        """(request_id, message, first sequence id): a new request, recorded as
        unanswered."""
        step, first = _messages.append_attend_request(
            self.cache if cache is None else cache, layer, items, scale, return_lse,
            output_dtype, sink_logits, wire_dtype, logit_softcap)
        request_id = self.next_id
        self.next_id += 1
        message = pb.DecodeStreamRequest(request_id=request_id, step=step)
        self.unanswered.append((request_id, message, return_lse))
        return request_id, message, first

    def answer(self, response) -> "_messages.AppendAttendResult":
        """Matches a response to the oldest unanswered request; raises its
        call-level error (with .request_id) if it has one."""
        if not self.unanswered:
            raise Internal("the server sent response %d with no request unanswered"
                           % response.request_id)
        request_id, _, return_lse = self.unanswered[0]
        if response.request_id != request_id:
            raise Internal("the server answered request %d, want %d (responses come in "
                           "the order of the requests)" % (response.request_id, request_id))
        self.unanswered.popleft()
        error = _messages.error_from_code(response.code, response.message)
        if error is not None:
            error.request_id = request_id
            raise error
        return _messages.append_attend_result(response.step, return_lse, request_id)

    def messages(self):
        return [message for _, message, _ in self.unanswered]

    def ended_early(self):
        return Unknown("the server ended the stream with %d request(s) unanswered"
                       % len(self.unanswered))


def stream_error(error: grpc.RpcError) -> TqkvError:
    """The TqkvError for a stream that ended; .request_id None (no one request)."""
    out = from_rpc_error(error)
    out.request_id = None
    return out


def _requests(source: "queue.Queue"):
    """The request iterator gRPC's sending thread drains; None ends it."""
    while True:
        message = source.get()
        if message is None:
            return
        yield message


class DecodeStream:
    """A DecodeStream call and its unanswered requests. Made by
    Client.decode_stream(); see the module docstring for the contract.

        with client.decode_stream() as stream:
            for layer in range(layers):
                result = stream.step(layer, [(seq, pos, k, v, q)])
                out = result[0].output
    """

    def __init__(self, stub, cache, metadata_for, route_key_value, timeout, max_attempts,
                 initial_backoff, max_backoff):
        self._stub = stub
        self._book = _Book(cache)
        self._metadata_for = metadata_for  # route key (or None) -> call metadata
        self._route_key = route_key_value
        self._metadata = None              # fixed at the first send
        self._timeout = timeout
        self._max_attempts = max_attempts
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._lock = threading.Lock()
        self._call = None
        self._queue = None
        self._closed = False
        self._jitter = random.Random()
        self.resumes = 0  # streams reopened (by resume(), or by recv() on UNAVAILABLE)

    # -- sending and receiving -------------------------------------------

    def send(self, layer: int, items: Sequence, *, scale: float = 0.0, return_lse: bool = False,
             output_dtype: str = _tensors.F32, sink_logits=None,
             wire_dtype: Optional[str] = None, cache: Optional[str] = None,
             logit_softcap: float = 0.0) -> int:
        """Queues one AppendAttend of `layer` for `items` (AppendAttendItem or
        (sequence_id, start_position, keys, values, queries[, do_not_create]))
        and returns its request_id. Never waits for the server. Arguments as
        in Client.append_attend; InvalidArgument for a malformed item is raised
        here, before anything is sent."""
        with self._lock:
            if self._closed:
                raise FailedPrecondition("send on a closed decode stream")
            request_id, message, first = self._book.add(layer, items, scale, return_lse,
                                                        output_dtype, sink_logits, wire_dtype,
                                                        cache, logit_softcap)
            if self._call is None:
                key = (self._route_key if self._route_key is not None
                       else _messages.route_key(first))
                self._metadata = self._metadata_for(key)
                self._open([])
            self._queue.put(message)
            return request_id

    def recv(self) -> "_messages.AppendAttendResult":
        """The response to the oldest unanswered request. Raises that
        request's call-level error (TqkvError with .request_id; the stream goes
        on), or the error that ended the stream (.request_id None) when it
        cannot be resumed."""
        failures = 0
        backoff = self._initial_backoff
        while True:
            with self._lock:
                if not self._book.unanswered:
                    raise FailedPrecondition("recv with no request awaiting a response")
                call = self._call
            try:
                response = next(call)
            except StopIteration:
                raise self._book.ended_early()
            except grpc.RpcError as rpc_error:
                error = stream_error(rpc_error)
                with self._lock:
                    stale = call is not self._call  # resumed meanwhile by another thread
                if stale:
                    continue
                failures += 1
                if error.code not in _RESUMABLE or failures >= self._max_attempts:
                    raise error
                time.sleep(backoff * self._jitter.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self._max_backoff)
                self.resume()
                continue
            with self._lock:
                if call is not self._call:
                    continue  # an answer of a stream given up by resume(): resent since
                return self._book.answer(response)

    def step(self, layer: int, items: Sequence, **options) -> "_messages.AppendAttendResult":
        """send() then recv(): one layer of a decode step, waited for. Only
        with nothing else in flight (FailedPrecondition otherwise: recv() what
        was sent ahead first)."""
        if self._book.unanswered:
            raise FailedPrecondition("step with %d response(s) owed: recv() them first"
                                     % len(self._book.unanswered))
        self.send(layer, items, **options)
        return self.recv()

    @property
    def unanswered(self) -> List[int]:
        """request_ids sent and not yet answered, oldest first."""
        with self._lock:
            return [request_id for request_id, _, _ in self._book.unanswered]

    # -- the call ---------------------------------------------------------

    def _open(self, backlog):
        """A new call fed by a new queue holding `backlog` first. Lock held."""
        self._queue = queue.Queue()
        for message in backlog:
            self._queue.put(message)
        self._call = self._stub.DecodeStream(_requests(self._queue), metadata=self._metadata,
                                             timeout=self._timeout)

    def _end_call(self):
        """Cancels the current call and ends its request iterator. Lock held."""
        if self._call is not None:
            self._call.cancel()
            self._queue.put(None)

    def resume(self):
        """Gives up the current stream and opens a new one that resends every
        unanswered request, in order (appends that had landed answer
        already_stored). A no-op before the first send."""
        with self._lock:
            if self._closed:
                raise FailedPrecondition("resume on a closed decode stream")
            if self._call is None:
                return
            self._end_call()
            self._open(self._book.messages())
            self.resumes += 1

    def cancel(self):
        """Ends the stream at once (CANCELLED). Unanswered requests stay
        queued: resume() resends them. Requests the server had not read are
        not stored; those it had may be."""
        with self._lock:
            if self._call is not None:
                self._end_call()

    def close(self):
        """Half-closes the stream and waits for the server to answer what it
        was sent; those answers are dropped (their appends land: recv() them
        first to see them). Then the stream is closed for good."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            call = self._call
            if call is None:
                return
            self._queue.put(None)
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass  # the stream is over either way; nothing more to report
        with self._lock:
            self._book.unanswered.clear()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.cancel()
            with self._lock:
                self._closed = True
