"""gRPC-level fuzz and soak, bounded: the request fuzzer's seed corpus (a
method byte, then a valid request; written by request_fuzz_driver
--write-seeds, next to the server binary), mutated and sent as raw bytes
through real gRPC to a real tqkv-server started with the fuzzer's own cache
config (--write-config), for a few seconds, unary calls and streams. Every
call must end with a precise status (never UNKNOWN, INTERNAL, UNIMPLEMENTED
or a hang), and the server must still serve valid calls afterwards.
scripts/fuzz.sh is the long, coverage-guided run below gRPC."""
import collections
import os
import pathlib
import random
import subprocess
import time

import grpc
import numpy as np

from tqkv.testing import LocalServer

from conftest import server_binary

# tests/fuzz/request_fuzzer.h's method order.
METHODS = ["Append", "ScoreQuery", "Attend", "AppendAttend", "CreateSequence",
           "ForkSequence", "DropSequence", "GetSequence"]
NOT_PRECISE = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED,
               grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
SECONDS = float(os.environ.get("TQKV_GRPC_FUZZ_SECONDS", "8"))


def seeds_and_config(directory):
    """The seed corpus and the caches' config, from the fuzz driver built next
    to the server."""
    driver = pathlib.Path(server_binary()).parent / "request_fuzz_driver"
    seeds, config = directory / "seeds", directory / "config.txt"
    subprocess.run([str(driver), "--write-seeds", str(seeds)], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([str(driver), "--write-config", str(config)], check=True)
    return [f.read_bytes() for f in sorted(seeds.iterdir())], config.read_text()


def mutate(seeds, rng):
    x = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(0, 4)):
        n = len(x)
        op = rng.randrange(6)
        if op == 0 and n:
            x[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            x[rng.randrange(n)] = rng.randrange(256)
        elif op == 2:
            at = rng.randrange(n + 1)
            x[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and n > 1:
            at = rng.randrange(n)
            del x[at:at + rng.randint(1, 16)]
        elif op == 4 and n > 1:
            other = rng.choice(seeds)
            x = x[:rng.randrange(n)] + other[rng.randrange(len(other)):]
        elif op == 5 and n:
            x[0] = rng.randrange(len(METHODS))
    return bytes(x)


def test_mutated_requests_over_grpc_get_precise_statuses_and_leave_the_server_serving(tmp_path):
    seeds, config = seeds_and_config(tmp_path)
    assert len(seeds) >= 16
    rng = random.Random(7)
    raw = lambda b: b  # noqa: E731
    with LocalServer(server_binary(), config) as server:
        channel = grpc.insecure_channel(server.target)
        unary = {m: channel.unary_unary("/tqkv.v1.KvCache/" + m, request_serializer=raw,
                                        response_deserializer=raw) for m in METHODS}
        append_stream = channel.stream_unary("/tqkv.v1.KvCache/AppendStream", request_serializer=raw,
                                             response_deserializer=raw)
        decode_stream = channel.stream_stream("/tqkv.v1.KvCache/DecodeStream", request_serializer=raw,
                                              response_deserializer=raw)
        codes = collections.Counter()
        calls = 0
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            x = mutate(seeds, rng)
            if not x:
                continue
            calls += 1
            try:
                if calls % 50 == 0:  # a stream of mutated Append chunks
                    chunks = [mutate(seeds, rng)[1:] for _ in range(rng.randint(1, 4))]
                    append_stream(iter(chunks), timeout=10)
                elif calls % 50 == 25:  # a decode stream of mutated steps
                    steps = [mutate(seeds, rng)[1:] for _ in range(rng.randint(1, 4))]
                    list(decode_stream(iter(steps), timeout=10))
                else:
                    unary[METHODS[x[0] % len(METHODS)]](x[1:], timeout=10)
                codes[grpc.StatusCode.OK] += 1
            except grpc.RpcError as e:
                assert e.code() not in NOT_PRECISE, (e.code(), e.details(), x[:64])
                codes[e.code()] += 1
        assert server.process.poll() is None, "the server died"
        assert calls > 100 and codes[grpc.StatusCode.OK] > 0 and codes[grpc.StatusCode.INVALID_ARGUMENT] > 0
        # Still serving: a valid call answers.
        from tqkv.v1 import kvcache_pb2 as pb
        unary["CreateSequence"](pb.CreateSequenceRequest(sequence_id="after the fuzz").SerializeToString(),
                                timeout=10)
        channel.close()
        print("grpc fuzz: %d calls in %.0f s: %s" % (calls, SECONDS,
              ", ".join("%s %d" % (c.name, n) for c, n in codes.most_common())))


def test_mutated_import_streams_get_precise_statuses_and_land_whole_or_not_at_all(tmp_path):
    """ImportSequences parses untrusted streams (pages straight from the
    message bytes): a real export, its messages mutated, dropped, repeated,
    reordered and cut, sent back for a few seconds. Every call ends with a
    precise status; what lands reads as a sequence (GetSequence answers), and
    the server keeps serving."""
    from tqkv.v1 import kvcache_pb2 as pb
    _, config = seeds_and_config(tmp_path)
    rng = random.Random(11)
    raw = lambda b: b  # noqa: E731
    with LocalServer(server_binary(), config) as server:
        channel = grpc.insecure_channel(server.target)
        call = lambda m: channel.unary_unary("/tqkv.v1.KvCache/" + m, request_serializer=raw,  # noqa: E731
                                             response_deserializer=raw)
        export = channel.unary_stream("/tqkv.v1.KvCache/ExportSequences", request_serializer=raw,
                                      response_deserializer=raw)
        import_ = channel.stream_unary("/tqkv.v1.KvCache/ImportSequences", request_serializer=raw,
                                       response_deserializer=raw)
        # Three sequences of the harness's default cache: 3 layers, 2 KV heads, head_dim 32.
        for i, tokens in enumerate((5, 23, 40)):
            kv = np.random.default_rng(i).standard_normal((3, tokens, 2, 32)).astype(np.float32)
            t = pb.Tensor(dtype=pb.DTYPE_F32, shape=list(kv.shape), data=kv.tobytes())
            call("Append")(pb.AppendRequest(sequence_id="s%d" % i, keys=t, values=t).SerializeToString(), timeout=10)
        stream = list(export(pb.ExportRequest(all=True).SerializeToString(), timeout=10))
        assert len(stream) >= 8

        def drop_all():
            listed = pb.ListSequencesResponse.FromString(
                call("ListSequences")(pb.ListSequencesRequest().SerializeToString(), timeout=10))
            for sid in listed.sequence_ids:
                got = pb.SequenceInfo.FromString(
                    call("GetSequence")(pb.GetSequenceRequest(sequence_id=sid).SerializeToString(), timeout=10))
                assert len(got.layer_tokens) == 3
                call("DropSequence")(pb.DropSequenceRequest(sequence_id=sid).SerializeToString(), timeout=10)

        drop_all()
        codes = collections.Counter()
        end = time.monotonic() + min(SECONDS, 4)
        calls = 0
        while time.monotonic() < end:
            messages = [bytearray(m) for m in stream]
            for _ in range(rng.randint(1, 3)):
                op = rng.randrange(5)
                i = rng.randrange(len(messages))
                if op == 0 and messages[i]:  # flip bits
                    for _ in range(rng.randint(1, 4)):
                        messages[i][rng.randrange(len(messages[i]))] ^= 1 << rng.randrange(8)
                elif op == 1:
                    del messages[i]
                elif op == 2:
                    messages.insert(i, bytearray(messages[rng.randrange(len(messages))]))
                elif op == 3:
                    j = rng.randrange(len(messages))
                    messages[i], messages[j] = messages[j], messages[i]
                else:
                    del messages[i:]
                if not messages:
                    break
            calls += 1
            try:
                import_(iter(bytes(m) for m in messages), timeout=10)
                codes[grpc.StatusCode.OK] += 1
            except grpc.RpcError as e:
                if server.process.poll() is not None:
                    raise AssertionError("the server died: %s" % server.read_log()[-3000:].decode(errors="replace"))
                assert e.code() not in NOT_PRECISE, (e.code(), e.details())
                codes[e.code()] += 1
            if server.process.poll() is not None:
                raise AssertionError("the server died on %r: %s" % ([bytes(m[:40]) for m in messages],
                                                                    server.read_log()[-3000:]))
            drop_all()
        assert server.process.poll() is None, "the server died"
        # The intact stream still lands whole.
        import_(iter(stream), timeout=10)
        drop_all()
        channel.close()
        print("import fuzz: %d streams: %s" % (calls, ", ".join("%s %d" % (c.name, n) for c, n in codes.most_common())))
        assert calls > 20 and codes[grpc.StatusCode.DATA_LOSS] + codes[grpc.StatusCode.INVALID_ARGUMENT] > 0
