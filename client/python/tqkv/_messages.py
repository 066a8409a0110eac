"""Request building and response parsing shared by tqkv.Client and tqkv.aio.

Nothing here talks to the network: every function turns numpy arrays into a
tqkv.v1 message or a message into result objects, and raises InvalidArgument
(before anything is sent) for arguments the server would refuse for their
shape alone.
"""
import hashlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import grpc
import numpy as np

from tqkv import _tensors
from tqkv._errors import InvalidArgument, TqkvError, error_for
from tqkv.v1 import kvcache_pb2 as pb

# grpc.StatusCode by its integer value (the wire form of AppendAttendItemResult.code).
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def route_key(sequence_id: str) -> str:
    """The routing key of a sequence id: its text before the first '/', or the
    whole id when it has none ("user7/chat3" -> "user7")."""
    return sequence_id.split("/", 1)[0]


def status_code(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of an integer code (UNKNOWN for a value gRPC lacks)."""
    return _STATUS_BY_VALUE.get(int(value), grpc.StatusCode.UNKNOWN)


def error_from_code(value: int, message: str) -> Optional[TqkvError]:
    """None for 0 (OK), else the TqkvError subclass instance for the code."""
    if value == 0:
        return None
    return error_for(status_code(value), message)


@dataclass
class AppendAttendItem:
    """One sequence of an append_attend (or a decode stream step): its new
    tokens for the call's layer and one query per new token.

    keys, values: [tokens, kv_heads, head_dim] (or [kv_heads, head_dim] for one
    token); queries: [tokens, query_heads, head_dim] (or [query_heads,
    head_dim]). start_position must equal the layer's current length for this
    sequence (or the length after this very append: a retry that landed is
    answered already_stored)."""
    sequence_id: str
    start_position: int
    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    do_not_create: bool = False


@dataclass
class AppendAttendItemResult:
    """One item's outcome. error is None when the item was stored (or had
    already been) and attended; otherwise the TqkvError subclass instance for
    the item's code (NotFound, FailedPrecondition, ResourceExhausted), not
    raised: the other items of the call went through."""
    output: Optional[np.ndarray] = None  # [tokens, query_heads, head_dim] in output_dtype
    lse: Optional[np.ndarray] = None     # float32 [tokens, query_heads] with return_lse
    layer_tokens: int = 0                # tokens the layer holds after the call
    already_stored: bool = False         # the append had landed before; nothing stored again
    error: Optional[TqkvError] = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class AppendAttendResult:
    """The result of one append_attend, or of one decode stream request: one
    AppendAttendItemResult per item, in order (indexable and iterable like a
    list), and the bytes the call stored over its OK items."""
    items: List[AppendAttendItemResult] = field(default_factory=list)
    stored_bytes: int = 0       # the change to the sequences' bytes as the pool counts them
    stored_bytes_bf16: int = 0  # the same for their tokens in bf16 (0 for already_stored items)
    request_id: Optional[int] = None  # the decode stream request it answers (None: unary)

    def __getitem__(self, index):
        return self.items[index]

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def output_dtype_proto(output_dtype) -> int:
    return _tensors._PROTO[_tensors.dtype_name(output_dtype)]


def sink_tensor(sink_logits) -> Optional["pb.Tensor"]:
    """f32 [query_heads] Tensor of learned sink logits, or None."""
    if sink_logits is None:
        return None
    return _tensors.encode("sink_logits", np.asarray(sink_logits, dtype=np.float32), 1)


def _token_axis(name, array, ndim, index, wire_dtype=None):
    """Tensor of `ndim` dims; one token given without its axis gets one."""
    a = np.asarray(array)
    if a.ndim == ndim - 1:
        a = a[None]
    try:
        return _tensors.encode(name, a, ndim, wire_dtype)
    except InvalidArgument as error:
        raise InvalidArgument("item %d: %s" % (index, error.message))


def append_request(cache, sequence_id, keys, values, start, layer_begin, layer_end, create,
                   wire_dtype):
    k = _tensors.encode("keys", keys, 4, wire_dtype)
    v = _tensors.encode("values", values, 4, wire_dtype)
    if list(k.shape) != list(v.shape):
        raise InvalidArgument("values are %s, want the keys' shape %s"
                              % (list(v.shape), list(k.shape)))
    return pb.AppendRequest(cache=cache, sequence_id=sequence_id, start_position=start,
                            layer_begin=layer_begin, layer_end=layer_end, keys=k, values=v,
                            do_not_create=not create,
                            request_id=content_request_id(sequence_id, start, layer_begin,
                                                          layer_end, k, v))


def content_request_id(sequence_id, start, layer_begin, layer_end, keys, values) -> str:
    """The default idempotency key of an append (AppendRequest.request_id): a
    hash of what it appends, so that a resend of the same append (a retry, or
    the caller sending it again) carries the same key and another writer's
    append at the same position does not."""
    h = hashlib.blake2b(digest_size=8)
    h.update(("%s\0%d\0%d\0%d\0%d\0" % (sequence_id, start, layer_begin, layer_end,
                                           keys.dtype)).encode("utf-8", "surrogatepass"))
    h.update(keys.data)
    h.update(values.data)
    return "p" + h.hexdigest()


@dataclass
class Chunk:
    """One message of append_stream: K/V [layers, tokens, kv_heads, head_dim]."""
    keys: np.ndarray
    values: np.ndarray
    start: Optional[int] = None  # None: right after the previous chunk


def chunk_requests(chunks, start, build, state):
    """AppendRequests of append_stream's chunks (Chunk or (keys, values)), start
    positions advancing from `start`; build(keys, values, position) makes one.
    A chunk the client refuses ends the iteration with state["error"] set (the
    stream then ends, keeping what was sent)."""
    position = start
    for index, chunk in enumerate(chunks):
        if isinstance(chunk, Chunk):
            keys, values, at = chunk.keys, chunk.values, chunk.start
        else:
            keys, values = chunk
            at = None
        if at is not None:
            position = at
        try:
            request = build(keys, values, position)
        except InvalidArgument as error:
            state["error"] = InvalidArgument("chunk %d: %s" % (index, error.message))
            return
        position += int(request.keys.shape[1])
        yield request


def attend_request(cache, items, scale, return_lse, output_dtype, sink_logits, item_type,
                   logit_softcap=0.0):
    """(AttendRequest, first item's sequence id)."""
    if not items:
        raise InvalidArgument("attend needs at least one item")
    request = pb.AttendRequest(cache=cache, scale=scale, return_lse=return_lse,
                               output_dtype=output_dtype_proto(output_dtype),
                               logit_softcap=logit_softcap)
    sink = sink_tensor(sink_logits)
    if sink is not None:
        request.sink_logits.CopyFrom(sink)
    for index, item in enumerate(items):
        if not isinstance(item, item_type):
            item = item_type(*item)
        added = request.items.add(sequence_id=item.sequence_id, layer=item.layer,
                                  queries=_token_axis("queries", item.queries, 3, index))
        if item.first_query_position is not None:
            added.first_query_position = int(item.first_query_position)
    return request, request.items[0].sequence_id


def append_attend_request(cache, layer, items: Sequence, scale=0.0, return_lse=False,
                          output_dtype=_tensors.F32, sink_logits=None, wire_dtype=None,
                          logit_softcap=0.0):
    """(AppendAttendRequest, first item's sequence id). items: AppendAttendItem
    or (sequence_id, start_position, keys, values, queries[, do_not_create])."""
    if not items:
        raise InvalidArgument("append_attend needs at least one item")
    request = pb.AppendAttendRequest(cache=cache, layer=layer, scale=scale,
                                     return_lse=return_lse,
                                     output_dtype=output_dtype_proto(output_dtype),
                                     logit_softcap=logit_softcap)
    sink = sink_tensor(sink_logits)
    if sink is not None:
        request.sink_logits.CopyFrom(sink)
    for index, item in enumerate(items):
        if not isinstance(item, AppendAttendItem):
            item = AppendAttendItem(*item)
        k = _token_axis("keys", item.keys, 3, index, wire_dtype)
        v = _token_axis("values", item.values, 3, index, wire_dtype)
        if list(k.shape) != list(v.shape):
            raise InvalidArgument("item %d: values are %s, want the keys' shape %s"
                                  % (index, list(v.shape), list(k.shape)))
        q = _token_axis("queries", item.queries, 3, index)
        if q.shape[0] != k.shape[0]:
            raise InvalidArgument("item %d: %d query tokens for %d new tokens, want one "
                                  "query per new token" % (index, q.shape[0], k.shape[0]))
        request.items.add(sequence_id=item.sequence_id, start_position=item.start_position,
                          keys=k, values=v, queries=q, do_not_create=item.do_not_create,
                          request_id=content_request_id(item.sequence_id, item.start_position,
                                                        layer, layer + 1, k, v))
    return request, request.items[0].sequence_id


def attend_results(response, return_lse, result_type):
    return [result_type(_tensors.decode(r.output),
                        _tensors.decode(r.lse) if return_lse else None)
            for r in response.results]


def append_attend_result(response, return_lse, request_id=None) -> AppendAttendResult:
    """AppendAttendResult of an AppendAttendResponse."""
    items = []
    for r in response.results:
        error = error_from_code(r.code, r.message)
        if error is not None:
            items.append(AppendAttendItemResult(error=error))
            continue
        items.append(AppendAttendItemResult(
            output=_tensors.decode(r.output),
            lse=_tensors.decode(r.lse) if return_lse else None,
            layer_tokens=int(r.layer_tokens), already_stored=bool(r.already_stored)))
    return AppendAttendResult(items, int(response.stored_bytes),
                              int(response.stored_bytes_bf16), request_id)
