// Small status-propagation macros. The abseil in Debian bookworm (20220623) has
// no public status macros, so tqkv keeps its own two.
#ifndef TQKV_BASE_STATUS_MACROS_H_
#define TQKV_BASE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TQKV_CONCAT_INNER_(a, b) a##b
#define TQKV_CONCAT_(a, b) TQKV_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if
// it is not OK.
#define RETURN_IF_ERROR(expr)                    \
  do {                                           \
    ::absl::Status tqkv_status_ = (expr);        \
    if (!tqkv_status_.ok()) return tqkv_status_; \
  } while (false)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on
// error returns its status, otherwise moves the value into `lhs`, which may be
// a declaration ("auto x") or an existing variable.
#define ASSIGN_OR_RETURN(lhs, expr) TQKV_ASSIGN_OR_RETURN_IMPL_(TQKV_CONCAT_(tqkv_statusor_, __LINE__), lhs, expr)

#define TQKV_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                \
  if (!statusor.ok()) return statusor.status();          \
  lhs = std::move(statusor).value()

#endif  // TQKV_BASE_STATUS_MACROS_H_
