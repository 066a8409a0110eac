"""Typed errors: one exception class per canonical gRPC code.

Every error the client raises is a TqkvError carrying `.code` (a
grpc.StatusCode) and `.message` (the server's text, unchanged). Catch the
subclass for one code (tqkv.NotFound) or TqkvError for all. Client-side
argument checks (a shape that does not match, an unsupported dtype) raise
InvalidArgument before anything is sent; it is also a ValueError.
"""
import grpc


class TqkvError(Exception):
    """A failed call: the gRPC status code and the server's message."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __str__(self):
        return "%s: %s" % (self.code.name, self.message)


class Cancelled(TqkvError):
    code = grpc.StatusCode.CANCELLED


class Unknown(TqkvError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(TqkvError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(TqkvError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(TqkvError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TqkvError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TqkvError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(TqkvError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TqkvError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(TqkvError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(TqkvError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(TqkvError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TqkvError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(TqkvError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(TqkvError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(TqkvError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
    Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)}


def error_for(code, message):
    """The TqkvError subclass instance for a gRPC code."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return TqkvError(message, code)
    return cls(message)


def from_rpc_error(error):
    """Turns a grpc.RpcError into the matching TqkvError."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return error_for(code, details or "")
