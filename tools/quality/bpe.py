"""Byte-level BPE (the GPT-2 scheme) from a GGUF's vocabulary and merges.

SmolLM2's tokenizer ('gpt2' model, 'smollm' pre-tokenizer): every digit is
its own piece, the rest is split by the GPT-2 pattern (contractions, optional
space + letters, optional space + digits, optional space + other symbols,
whitespace), each piece's UTF-8 bytes are mapped to printable characters
(bytes_to_unicode below), and merges are applied lowest rank first. Special
tokens (<|endoftext|>, ...) are never produced from text.
"""
import re
from functools import lru_cache

# The GPT-2 pattern with Python's re: [^\W\d_] is "a letter" (\p{L}), \d a
# digit (\p{N} for the decimal digits English text holds).
_PIECE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")
_DIGIT = re.compile(r"\d")


def bytes_to_unicode():
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class ByteLevelBPE:
    def __init__(self, tokens, merges):
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {}
        for rank, merge in enumerate(merges):
            a, b = merge.split(" ")
            self.ranks[(a, b)] = rank
        self.byte_map = bytes_to_unicode()
        self.byte_unmap = {c: b for b, c in self.byte_map.items()}
        self._bpe = lru_cache(maxsize=65536)(self._bpe_uncached)

    @classmethod
    def from_gguf(cls, reader):
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        merges = reader.fields["tokenizer.ggml.merges"].contents()
        return cls(tokens, merges)

    def pieces(self, text):
        """Pre-tokenization: digits alone, then the GPT-2 pattern."""
        out = []
        position = 0
        for digit in _DIGIT.finditer(text):
            out += _PIECE.findall(text[position:digit.start()])
            out.append(digit.group())
            position = digit.end()
        out += _PIECE.findall(text[position:])
        return out

    def _bpe_uncached(self, piece):
        parts = list(piece)
        while len(parts) > 1:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                rank = self.ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best is None:
                break
            pair = (parts[best], parts[best + 1])
            # Merge every occurrence of this pair, left to right.
            out, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                    out.append(pair[0] + pair[1])
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        return tuple(parts)

    def encode(self, text):
        ids = []
        for piece in self.pieces(text):
            mapped = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
            for part in self._bpe(mapped):
                ids.append(self.ids[part])
        return ids

    def decode(self, ids):
        data = bytes(self.byte_unmap[c] for i in ids for c in self.tokens[i])
        return data.decode("utf-8", errors="replace")
