"""Fixtures: a real tqkv-server on a loopback port with small caches.

The server binary is $TQKV_SERVER (ctest sets it) or build/bin/tqkv-server.
Every server is started with --port 0 and killed when its fixture ends.
"""
import os
import pathlib
import shutil
import subprocess

# Single-threaded BLAS before anything imports numpy: the model passes here
# (tools/quality, examples/generate.py) are many small products, and a
# threaded BLAS on a shared 2-core machine spins (tools/quality sets the same,
# but only takes effect when it imports numpy first). Set them to override.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

import tqkv  # noqa: E402
from tqkv.testing import LocalServer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]

# default: lossless fp16 (exact references); tq: a compressed preset with one
# fp16 boundary layer; tiny: 4 pages of 8 tokens, to hit RESOURCE_EXHAUSTED.
CONFIG = """
caches {
  name: "default" num_layers: 4 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
  page_tokens: 8 preset: "fp16" boundary_layers: 0 memory_budget_bytes: 8388608
}
caches {
  name: "tq" num_layers: 4 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
  page_tokens: 8 preset: "turboquant_k3v4_nc" boundary_layers: 1 memory_budget_bytes: 8388608
}
caches {
  name: "tiny" num_layers: 4 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
  page_tokens: 8 preset: "fp16" boundary_layers: 0 memory_budget_bytes: 65536
}
"""


def server_binary():
    path = os.environ.get("TQKV_SERVER") or str(ROOT / "build" / "bin" / "tqkv-server")
    if not os.path.exists(path):
        pytest.fail("tqkv-server not found at %s (build first, or set TQKV_SERVER)" % path)
    return path


@pytest.fixture(scope="session")
def server():
    with LocalServer(server_binary(), CONFIG) as s:
        yield s


@pytest.fixture
def client(server):
    with server.client(timeout=20.0) as c:
        yield c


@pytest.fixture(scope="session")
def secure_server(tmp_path_factory):
    """TLS (self-signed 'localhost' certificate) and bearer-token auth."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True, timeout=60)
    (d / "tokens").write_text("# tokens\nsecret-token\n")
    args = ["--tls_cert_file", str(d / "cert.pem"), "--tls_key_file", str(d / "key.pem"),
            "--auth_token_file", str(d / "tokens")]
    with LocalServer(server_binary(), CONFIG, args=args) as s:
        s.root_certificates = (d / "cert.pem").read_bytes()
        yield s
