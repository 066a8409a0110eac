"""tools/quality/peers.py's own logic, without llama.cpp or transformers: the
protocols' chunking, perplexity from logits, the token check and the table."""
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools" / "quality"))
import peers  # noqa: E402


def test_protocol_chunks_cover_the_window_in_order():
    assert peers.protocol_chunks(1024, "every") == [(0, 1024)]
    decode = peers.protocol_chunks(1024, "decode", 16)
    assert len(decode) == 64 and decode[0] == (0, 16) and decode[-1] == (1008, 1024)
    # a window that is not a multiple of the step: the last step is shorter
    odd = peers.protocol_chunks(37, "decode", 16)
    assert odd == [(0, 16), (16, 32), (32, 37)]
    for chunks in (decode, odd):
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    with pytest.raises(ValueError):
        peers.protocol_chunks(16, "prefill")
    with pytest.raises(ValueError):
        peers.protocol_chunks(0, "every")


def test_nll_from_logits_matches_a_direct_log_softmax():
    rng = np.random.default_rng(5)
    ids = [3, 1, 4, 1, 5, 9, 2]
    logits = rng.standard_normal((len(ids), 11)).astype(np.float32) * 4
    nll = peers.nll_from_logits(logits, ids)
    assert np.array_equal(peers.nll_from_logits(logits, ids, rows=4), nll)
    assert nll.shape == (len(ids) - 1,)
    for t in range(len(ids) - 1):
        p = np.exp(logits[t].astype(np.float64))
        p /= p.sum()
        assert nll[t] == pytest.approx(-np.log(p[ids[t + 1]]), rel=1e-9)
    # the last position's logits predict nothing in the window
    changed = logits.copy()
    changed[-1] = 0
    assert np.array_equal(peers.nll_from_logits(changed, ids), nll)
    # huge logits: log-sum-exp must not overflow
    assert np.all(np.isfinite(peers.nll_from_logits(logits * 1e4, ids)))
    with pytest.raises(ValueError):
        peers.nll_from_logits(logits[:-1], ids)


def test_perplexity_of_uniform_logits_is_the_vocabulary():
    ids = [0, 1, 2, 3, 4]
    nll = peers.nll_from_logits(np.zeros((5, 50), np.float32), ids)
    assert peers.perplexity(nll) == pytest.approx(50.0)


def test_first_mismatch():
    assert peers.first_mismatch([1, 2, 3], [1, 2, 3, 4]) is None
    assert peers.first_mismatch([1, 2, 3], [1, 7, 3]) == 1
    assert peers.first_mismatch([1, 2, 3], [1, 2]) == 2


def row(peer, kv, model, text, protocol, ppl, baseline=False):
    return {"peer": peer, "kv": kv, "model": model, "text": text, "protocol": protocol,
            "ppl": ppl, "baseline": baseline}


def test_changes_are_against_the_same_peer_cell_and_protocol():
    results = [
        row("llama.cpp", "f16", "smollm2", "gpl3", "every", 10.0, True),
        row("llama.cpp", "f16", "smollm2", "gpl3", "decode", 20.0, True),
        row("llama.cpp", "q4_0", "smollm2", "gpl3", "every", 11.0),
        row("llama.cpp", "q4_0", "smollm2", "gpl3", "decode", 21.0),
        row("transformers", "DynamicLayer", "smollm2", "gpl3", "every", 5.0, True),
        row("transformers", "quanto int4", "smollm2", "gpl3", "every", 6.0),
        row("transformers", "HQQ 4-bit", "gemma3", "gpl3", "every", 6.0),
    ]
    out = {(r["peer"], r["kv"], r["protocol"], r["model"]): r for r in peers.with_changes(results)}
    assert out[("llama.cpp", "q4_0", "every", "smollm2")]["change"] == pytest.approx(0.10)
    assert out[("llama.cpp", "q4_0", "decode", "smollm2")]["change"] == pytest.approx(0.05)
    assert out[("llama.cpp", "f16", "every", "smollm2")]["change"] == pytest.approx(0.0)
    assert out[("transformers", "quanto int4", "every", "smollm2")]["change"] == pytest.approx(0.2)
    assert out[("transformers", "HQQ 4-bit", "every", "gemma3")]["change"] is None

    md = peers.table(results, [{"peer": "transformers", "kv": "quanto int2",
                                "reason": "optimum-quanto is not installed"}])
    lines = md.splitlines()
    assert lines[0] == ("| peer | KV type | bits/elem | SmolLM2-135M, GPL-3, every "
                        "| SmolLM2-135M, GPL-3, decode | Gemma-3-270M, GPL-3, every |")
    assert "| llama.cpp | f16 (baseline) | 16 | ppl 10.0000 | ppl 20.0000 |  |" in lines
    assert "| llama.cpp | q4_0 | 4.5 | +10.0% | +5.0% |  |" in lines
    assert "| transformers | quanto int4 | 4.5 | +20.0% |  |  |" in lines
    assert "| transformers | HQQ 4-bit | 4.5 |  |  | ppl 6.0000 (no baseline) |" in lines
    # each peer's baseline row comes first
    kvs = [line.split(" | ")[1] for line in lines[2:] if line.startswith("| ")]
    assert kvs.index("f16 (baseline)") < kvs.index("q4_0")
    assert kvs.index("DynamicLayer (baseline)") < kvs.index("quanto int4")
    assert lines[-1] == ("Skipped: transformers quanto int2: optimum-quanto is not installed")


def test_bits_per_element():
    assert peers.BITS["q4_0"] == 4.5 and peers.BITS["iq4_nl"] == 4.5
    assert peers.BITS["q8_0"] == 8.5 and peers.BITS["q5_0"] == 5.5 and peers.BITS["q4_1"] == 5.0
    assert peers.BITS["quanto int4"] == 4.5 and peers.BITS["quanto int2"] == 2.5
    assert peers.BITS["HQQ 4-bit"] == 4.5
    assert set(peers.LLAMA_TYPES) <= set(peers.BITS) and set(peers.HF_TYPES) <= set(peers.BITS)
