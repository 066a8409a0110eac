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
