"""AppendAttend and DecodeStream through the Python client, against a real
tqkv-server (conftest.py's fp16 'default' cache: 4 layers, 2 KV heads, 4
query heads, head_dim 64): per-item errors, call-level errors on the stream,
ordering and request ids with pipelined sends, already_stored on a resend
after a broken stream, equality with the unary call and with Append + Attend,
learned sink logits, the routing header, and the asyncio client."""
import asyncio
import time
import uuid

import grpc
import numpy as np
import pytest

import tqkv
import tqkv.aio
from tqkv import _messages
from tqkv.v1 import kvcache_pb2 as pb
from tqkv.v1 import kvcache_pb2_grpc as pb_grpc

LAYERS, KV_HEADS, Q_HEADS, D = 4, 2, 4, 64


def new_id(prefix="dec"):
    return "%s/%s" % (prefix, uuid.uuid4().hex[:12])


def kvq(tokens, seed):
    """k, v [tokens, KV_HEADS, D] and q [tokens, Q_HEADS, D] of one layer."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((tokens, KV_HEADS, D)).astype(np.float32)
    v = rng.standard_normal((tokens, KV_HEADS, D)).astype(np.float32)
    q = rng.standard_normal((tokens, Q_HEADS, D)).astype(np.float32)
    return k, v, q


def fp16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def reference(k, v, q, start, scale=None, sink=None):
    """float64 (output, lse) of queries q [n, Q_HEADS, D] at positions
    start..start+n-1 over one layer's k, v [start+n, KV_HEADS, D] (fp16 as
    the cache holds them); query i sees tokens [0, start + i + 1). With sink
    logits [Q_HEADS]: one more unscaled logit per head with a zero value."""
    k, v, q = fp16(k), fp16(v), q.astype(np.float64)
    scale = scale or 1.0 / np.sqrt(D)
    group = Q_HEADS // KV_HEADS
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    for i in range(q.shape[0]):
        seen = start + i + 1
        for h in range(Q_HEADS):
            logits = k[:seen, h // group] @ q[i, h] * scale
            if sink is not None:
                logits = np.append(logits, float(sink[h]))
            m = logits.max()
            w = np.exp(logits - m)
            values = v[:seen, h // group]
            if sink is not None:
                values = np.vstack([values, np.zeros((1, D))])
            out[i, h] = w @ values / w.sum()
            lse[i, h] = m + np.log(w.sum())
    return out, lse


# -- no server: request building and result parsing ---------------------------

def test_append_attend_request_is_checked_before_anything_is_sent():
    k, v, q = kvq(2, 1)
    request, first = _messages.append_attend_request("c", 3, [("a/1", 5, k, v, q),
                                                             ("b/1", 0, k[0], v[0], q[0], True)])
    assert first == "a/1" and request.layer == 3 and request.cache == "c"
    assert list(request.items[0].keys.shape) == [2, KV_HEADS, D]
    assert list(request.items[1].queries.shape) == [1, Q_HEADS, D]  # one token: axis added
    assert request.items[1].do_not_create and not request.HasField("sink_logits")
    with pytest.raises(tqkv.InvalidArgument, match="item 0: values are"):
        _messages.append_attend_request("", 0, [("a", 0, k, v[:1], q)])
    with pytest.raises(tqkv.InvalidArgument, match="item 1: 1 query tokens for 2 new tokens"):
        _messages.append_attend_request("", 0, [("a", 0, k, v, q), ("b", 0, k, v, q[:1])])
    with pytest.raises(tqkv.InvalidArgument, match="at least one item"):
        _messages.append_attend_request("", 0, [])
    sink, _ = _messages.append_attend_request("", 0, [("a", 0, k, v, q)],
                                              sink_logits=[0.5, 1, 2, 3])
    assert list(sink.sink_logits.shape) == [4] and sink.sink_logits.dtype == pb.DTYPE_F32


def test_item_results_carry_their_own_errors():
    response = pb.AppendAttendResponse(stored_bytes=10, stored_bytes_bf16=20)
    response.results.add(code=0, layer_tokens=7, already_stored=True,
                         output=tqkv._tensors.encode("o", np.ones((1, 2, 3), np.float32), 3))
    response.results.add(code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="at 3")
    response.results.add(code=grpc.StatusCode.NOT_FOUND.value[0], message="no such")
    result = _messages.append_attend_result(response, return_lse=False)
    assert len(result) == 3 and result.stored_bytes == 10 and result.stored_bytes_bf16 == 20
    assert result[0].ok and result[0].already_stored and result[0].layer_tokens == 7
    assert result[0].output.shape == (1, 2, 3) and result[0].lse is None
    assert isinstance(result[1].error, tqkv.FailedPrecondition) and not result[1].ok
    assert result[1].error.message == "at 3" and result[1].output is None
    assert result[2].error.code == grpc.StatusCode.NOT_FOUND
    assert [r.ok for r in result] == [True, False, False]


# -- AppendAttend ---------------------------------------------------------------

def test_append_attend_per_item_errors_leave_the_other_items_stored(client):
    ok, behind, missing = new_id(), new_id(), new_id()
    k, v, q = kvq(3, 2)
    client.append_attend(1, [(behind, 0, k[:2], v[:2], q[:2])])      # layer 1 holds 2
    result = client.append_attend(1, [(ok, 0, k, v, q), (behind, 5, k, v, q),
                                      tqkv.AppendAttendItem(missing, 0, k, v, q,
                                                            do_not_create=True)],
                                  return_lse=True)
    assert [r.ok for r in result] == [True, False, False]
    assert isinstance(result[1].error, tqkv.FailedPrecondition)
    assert "2" in result[1].error.message  # names the expected position
    assert isinstance(result[2].error, tqkv.NotFound) and result[2].error.message
    assert result[0].layer_tokens == 3 and not result[0].already_stored
    want, want_lse = reference(k, v, q, 0)
    np.testing.assert_allclose(result[0].output, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(result[0].lse, want_lse, atol=2e-5, rtol=1e-5)
    # Bytes only for the OK item: 3 tokens x 2 heads x 64 x (2 + 2) bytes of bf16.
    assert result.stored_bytes_bf16 == 3 * KV_HEADS * D * 4
    assert client.get_sequence(ok).layer_tokens == [0, 3, 0, 0]
    assert client.get_sequence(behind).layer_tokens == [0, 2, 0, 0]
    with pytest.raises(tqkv.NotFound):
        client.get_sequence(missing)
    # Call-level errors raise, and change nothing.
    with pytest.raises(tqkv.InvalidArgument):
        client.append_attend(LAYERS, [(ok, 3, k, v, q)])
    with pytest.raises(tqkv.InvalidArgument):                     # one sequence twice
        client.append_attend(1, [(ok, 3, k[:1], v[:1], q[:1]), (ok, 4, k[:1], v[:1], q[:1])])
    with pytest.raises(tqkv.NotFound):
        client.append_attend(1, [(ok, 3, k, v, q)], cache="no-such-cache")
    assert client.get_sequence(ok).layer_tokens == [0, 3, 0, 0]
    client.drop(ok)
    client.drop(behind)


def test_append_attend_equals_append_then_attend(client):
    fused, split = new_id(), new_id()
    rng = np.random.default_rng(3)
    prefix_k = rng.standard_normal((LAYERS, 10, KV_HEADS, D)).astype(np.float32)
    prefix_v = rng.standard_normal((LAYERS, 10, KV_HEADS, D)).astype(np.float32)
    for sid in (fused, split):
        client.append(sid, prefix_k, prefix_v)
    k, v, q = kvq(3, 4)   # three new tokens in layer 2, causal among themselves
    got = client.append_attend(2, [(fused, 10, k, v, q)], return_lse=True)[0]
    client.append(split, k[None], v[None], start=10, layer_begin=2, layer_end=3)
    want = client.attend([(split, 2, q)], return_lse=True)[0]
    np.testing.assert_array_equal(got.output, want.output)
    np.testing.assert_array_equal(got.lse, want.lse)
    ref, ref_lse = reference(np.concatenate([prefix_k[2], k]), np.concatenate([prefix_v[2], v]),
                             q, 10)
    np.testing.assert_allclose(got.output, ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got.lse, ref_lse, atol=2e-5, rtol=1e-5)
    assert got.layer_tokens == 13
    # Resent (a retry whose answer was lost): attended again, not stored twice.
    again = client.append_attend(2, [(fused, 10, k, v, q)], return_lse=True)
    assert again[0].already_stored and again[0].layer_tokens == 13 and again.stored_bytes == 0
    np.testing.assert_array_equal(again[0].output, got.output)
    assert client.get_sequence(fused).layer_tokens == [10, 10, 13, 10]
    half = client.append_attend(2, [(fused, 13, k[0], v[0], q[0])], output_dtype="f16")
    assert half[0].output.dtype == np.float16 and half[0].output.shape == (1, Q_HEADS, D)
    client.drop(fused)
    client.drop(split)


def test_sink_logits_join_each_heads_softmax(client):
    sid, plain = new_id(), new_id()
    k, v, q = kvq(6, 5)
    sink = np.array([0.0, 2.5, -1.0, 6.0], np.float32)
    got = client.append_attend(0, [(sid, 0, k, v, q)], return_lse=True, sink_logits=sink,
                               scale=0.2)[0]
    want, want_lse = reference(k, v, q, 0, scale=0.2, sink=sink)
    np.testing.assert_allclose(got.output, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got.lse, want_lse, atol=2e-5, rtol=1e-5)
    # The same as the sink-free result rescaled: out * e^lse / (e^lse + e^sink).
    base = client.append_attend(0, [(plain, 0, k, v, q)], return_lse=True, scale=0.2)[0]
    weight = 1.0 / (1.0 + np.exp(sink[None, :] - base.lse.astype(np.float64)))
    np.testing.assert_allclose(got.output, base.output * weight[:, :, None], atol=1e-6,
                               rtol=1e-5)
    np.testing.assert_allclose(got.lse, np.logaddexp(base.lse, sink[None, :]), atol=1e-6)
    # attend takes them too: the last query token sees every token.
    last = client.attend([(sid, 0, q[-1])], return_lse=True, sink_logits=sink, scale=0.2)[0]
    np.testing.assert_allclose(last.output[0], want[-1], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(last.lse[0], want_lse[-1], atol=2e-5, rtol=1e-5)
    with pytest.raises(tqkv.InvalidArgument):                     # 3 sinks for 4 heads
        client.attend([(sid, 0, q[-1])], sink_logits=sink[:3])
    client.drop(sid)
    client.drop(plain)


# -- DecodeStream ---------------------------------------------------------------

def decode_steps(sids, steps, seed):
    """[(layer, items)] of a decode loop: every layer of every step, batched
    over sids, one new token per sequence, starting at position 0."""
    out = []
    for step in range(steps):
        for layer in range(LAYERS):
            items = []
            for i, sid in enumerate(sids):
                k, v, q = kvq(1, seed + 1000 * step + 100 * layer + i)
                items.append((sid, step, k, v, q))
            out.append((layer, items))
    return out


def renamed(steps, names):
    return [(layer, [(names[item[0]],) + tuple(item[1:]) for item in items])
            for layer, items in steps]


def test_stream_results_equal_unary_append_attend(client):
    a, b = new_id(), new_id()
    steps = decode_steps([a, b], 3, seed=10)
    with client.decode_stream() as stream:
        streamed = [stream.step(layer, items, return_lse=True) for layer, items in steps]
    c, d = new_id(), new_id()
    unary = [client.append_attend(layer, items, return_lse=True)
             for layer, items in renamed(steps, {a: c, b: d})]
    for s, u in zip(streamed, unary):
        assert s.stored_bytes == u.stored_bytes and s.stored_bytes > 0
        for si, ui in zip(s, u):
            assert si.ok and ui.ok and si.layer_tokens == ui.layer_tokens
            np.testing.assert_array_equal(si.output, ui.output)
            np.testing.assert_array_equal(si.lse, ui.lse)
    assert client.get_sequence(a).layer_tokens == [3] * LAYERS
    for sid in (a, b, c, d):
        client.drop(sid)


def test_pipelined_sends_are_answered_in_order_with_their_request_ids(client):
    sid = new_id()
    steps = decode_steps([sid], 4, seed=20)
    stream = client.decode_stream()
    ids = [stream.send(layer, items) for layer, items in steps]   # all 16 before any recv
    assert stream.unanswered == ids and ids == sorted(ids)
    results = [stream.recv() for _ in steps]
    assert [r.request_id for r in results] == ids
    assert [r[0].layer_tokens for r in results] == [1 + i // LAYERS for i in range(16)]
    with pytest.raises(tqkv.FailedPrecondition):                   # nothing owed
        stream.recv()
    stream.close()
    with pytest.raises(tqkv.FailedPrecondition):
        stream.send(0, steps[0][1])
    client.drop(sid)


def test_server_echoes_any_request_id_in_order(server):
    """Straight on the stub: ids are the client's, any uint64, in any order."""
    sid = new_id()
    k, v, q = kvq(1, 30)
    ids = [7, 3, 2 ** 64 - 1, 0]
    requests = []
    for position, request_id in enumerate(ids):
        step = pb.AppendAttendRequest(layer=0)
        step.items.add(sequence_id=sid, start_position=position,
                       keys=tqkv._tensors.encode("k", k, 3), values=tqkv._tensors.encode("v", v, 3),
                       queries=tqkv._tensors.encode("q", q, 3))
        requests.append(pb.DecodeStreamRequest(request_id=request_id, step=step))
    bad = pb.DecodeStreamRequest(request_id=99)
    bad.step.CopyFrom(requests[0].step)
    bad.step.layer = LAYERS                                   # beyond the cache: refused
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KvCacheStub(channel)
        responses = list(stub.DecodeStream(iter(requests[:2] + [bad] + requests[2:]),
                                           timeout=20))
    assert [r.request_id for r in responses] == ids[:2] + [99] + ids[2:]
    assert [r.code for r in responses] == [0, 0, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0, 0]
    assert responses[2].message and not responses[2].step.results
    assert [r.step.results[0].layer_tokens for r in responses if r.code == 0] == [1, 2, 3, 4]
    with tqkv.Client(server.target) as client:
        client.drop(sid)


def test_call_level_errors_are_responses_and_the_stream_goes_on(client):
    sid = new_id()
    k, v, q = kvq(1, 40)
    stream = client.decode_stream()
    first = stream.send(0, [(sid, 0, k, v, q)])
    bad_layer = stream.send(LAYERS, [(sid, 1, k, v, q)])
    bad_cache = stream.send(0, [(sid, 1, k, v, q)], cache="no-such-cache")
    per_item = stream.send(0, [(sid, 1, k, v, q), (new_id(), 0, k, v, q, True),
                               (sid + "-x", 4, k, v, q)])
    assert stream.recv().request_id == first
    with pytest.raises(tqkv.InvalidArgument) as e:
        stream.recv()
    assert e.value.request_id == bad_layer and e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(tqkv.NotFound) as e:
        stream.recv()
    assert e.value.request_id == bad_cache
    result = stream.recv()
    assert result.request_id == per_item
    assert [type(r.error) for r in result] == [type(None), tqkv.NotFound,
                                               tqkv.FailedPrecondition]
    assert result[0].layer_tokens == 2
    # Malformed items are refused here, before anything is sent.
    with pytest.raises(tqkv.InvalidArgument):
        stream.send(0, [(sid, 2, k, v[:, :1], q)])
    assert stream.step(1, [(sid, 0, k, v, q)])[0].layer_tokens == 1  # still open
    stream.close()
    assert client.get_sequence(sid).layer_tokens == [2, 1, 0, 0]
    client.drop(sid)


def wait_for_tokens(client, sid, want, timeout=10.0):
    """Polls until the sequence exists with layer_tokens == want."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.get_sequence(sid).layer_tokens == want:
                return
        except tqkv.NotFound:
            pass  # the stream's first request has not been handled yet
        if time.monotonic() > deadline:
            raise AssertionError("%s never held %s tokens" % (sid, want))
        time.sleep(0.005)


def test_resume_after_cancel_resends_and_landed_appends_are_already_stored(client):
    sid, twin = new_id(), new_id()
    steps = decode_steps([sid], 2, seed=50)
    stream = client.decode_stream()
    ids = [stream.send(layer, items) for layer, items in steps[:LAYERS]]  # step 0, 4 layers
    # Let the server store all four, then break the stream with no answer read.
    wait_for_tokens(client, sid, [1] * LAYERS)
    stream.cancel()
    with pytest.raises(tqkv.Cancelled) as e:
        stream.recv()
    assert e.value.request_id is None and stream.unanswered == ids
    late = stream.send(*steps[LAYERS])       # step 1, layer 0: queued while broken
    stream.resume()
    assert stream.resumes == 1
    resent = [stream.recv() for _ in range(LAYERS + 1)]
    assert [r.request_id for r in resent] == ids + [late]
    assert [r[0].already_stored for r in resent] == [True] * LAYERS + [False]
    assert [r[0].layer_tokens for r in resent] == [1] * LAYERS + [2]
    assert all(r.stored_bytes == 0 for r in resent[:LAYERS]) and resent[-1].stored_bytes > 0
    # What the resent requests attended over equals an unbroken run.
    reference_run = [client.append_attend(layer, items)
                     for layer, items in renamed(steps[:LAYERS + 1], {sid: twin})]
    for r, want in zip(resent, reference_run):
        np.testing.assert_array_equal(r[0].output, want[0].output)
    stream.close()
    assert client.get_sequence(sid).layer_tokens == [2, 1, 1, 1]
    client.drop(sid)
    client.drop(twin)


class _BreakingStreams(grpc.StreamStreamClientInterceptor):
    """Records DecodeStream metadata; can break the first stream after
    `answers` responses with a simulated UNAVAILABLE (the server has stored
    what it answered and may have stored more)."""

    def __init__(self, break_after=None):
        self.metadata = []
        self.break_after = break_after

    def intercept_stream_stream(self, continuation, details, request_iterator):
        self.metadata.append(dict(details.metadata or ()))
        call = continuation(details, request_iterator)
        if self.break_after is None:
            return call
        answers, self.break_after = self.break_after, None
        return _BreakingCall(call, answers)


class _BreakingCall:
    def __init__(self, call, answers):
        self._call, self._left = call, answers

    def __iter__(self):
        return self

    def __next__(self):
        if self._left == 0:
            self._call.cancel()
            raise _Unavailable()
        self._left -= 1
        return next(self._call)

    def cancel(self):
        return self._call.cancel()


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection lost (simulated)"


def test_recv_resumes_by_itself_on_unavailable(server):
    breaker = _BreakingStreams(break_after=2)
    channel = grpc.intercept_channel(grpc.insecure_channel(server.target), breaker)
    with tqkv.Client(channel=channel, initial_backoff=0.01) as client:
        sid = new_id()
        steps = decode_steps([sid], 2, seed=60)
        stream = client.decode_stream()
        ids = [stream.send(layer, items) for layer, items in steps[:LAYERS]]
        wait_for_tokens(client, sid, [1] * LAYERS)
        results = [stream.recv() for _ in ids]       # breaks after 2; resumed inside recv
        assert stream.resumes == 1 and len(breaker.metadata) == 2
        assert [r.request_id for r in results] == ids
        assert [r[0].already_stored for r in results] == [False, False, True, True]
        assert [r[0].layer_tokens for r in results] == [1] * LAYERS
        assert stream.step(*steps[LAYERS])[0].layer_tokens == 2   # and on it goes
        stream.close()
        client.drop(sid)


def test_the_stream_sends_its_route_key_at_start(server):
    recorder = _BreakingStreams()
    channel = grpc.intercept_channel(grpc.insecure_channel(server.target), recorder)
    with tqkv.Client(channel=channel) as client:
        a = new_id("shard-a")
        k, v, q = kvq(1, 70)
        with client.decode_stream() as stream:     # from the first item
            stream.step(0, [(a, 0, k, v, q), (new_id("shard-b"), 0, k, v, q)])
        with client.decode_stream(route_key="chat-7") as stream:
            stream.step(1, [(a, 0, k, v, q)])
        with client.decode_stream() as stream:     # a key HTTP/2 cannot carry: none
            stream.step(2, [("/edge", 0, k, v, q)])
        keys = [m.get(tqkv.ROUTE_KEY_HEADER) for m in recorder.metadata]
        assert keys == ["shard-a", "chat-7", None]
        client.drop(a)
        client.drop("/edge")


def test_leaving_the_with_block_by_an_exception_cancels_the_stream(client):
    sid = new_id()
    k, v, q = kvq(1, 80)
    with pytest.raises(RuntimeError):
        with client.decode_stream() as stream:
            stream.step(0, [(sid, 0, k, v, q)])
            raise RuntimeError("engine failed")
    with pytest.raises(tqkv.FailedPrecondition):
        stream.send(0, [(sid, 1, k, v, q)])
    assert client.get_sequence(sid).layer_tokens == [1, 0, 0, 0]
    client.drop(sid)


# -- asyncio ---------------------------------------------------------------------

def test_asyncio_client_and_decode_stream(server):
    a, b = new_id(), new_id()
    steps = decode_steps([a], 2, seed=90)

    async def run():
        async with tqkv.aio.AsyncClient(server.target, timeout=20) as client:
            async with client.decode_stream() as stream:
                stepped = [await stream.step(layer, items, return_lse=True)
                           for layer, items in steps[:LAYERS]]
                # Pipelined: every send first, then the answers in order.
                ids = [await stream.send(layer, items, return_lse=True)
                       for layer, items in steps[LAYERS:]]
                bad = await stream.send(LAYERS, steps[0][1])
                piped = [await stream.recv() for _ in ids]
                with pytest.raises(tqkv.InvalidArgument) as e:
                    await stream.recv()
                assert e.value.request_id == bad
                assert [r.request_id for r in piped] == ids
                # Broken mid-way, resumed: the landed appends are already_stored.
                last = await stream.send(0, [(a, 2) + kvq(1, 99)])
                while (await client.get_sequence(a)).layer_tokens[0] != 3:
                    await asyncio.sleep(0.005)
                stream.cancel()
                with pytest.raises(tqkv.Cancelled):
                    await stream.recv()
                stream.resume()
                again = await stream.recv()
                assert again.request_id == last and again[0].already_stored
            unary = [await client.append_attend(layer, items, return_lse=True)
                     for layer, items in renamed(steps, {a: b})]
            info = await client.get_sequence(a)
            await client.drop(a)
            await client.drop(b)
            return stepped + piped, unary, info

    streamed, unary, info = asyncio.run(run())
    assert info.layer_tokens == [3, 2, 2, 2]
    for s, u in zip(streamed, unary):
        np.testing.assert_array_equal(s[0].output, u[0].output)
        np.testing.assert_array_equal(s[0].lse, u[0].lse)


# -- sliding-window layers --------------------------------------------------

WINDOWED_CONFIG = """
caches {
  name: "default" num_layers: 2 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
  page_tokens: 8 preset: "fp16" boundary_layers: 0 memory_budget_bytes: 8388608
  sliding_window_layers { layers: [1] window: 6 }
}
"""


def test_a_sliding_window_layer_attends_over_its_window_and_gives_older_tokens_back():
    from conftest import server_binary
    from tqkv.testing import LocalServer
    with LocalServer(server_binary(), WINDOWED_CONFIG) as server, server.client(timeout=20.0) as c:
        sid = new_id("swa")
        k, v, q = kvq(40, 7)
        for t in range(40):
            for layer in (0, 1):
                r = c.append_attend(layer, [(sid, t, k[t:t + 1], v[t:t + 1], q[t:t + 1])],
                                    return_lse=True)
                assert r[0].ok, r[0].error
        # The last query of the windowed layer sees tokens [34, 40) only.
        want, want_lse = reference(k[34:], v[34:], q[39:40], 5)
        np.testing.assert_allclose(r[0].output, want.reshape(r[0].output.shape), atol=1e-4)
        np.testing.assert_allclose(r[0].lse, want_lse.reshape(r[0].lse.shape), atol=1e-4)
        info = c.get_sequence(sid)
        assert info.layer_tokens == [40, 40]
        assert info.layer_oldest_token == [0, 34]
        # Reading below what the windowed layer holds is OUT_OF_RANGE.
        with pytest.raises(tqkv.OutOfRange):
            c.score(sid, 1, q[0].reshape(Q_HEADS, D), token_begin=0, token_end=40)
