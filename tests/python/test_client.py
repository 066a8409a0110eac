"""tqkv.Client against a real tqkv-server: every call, dtypes, error codes,
state unchanged after a failed call, retries, sharding header, auth and TLS."""
import os
import threading
import time
import uuid

import grpc
import numpy as np
import pytest

import tqkv
from tqkv.testing import LocalServer

LAYERS, KV_HEADS, Q_HEADS, D = 4, 2, 4, 64


def kv(tokens, seed, layers=LAYERS):
    rng = np.random.default_rng(seed)
    shape = (layers, tokens, KV_HEADS, D)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def queries(tokens, seed):
    return np.random.default_rng(seed).standard_normal((tokens, Q_HEADS, D)).astype(np.float32)


def new_id(prefix="user"):
    return "%s/%s" % (prefix, uuid.uuid4().hex[:12])


def reference_attention(k, v, q, scale=None):
    """float64 causal GQA attention of q [n, Q_HEADS, D] over one layer's
    k, v [T, KV_HEADS, D]; query token i sees tokens [0, T - n + 1 + i)."""
    k = k.astype(np.float64)
    v = v.astype(np.float64)
    q = q.astype(np.float64)
    n, t = q.shape[0], k.shape[0]
    scale = scale or 1.0 / np.sqrt(D)
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    group = Q_HEADS // KV_HEADS
    for i in range(n):
        visible = t - n + 1 + i
        for h in range(Q_HEADS):
            logits = k[:visible, h // group] @ q[i, h] * scale
            m = logits.max()
            w = np.exp(logits - m)
            out[i, h] = w @ v[:visible, h // group] / w.sum()
            lse[i, h] = m + np.log(w.sum())
    return out, lse


def fp16(x):
    return x.astype(np.float16).astype(np.float32)


def test_route_key():
    assert tqkv.route_key("user7/chat3") == "user7"
    assert tqkv.route_key("user7/chat3/branch") == "user7"
    assert tqkv.route_key("plain") == "plain"
    assert tqkv.route_key("/leading") == ""
    assert tqkv.ROUTE_KEY_HEADER == "tqkv-route-key"


def test_info_reports_caches_and_presets(client):
    info = client.info()
    assert info.backend == "cpu"
    names = [c.config.name for c in info.caches]
    assert names == ["default", "tq", "tiny"]
    cfg = info.caches[0].config
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.num_query_heads, cfg.head_dim) == (4, 2, 4, 64)
    presets = {p.name: p.bytes_per_token_head for p in info.presets}
    assert presets["turboquant_3bit_nc"] == 102 and presets["fp16"] == 512


def test_append_attend_matches_exact_attention_on_fp16_cache(client):
    sid = new_id()
    k, v = kv(20, 1)
    result = client.append(sid, k, v)
    assert result.sequence.layer_tokens == [20] * LAYERS
    assert result.stored_bytes > 0 and result.stored_bytes_bf16 == LAYERS * 20 * KV_HEADS * D * 4
    q = queries(3, 2)
    out = client.attend([(sid, 2, q)], return_lse=True)
    assert len(out) == 1
    assert out[0].output.dtype == np.float32 and out[0].output.shape == (3, Q_HEADS, D)
    want, want_lse = reference_attention(fp16(k[2]), fp16(v[2]), q)
    np.testing.assert_allclose(out[0].output, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(out[0].lse, want_lse, atol=2e-5, rtol=1e-5)
    # One query token as [query_heads, head_dim]; a batch of items over layers.
    outs = client.attend([tqkv.AttendItem(sid, 0, q[-1]), (sid, 3, q[-1:])])
    np.testing.assert_allclose(outs[0].output[0], reference_attention(fp16(k[0]), fp16(v[0]),
                                                                      q[-1:])[0][0], atol=2e-5)
    np.testing.assert_allclose(outs[1].output, reference_attention(fp16(k[3]), fp16(v[3]),
                                                                   q[-1:])[0], atol=2e-5)
    client.drop(sid)


def test_placed_queries_read_a_stored_prefix_for_a_prefill_merged_by_lse(client):
    """A prefill of 6 new tokens over a stored 20-token prefix: the server's
    share (first_query_position = 20, nothing appended) merged by lse with
    the new tokens' own causal attention equals attention over all 26."""
    sid = new_id()
    k, v = kv(26, 5)
    client.append(sid, k[:, :20], v[:, :20])
    q = queries(6, 6)
    prefix = client.attend([tqkv.AttendItem(sid, 1, q, first_query_position=20)],
                           return_lse=True)[0]
    own, own_lse = reference_attention(k[1, 20:], v[1, 20:], q)
    top = np.maximum(prefix.lse, own_lse)
    a, b = np.exp(prefix.lse - top), np.exp(own_lse - top)
    merged = (prefix.output * a[..., None] + own * b[..., None]) / (a + b)[..., None]
    whole = np.concatenate([fp16(k[1, :20]), k[1, 20:]])
    want, _ = reference_attention(whole, np.concatenate([fp16(v[1, :20]), v[1, 20:]]), q)
    np.testing.assert_allclose(merged, want, atol=3e-5, rtol=1e-4)
    # The same queries placed as the default places them: the same answer.
    last = client.attend([(sid, 1, q[-4:], 16)])[0].output
    np.testing.assert_allclose(last, client.attend([(sid, 1, q[-4:])])[0].output, atol=0)
    with pytest.raises(tqkv.InvalidArgument, match="first_query_position"):
        client.attend([(sid, 1, q, -1)])
    assert client.get_sequence(sid).layer_tokens == [20] * LAYERS
    client.drop(sid)


def test_wire_dtypes_f16_and_bf16_store_what_they_carry(client):
    k, v = kv(9, 3)
    q = queries(1, 4)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    a, b = new_id(), new_id()
    client.append(a, k16, v16)                                 # f16 on the wire
    client.append(b, k16.astype(np.float32), v16.astype(np.float32))  # same numbers as f32
    out_a = client.attend([(a, 1, q)])[0].output
    out_b = client.attend([(b, 1, q)])[0].output
    np.testing.assert_array_equal(out_a, out_b)

    kb, vb = tqkv.to_bf16(k), tqkv.to_bf16(v)
    assert kb.dtype == np.uint16
    c, e = new_id(), new_id()
    client.append(c, kb, vb)                                    # bf16 bits on the wire
    client.append(e, tqkv.from_bf16(kb), tqkv.from_bf16(vb))    # same numbers as f32
    np.testing.assert_array_equal(client.attend([(c, 1, q)])[0].output,
                                  client.attend([(e, 1, q)])[0].output)
    f, g = new_id(), new_id()
    client.append(f, k, v, wire_dtype="bf16")                   # converted by the client
    client.append(g, k, v, wire_dtype="f16")
    np.testing.assert_array_equal(client.attend([(f, 1, q)])[0].output,
                                  client.attend([(c, 1, q)])[0].output)
    np.testing.assert_array_equal(client.attend([(g, 1, q)])[0].output, out_a)

    # Output dtypes.
    out16 = client.attend([(a, 1, q)], output_dtype="f16")[0].output
    assert out16.dtype == np.float16
    np.testing.assert_allclose(out16.astype(np.float32), out_a, atol=2e-3, rtol=2e-3)
    outbf = client.attend([(a, 1, q)], output_dtype=tqkv.BF16)[0].output
    assert outbf.dtype == np.uint16
    np.testing.assert_allclose(tqkv.from_bf16(outbf), out_a, atol=1e-2, rtol=1e-2)
    for sid in (a, b, c, e, f, g):
        client.drop(sid)


def test_bf16_helpers_round_to_nearest_even():
    x = np.array([1.0, -2.5, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, np.inf, 0.0], dtype=np.float32)
    got = tqkv.from_bf16(tqkv.to_bf16(x))
    np.testing.assert_array_equal(got, [1.0, -2.5, 1.0, 1.0 + 2 ** -6, np.inf, 0.0])
    assert np.isnan(tqkv.from_bf16(tqkv.to_bf16(np.array([np.nan], np.float32))))[0]


def test_score_full_top_k_and_range(client):
    sid = new_id()
    k, v = kv(30, 5)
    client.append(sid, k, v)
    q = queries(1, 6)[0]
    full = client.score(sid, 1, q)
    assert full.positions is None and full.logits.shape == (Q_HEADS, 30)
    group = Q_HEADS // KV_HEADS
    want = np.stack([fp16(k[1])[:, h // group].astype(np.float64) @ q[h] for h in range(Q_HEADS)])
    want /= np.sqrt(D)
    np.testing.assert_allclose(full.logits, want, atol=1e-4, rtol=1e-5)
    top = client.score(sid, 1, q, top_k=5)
    assert top.logits.shape == (Q_HEADS, 5) and top.positions.shape == (Q_HEADS, 5)
    np.testing.assert_array_equal(top.positions, np.argsort(-want, axis=1, kind="stable")[:, :5])
    part = client.score(sid, 1, q, token_begin=10, token_end=20, scale=0.5)
    np.testing.assert_allclose(part.logits, want[:, 10:20] * np.sqrt(D) * 0.5, atol=1e-4,
                               rtol=1e-5)
    with pytest.raises(tqkv.OutOfRange) as e:
        client.score(sid, 1, q, token_begin=10, token_end=31)
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    client.drop(sid)


def test_append_stream_equals_one_append_and_keeps_chunks_before_a_failure(client):
    k, v = kv(25, 7)
    q = queries(2, 8)
    one, streamed = new_id(), new_id()
    client.append(one, k, v)
    r = client.append_stream(streamed, [(k[:, :10], v[:, :10]), (k[:, 10:16], v[:, 10:16]),
                                        tqkv.Chunk(k[:, 16:], v[:, 16:])])
    assert r.sequence.layer_tokens == [25] * LAYERS and r.stored_bytes > 0
    np.testing.assert_array_equal(client.attend([(one, 3, q)])[0].output,
                                  client.attend([(streamed, 3, q)])[0].output)
    broken = new_id()
    with pytest.raises(tqkv.FailedPrecondition) as e:
        client.append_stream(broken, [(k[:, :10], v[:, :10]),
                                      tqkv.Chunk(k[:, 10:], v[:, 10:], start=12)])
    assert "chunk 1" in e.value.message
    assert client.get_sequence(broken).layer_tokens == [10] * LAYERS
    # A client-side check stops the stream; what was sent stays stored.
    with pytest.raises(tqkv.InvalidArgument) as e:
        client.append_stream(new_id(), [(k[:, :10], v[:, :10]), (k[:, 10:], v[:, 10:11])])
    assert "chunk 1" in e.value.message
    for sid in (one, streamed, broken):
        client.drop(sid)


def test_lifecycle_create_get_fork_drop(client):
    parent = new_id("tenant")
    info = client.create_sequence(parent)
    assert info.layer_tokens == [0] * LAYERS and info.sequence_id == parent
    k, v = kv(12, 9)
    client.append(parent, k, v)
    child = parent + "-child"
    forked = client.fork(parent, child)
    assert forked.layer_tokens == [12] * LAYERS
    k2, v2 = kv(3, 10)
    client.append(child, k2, v2, start=12)
    assert client.get_sequence(child).layer_tokens == [15] * LAYERS
    assert client.get_sequence(parent).layer_tokens == [12] * LAYERS
    q = queries(1, 11)
    np.testing.assert_allclose(
        client.attend([(child, 0, q)])[0].output,
        reference_attention(fp16(np.concatenate([k[0], k2[0]])),
                            fp16(np.concatenate([v[0], v2[0]])), q)[0], atol=2e-5)
    client.drop(parent)
    with pytest.raises(tqkv.NotFound):
        client.get_sequence(parent)
    assert client.get_sequence(child).layer_tokens == [15] * LAYERS  # shared pages survive
    client.drop(child)


def snapshot(client, sid, q, cache=None):
    return (client.get_sequence(sid, cache=cache).layer_tokens,
            client.attend([(sid, 1, q)], cache=cache)[0].output)


def assert_unchanged(client, sid, q, before, cache=None):
    tokens, output = snapshot(client, sid, q, cache)
    assert tokens == before[0]
    np.testing.assert_array_equal(output, before[1])


def test_failed_calls_raise_typed_errors_and_change_nothing(client):
    sid = new_id()
    k, v = kv(10, 12)
    client.append(sid, k, v)
    q = queries(1, 13)
    before = snapshot(client, sid, q)

    again = client.append(sid, k, v, start=0)                # the same append resent: stored once
    assert again.already_stored and again.stored_bytes == 0
    assert_unchanged(client, sid, q, before)
    k_other, v_other = kv(10, 14)
    with pytest.raises(tqkv.FailedPrecondition) as e:        # another append at a taken position
        client.append(sid, k_other, v_other, start=0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and isinstance(e.value, tqkv.TqkvError)
    assert_unchanged(client, sid, q, before)

    bad = k.copy()
    bad[1, 2, 0, 5] = np.nan
    with pytest.raises(tqkv.InvalidArgument) as e:            # NaN
        client.append(sid, bad, v, start=10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert_unchanged(client, sid, q, before)

    wrong_heads = np.zeros((LAYERS, 2, 3, D), np.float32)
    with pytest.raises(tqkv.InvalidArgument):                 # 3 kv heads, want 2
        client.append(sid, wrong_heads, wrong_heads, start=10)
    with pytest.raises(tqkv.InvalidArgument):                 # layer range beyond 4 layers
        client.append(sid, k[:2], v[:2], start=10, layer_begin=3, layer_end=5)
    with pytest.raises(tqkv.InvalidArgument):                 # layer beyond the cache
        client.attend([(sid, 4, q)])
    with pytest.raises(tqkv.InvalidArgument):                 # wrong query heads
        client.attend([(sid, 0, np.zeros((1, 3, D), np.float32))])
    assert_unchanged(client, sid, q, before)

    with pytest.raises(tqkv.InvalidArgument) as e:            # client-side: shapes differ
        client.append(sid, k, v[:, :5], start=10)
    assert isinstance(e.value, ValueError)
    with pytest.raises(tqkv.InvalidArgument):                 # client-side: int dtype
        client.append(sid, k.astype(np.int32), v.astype(np.int32), start=10)
    with pytest.raises(tqkv.InvalidArgument):
        client.attend([])

    with pytest.raises(tqkv.AlreadyExists):
        client.create_sequence(sid)
    other = new_id()
    client.create_sequence(other)
    with pytest.raises(tqkv.AlreadyExists):
        client.fork(sid, other)
    assert client.get_sequence(other).layer_tokens == [0] * LAYERS
    assert_unchanged(client, sid, q, before)

    missing = new_id()
    for call in (lambda: client.get_sequence(missing), lambda: client.drop(missing),
                 lambda: client.attend([(missing, 0, q)]),
                 lambda: client.score(missing, 0, q[0]),
                 lambda: client.fork(missing, new_id()),
                 lambda: client.append(missing, k, v, create=False),
                 lambda: client.get_sequence(sid, cache="no-such-cache")):
        with pytest.raises(tqkv.NotFound) as e:
            call()
        assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.message
    with pytest.raises(tqkv.NotFound):
        client.get_sequence(missing)                          # append create=False made nothing
    client.drop(sid)
    client.drop(other)


def test_full_pool_is_resource_exhausted_and_changes_nothing(client):
    sid = new_id()
    k, v = kv(24, 14)                                         # 3 of the 4 pages
    client.append(sid, k, v, cache="tiny")
    q = queries(1, 15)
    before = snapshot(client, sid, q, cache="tiny")
    k2, v2 = kv(16, 16)                                       # needs 2 more
    with pytest.raises(tqkv.ResourceExhausted) as e:
        client.append(sid, k2, v2, start=24, cache="tiny")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_unchanged(client, sid, q, before, cache="tiny")
    client.drop(sid, cache="tiny")


def test_compressed_cache_is_close_but_not_exact(client):
    sid = new_id()
    k, v = kv(64, 17)
    client.append(sid, k, v, cache="tq")
    q = queries(1, 18)
    want = reference_attention(k[2], v[2], q)[0]
    got = client.attend([(sid, 2, q)], cache="tq")[0].output
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-3 < error < 0.6
    boundary = client.attend([(sid, 0, q)], cache="tq")[0].output   # fp16 boundary layer
    np.testing.assert_allclose(boundary, reference_attention(fp16(k[0]), fp16(v[0]), q)[0],
                               atol=2e-5)
    client.drop(sid, cache="tq")


class _Recorder(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Records (method, metadata) of every call; can fake a lost answer."""

    def __init__(self):
        self.calls = []
        self.lose_answers = {}  # method suffix -> how many answers to lose

    def _record(self, details):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls.append((method.rsplit("/", 1)[-1], dict(details.metadata or ())))
        return method.rsplit("/", 1)[-1]

    def intercept_unary_unary(self, continuation, details, request):
        name = self._record(details)
        result = continuation(details, request)
        if self.lose_answers.get(name, 0) > 0:
            self.lose_answers[name] -= 1
            result.exception()  # wait until the server has answered
            return _LostAnswer()
        return result

    def intercept_stream_unary(self, continuation, details, request_iterator):
        self._record(details)
        return continuation(details, request_iterator)


class _LostAnswer(grpc.RpcError, grpc.Future):
    """The call ran on the server, but its answer 'was lost': UNAVAILABLE."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection lost (simulated)"

    def result(self, timeout=None):
        raise self

    def exception(self, timeout=None):
        return self

    def traceback(self, timeout=None):
        return None

    def cancel(self):
        return False

    def cancelled(self):
        return False

    def running(self):
        return False

    def done(self):
        return True

    def add_done_callback(self, fn):
        fn(self)


def recorded_client(server, **options):
    recorder = _Recorder()
    channel = grpc.intercept_channel(grpc.insecure_channel(server.target), recorder)
    return tqkv.Client(channel=channel, **options), recorder


def test_sharding_header_names_the_route_key(server):
    client, rec = recorded_client(server)
    with client:
        sid = new_id("shard-a")
        k, v = kv(4, 19)
        client.append(sid, k, v)
        client.append_stream(sid, [(k, v)], start=4)
        client.score(sid, 0, queries(1, 1)[0])
        client.attend([(sid, 0, queries(1, 1))])
        client.get_sequence(sid)
        client.fork(sid, "shard-z/child")
        client.create_sequence("solo")
        client.drop("solo")
        client.drop("shard-z/child")
        client.drop(sid)
        client.info()
        client.create_sequence("/edge")  # an empty key: no header, as in the C++ client
        client.drop("/edge")
        with pytest.raises(tqkv.NotFound):  # attend: the first item's key
            client.attend([("first/x", 0, queries(1, 1)), (sid, 0, queries(1, 1))])
    keys = [(m, md.get(tqkv.ROUTE_KEY_HEADER)) for m, md in rec.calls]
    assert keys == [("Append", "shard-a"), ("AppendStream", "shard-a"), ("ScoreQuery", "shard-a"),
                    ("Attend", "shard-a"), ("GetSequence", "shard-a"),
                    ("ForkSequence", "shard-a"), ("CreateSequence", "solo"),
                    ("DropSequence", "solo"), ("DropSequence", "shard-z"),
                    ("DropSequence", "shard-a"), ("GetServerInfo", None),
                    ("CreateSequence", None), ("DropSequence", None), ("Attend", "first")]


def test_retry_after_a_lost_append_answer_reports_success(server):
    client, rec = recorded_client(server, initial_backoff=0.01)
    with client:
        sid = new_id()
        k, v = kv(6, 20)
        rec.lose_answers["Append"] = 1
        result = client.append(sid, k, v)         # landed; answer lost; the retry learns it landed
        assert result.sequence.layer_tokens == [6] * LAYERS and result.stored_bytes == 0
        assert result.already_stored
        assert [m for m, _ in rec.calls].count("Append") == 2
        rec.lose_answers["CreateSequence"] = 1
        assert client.create_sequence(sid + "-c").layer_tokens == [0] * LAYERS
        rec.lose_answers["ForkSequence"] = 1
        assert client.fork(sid, sid + "-f").layer_tokens == [6] * LAYERS
        rec.lose_answers["DropSequence"] = 1
        client.drop(sid + "-f")                   # dropped; retry sees NOT_FOUND: success
        with pytest.raises(tqkv.NotFound):
            client.get_sequence(sid + "-f")
        # A genuinely wrong start is still an error after a retry.
        rec.lose_answers["Append"] = 1
        k2, v2 = kv(2, 21)
        with pytest.raises(tqkv.FailedPrecondition):
            client.append(sid, k2, v2, start=7)
        client.drop(sid)
        client.drop(sid + "-c")


def test_unreachable_server_is_unavailable_after_bounded_retries():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    client = tqkv.Client("127.0.0.1:%d" % port, timeout=2.0, max_attempts=3,
                         initial_backoff=0.01, max_backoff=0.05)
    t0 = time.monotonic()
    with pytest.raises(tqkv.Unavailable) as e:
        client.info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 10
    client.close()


def test_auth_and_tls(secure_server):
    s = secure_server
    good = tqkv.Client(s.target, auth_token="secret-token", root_certificates=s.root_certificates,
                       server_name_override="localhost", timeout=10)
    assert good.info().backend == "cpu"
    sid = new_id()
    k, v = kv(3, 22)
    assert good.append(sid, k, v).sequence.layer_tokens == [3] * LAYERS
    good.drop(sid)
    good.close()
    for token in (None, "wrong-token"):
        bad = tqkv.Client(s.target, auth_token=token, root_certificates=s.root_certificates,
                          server_name_override="localhost", timeout=10, max_attempts=1)
        with pytest.raises(tqkv.Unauthenticated) as e:
            bad.info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        bad.close()
    plain = tqkv.Client(s.target, auth_token="secret-token", timeout=3, max_attempts=1)
    with pytest.raises(tqkv.Unavailable):           # plaintext to a TLS port
        plain.info()
    plain.close()


def test_malformed_messages_are_invalid_argument_and_change_nothing(server, client):
    """Bytes that are not a valid message (or a string that is not UTF-8) get
    INVALID_ARGUMENT naming the message type, on unary calls and mid-stream;
    an AppendStream does not take a malformed chunk for its end."""
    from tqkv.v1 import kvcache_pb2 as pb
    channel = grpc.insecure_channel(server.target)
    raw = lambda x: x  # noqa: E731
    append = channel.unary_unary("/tqkv.v1.KvCache/Append", request_serializer=raw, response_deserializer=raw)
    get = channel.unary_unary("/tqkv.v1.KvCache/GetSequence", request_serializer=raw, response_deserializer=raw)
    for call, payload, name in [(append, b"\xff\xff\xff\xff", "AppendRequest"),
                                (append, b"\x12\x10ab", "AppendRequest"),
                                (get, b"\x12\x02\xff\xfe", "GetSequenceRequest")]:
        with pytest.raises(grpc.RpcError) as e:
            call(payload, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not a valid tqkv.v1.%s" % name in e.value.details()
    # A valid chunk, then garbage: the stream fails naming chunk 1; chunk 0 stays.
    sid = new_id()
    k, v = kv(3, 11)
    tensor = lambda a: pb.Tensor(dtype=pb.DTYPE_F32, shape=list(a.shape), data=a.tobytes())  # noqa: E731
    first = pb.AppendRequest(sequence_id=sid, keys=tensor(k), values=tensor(v)).SerializeToString()
    stream = channel.stream_unary("/tqkv.v1.KvCache/AppendStream", request_serializer=raw,
                                  response_deserializer=raw)
    with pytest.raises(grpc.RpcError) as e:
        stream(iter([first, b"\xff\xff\xff"]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chunk 1 is not a valid tqkv.v1.AppendRequest" in e.value.details()
    assert client.get_sequence(sid).layer_tokens == [3] * LAYERS
    decode = channel.stream_stream("/tqkv.v1.KvCache/DecodeStream", request_serializer=raw,
                                   response_deserializer=raw)
    with pytest.raises(grpc.RpcError) as e:
        list(decode(iter([b"\xff\xff\xff"]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message 0 is not a valid tqkv.v1.DecodeStreamRequest" in e.value.details()
    client.drop(sid)
    channel.close()


def _rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def test_tenants_and_unread_unauthenticated_bodies(tmp_path):
    """Tenant tokens reach only their own namespace (PermissionDenied), an
    over-quota append is ResourceExhausted, and large requests without a
    valid token are refused before their bodies are read: four concurrent
    54 MiB appends grow the server by a few MiB (it grew by 260 MiB when
    gRPC read unary requests whole before the token was checked)."""
    from conftest import CONFIG, server_binary
    (tmp_path / "tokens").write_text(
        "ops-token\nalpha-token tenant=alpha max_sequences=1\nbeta-token tenant=beta\n")
    args = ["--auth_token_file", str(tmp_path / "tokens"), "--max_message_bytes", str(64 << 20)]
    with LocalServer(server_binary(), CONFIG, args=args) as s:
        alpha = tqkv.Client(s.target, auth_token="alpha-token", timeout=10, max_attempts=1)
        beta = tqkv.Client(s.target, auth_token="beta-token", timeout=10, max_attempts=1)
        k, v = kv(3, 5)
        alpha.append("alpha:one", k, v)
        with pytest.raises(tqkv.PermissionDenied):
            beta.get_sequence("alpha:one")
        with pytest.raises(tqkv.PermissionDenied):
            alpha.append("one", k, v)
        with pytest.raises(tqkv.ResourceExhausted) as e:
            alpha.append("alpha:two", k, v)
        assert "tenant 'alpha' is at its quota" in str(e.value)
        mine = alpha.info().tenant
        assert (mine.name, mine.sequence_prefix, mine.sequences, mine.tokens) == ("alpha", "alpha:", 1, 3)
        alpha.close()
        beta.close()

        body = os.urandom(54 << 20)
        codes = []
        before = _rss_mib(s.process.pid)
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _rss_mib(s.process.pid))
                time.sleep(0.005)

        def send():
            channel = grpc.insecure_channel(s.target, options=[("grpc.max_send_message_length", 64 << 20)])
            call = channel.unary_unary("/tqkv.v1.KvCache/Append")
            try:
                call(body, timeout=30)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
            channel.close()

        sampler = threading.Thread(target=sample)
        sampler.start()
        senders = [threading.Thread(target=send) for _ in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        time.sleep(0.2)
        done.set()
        sampler.join()
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
        assert peak[0] - before < 64, "the server grew by %.0f MiB" % (peak[0] - before)


def test_export_import_pull_and_snapshot_through_the_python_client(tmp_path):
    """Sequences moved between two servers by export + import and by a pull
    read as before; a snapshot brings them back after a restart."""
    from conftest import CONFIG, server_binary
    args = ["--data_dir", str(tmp_path / "data")]
    with LocalServer(server_binary(), CONFIG) as a, LocalServer(server_binary(), CONFIG, args=args) as b:
        src = tqkv.Client(a.target, timeout=20)
        dst = tqkv.Client(b.target, timeout=20)
        k, v = kv(40, 31)
        for sid in ("move/a", "move/b", "pull/c"):
            src.append(sid, k, v, cache="tq")
        q = np.random.default_rng(3).standard_normal((1, Q_HEADS, D)).astype(np.float32)
        want = {sid: src.attend([tqkv.AttendItem(sid, 1, q)], cache="tq")[0].output
                for sid in ("move/a", "move/b", "pull/c")}
        assert src.list_sequences(prefix="move/", cache="tq") == ["move/a", "move/b"]
        moved = dst.import_sequences(src.export_sequences(prefix="move/", cache="tq"))
        assert list(moved.sequence_ids) == ["move/a", "move/b"]
        pulled = dst.pull_sequences(a.target, sequence_ids=["pull/c"], cache="tq")
        assert list(pulled.sequence_ids) == ["pull/c"]
        for sid, out in want.items():
            assert np.array_equal(dst.attend([tqkv.AttendItem(sid, 1, q)], cache="tq")[0].output, out)
        saved = dst.save_snapshot()
        assert [f.sequences for f in saved.files if f.cache == "tq"] == [3]
        src.close()
        dst.close()
    with LocalServer(server_binary(), CONFIG, args=args) as b:
        dst = tqkv.Client(b.target, timeout=20)
        for sid, out in want.items():
            assert np.array_equal(dst.attend([tqkv.AttendItem(sid, 1, q)], cache="tq")[0].output, out)
        dst.close()
