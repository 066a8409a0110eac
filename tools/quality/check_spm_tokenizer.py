#!/usr/bin/env python3
"""Checks spm.py against the sentencepiece library on the same vocabulary.

Builds a sentencepiece BPE model (byte fallback, no dummy prefix, spaces
escaped as U+2581, no normalization) from a GGUF's tokens, scores and token
types, and encodes with both every fragment of the texts between the
user-defined tokens (runs of newlines and of 2-31 spaces), which spm.py cuts
out of the raw text first, as llama.cpp does (sentencepiece matches them
only after escaping spaces, so it never sees a run of raw spaces). Prints
where they differ. A check
for the quality report's second model; needs `pip install sentencepiece`
(not part of the report's environment).

    python tools/quality/check_spm_tokenizer.py [GGUF] [TEXT ...]
"""
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from spm import SentencePieceBPE  # noqa: E402


def sentencepiece_from(tok):
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(tok.tokens)
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id = 3, 2, 1
    m.trainer_spec.pad_id = 0
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for text, score, ty in zip(tok.tokens, tok.scores, tok.types):
        p = m.pieces.add()
        p.piece, p.score, p.type = text, score, ty
    return sentencepiece.SentencePieceProcessor(model_proto=m.SerializeToString())


def main(argv):
    import gguf
    sys.path.insert(0, str(HERE))
    import gemma
    path = argv[0] if argv else gemma.gemma3_path()
    texts = argv[1:] or ["/usr/share/common-licenses/GPL-3", "pydoc:topics"]
    tok = SentencePieceBPE.from_gguf(gguf.GGUFReader(path))
    sp = sentencepiece_from(tok)
    import quality_report
    failed = 0
    for name in texts:
        text = quality_report.read_text(name)
        fragments = [f for special, f in tok._partition(text) if not special]
        ours, theirs, bad = 0, 0, []
        for f in fragments:
            a, b = tok._encode_fragment(f), sp.encode(f)
            ours, theirs = ours + len(a), theirs + len(b)
            if a != b:
                bad.append((f, [tok.tokens[i] for i in a][:8], [tok.tokens[i] for i in b][:8]))
        failed += bool(bad)
        for f, a, b in bad[:5]:
            print("%s: DIFFER on %r: ours %r, sentencepiece %r" % (name, f[:40], a, b))
        print("%s: %d characters, %d fragments, %d tokens (ours) / %d (sentencepiece): %s" % (
            name, len(text), len(fragments), ours, theirs,
            "identical" if not bad else "%d fragments differ" % len(bad)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
