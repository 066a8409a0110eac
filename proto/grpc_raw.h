// The one file that touches gRPC's internal API (grpc::internal::), written
// against gRPC 1.51 (Debian bookworm's; checked below): raw-bytes calls on
// the KvCache methods, for the server's handlers and for the clients that
// relay messages without parsing them (moves, copies). Everything else in
// the tree uses gRPC's public API; a gRPC upgrade that changes these types
// breaks this file and nothing else.
//
//   - RawMethodHandler / NewRawBidiHandler: a callback bidi-streaming handler
//     over grpc::ByteBuffer (the server registers it with
//     grpc::Service::MarkMethodRawCallback, whose parameter type is internal);
//   - OpenRawServerStream / OpenRawClientStream: the client side of a
//     server-streaming or client-streaming method with raw-bytes messages.
//
// The method names are the full "/package.Service/Method" paths and must
// outlive the call (gRPC keeps the pointer: pass string literals); a stream
// returned here is used and finished as gRPC's own
// ClientReader / ClientWriter (Read/Finish, Write/WritesDone/Finish).
// Header only: service/ and client/cpp/ both include it.
#ifndef TQKV_PROTO_GRPC_RAW_H_
#define TQKV_PROTO_GRPC_RAW_H_

#include <functional>
#include <memory>

#include <google/protobuf/message.h>
#include <grpcpp/client_context.h>
#include <grpcpp/impl/codegen/server_callback_handlers.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/sync_stream.h>
#include <grpcpp/version_info.h>

static_assert(GRPC_CPP_VERSION_MAJOR == 1 && GRPC_CPP_VERSION_MINOR >= 51,
              "proto/grpc_raw.h is written against gRPC 1.51's internal API: check it against this version");

namespace tqkv {

using RawMethodHandler = grpc::internal::MethodHandler;
using RawBidiReactor = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

// A handler that runs factory(context) for each call (the caller owns the
// handler until it hands it to MarkMethodRawCallback).
inline RawMethodHandler* NewRawBidiHandler(std::function<RawBidiReactor*(grpc::CallbackServerContext*)> factory) {
  return new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(std::move(factory));
}

// Starts a server-streaming call of `method` with `request` as its message.
inline std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> OpenRawServerStream(
    grpc::ChannelInterface* channel, const char* method, grpc::ClientContext* context,
    const google::protobuf::Message& request) {
  const grpc::internal::RpcMethod rpc(method, grpc::internal::RpcMethod::SERVER_STREAMING);
  return std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>>(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel, rpc, context, request));
}

// Starts a client-streaming call of `method`; its one response lands in
// `response` when Finish() returns.
inline std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> OpenRawClientStream(grpc::ChannelInterface* channel,
                                                                                 const char* method,
                                                                                 grpc::ClientContext* context,
                                                                                 grpc::ByteBuffer* response) {
  const grpc::internal::RpcMethod rpc(method, grpc::internal::RpcMethod::CLIENT_STREAMING);
  return std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>>(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel, rpc, context, response));
}

}  // namespace tqkv

#endif  // TQKV_PROTO_GRPC_RAW_H_
