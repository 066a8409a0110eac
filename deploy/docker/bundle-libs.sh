#!/usr/bin/env bash
# Copies binaries and the shared libraries they load into one prefix, for a
# runtime image that has none of the -dev packages: PREFIX/bin and PREFIX/lib.
# Left out: the C library family (the runtime base has the same one) and the
# NVIDIA driver libraries (the container runtime mounts the host's).
# Usage: bundle-libs.sh PREFIX BINARY...
set -euo pipefail
prefix=$1; shift
mkdir -p "$prefix/bin" "$prefix/lib"
cp "$@" "$prefix/bin/"
missing=$(ldd "$@" | awk '/=> not found/ { print $1 }' | sort -u)
if [ -n "$missing" ]; then echo "bundle-libs: unresolved libraries: $missing" >&2; exit 1; fi
ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux[^/]*)\.so|/lib(cuda|nvidia-[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$prefix/lib/"; done
echo "bundle-libs: $(ls "$prefix/bin" | wc -l) binaries, $(ls "$prefix/lib" | wc -l) libraries in $prefix"
