"""tqkv: Python client for the tqkv KV-cache service (tqkv.v1.KvCache over gRPC).

    import numpy as np, tqkv
    with tqkv.Client("localhost:50051") as c:
        c.append("chat-1", keys, values)          # [layers, tokens, kv_heads, head_dim]
        out = c.attend([("chat-1", 5, q)])[0].output
        with c.decode_stream() as s:               # one AppendAttend per layer
            r = s.step(layer, [("chat-1", pos, k, v, q)])   # k, v [1, kv_heads, head_dim]

tqkv.aio.AsyncClient is the same over grpc.aio.
Arrays: float32, float16, or uint16 holding bfloat16 bits (to_bf16 / from_bf16).
Errors: TqkvError subclasses with .code (grpc.StatusCode) and .message.
The generated stubs are tqkv.v1.kvcache_pb2 / kvcache_pb2_grpc.
"""
from tqkv._errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                          FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                          PermissionDenied, ResourceExhausted, TqkvError, Unauthenticated,
                          Unavailable, Unimplemented, Unknown, error_for)
from tqkv._tensors import BF16, F16, F32, from_bf16, to_bf16
from tqkv.client import (ROUTE_KEY_HEADER, AppendAttendItem, AppendAttendItemResult,
                         AppendAttendResult, AppendResult, AttendItem, AttendResult, Chunk,
                         Client, DecodeStream, ScoreResult, SequenceInfo, route_key)

__version__ = "0.1.0"
