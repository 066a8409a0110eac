"""SentencePiece-style BPE (the 'llama' tokenizer model of GGUF) from a GGUF's
vocabulary and scores: Gemma 3's tokenizer.

How it encodes, as llama.cpp's SPM tokenizer does for a GGUF with
tokenizer.ggml.model = "llama":
  1. User-defined tokens (token_type 4: runs of newlines, runs of 2-31 spaces,
     a few HTML tags) are cut out of the raw text first, longest first.
  2. In the rest, every space becomes U+2581 ('\u2581'); no space is added in
     front (tokenizer.ggml.add_space_prefix is false for Gemma 3).
  3. Start from single characters; repeatedly merge the adjacent pair whose
     concatenation is a vocabulary token with the highest score (ties: the
     leftmost pair), until no pair is a token.
  4. A character that is not a token is written as its UTF-8 bytes (the
     <0xNN> byte-fallback tokens).
The BOS token is not added here; the model module adds it.
"""
import heapq

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


class SentencePieceBPE:
    def __init__(self, tokens, scores, types):
        self.tokens = list(tokens)
        self.scores = [float(s) for s in scores]
        self.types = [int(t) for t in types]
        self.ids = {}
        for i, t in enumerate(self.tokens):
            self.ids.setdefault(t, i)
        self.byte_ids = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.types)):
            if ty == BYTE:
                self.byte_ids[int(t[3:-1], 16)] = i
        # Longest first, as llama.cpp partitions on them.
        self.user_defined = sorted((t for t, ty in zip(self.tokens, self.types)
                                    if ty == USER_DEFINED and t), key=len, reverse=True)

    @classmethod
    def from_gguf(cls, reader):
        f = reader.fields
        return cls(f["tokenizer.ggml.tokens"].contents(), f["tokenizer.ggml.scores"].contents(),
                   f["tokenizer.ggml.token_type"].contents())

    def _partition(self, text):
        """[(is_user_defined_token, text)] covering the text."""
        parts = [(False, text)]
        for special in self.user_defined:
            out = []
            for is_special, fragment in parts:
                if is_special or special not in fragment:
                    out.append((is_special, fragment))
                    continue
                pieces = fragment.split(special)
                for j, piece in enumerate(pieces):
                    if piece:
                        out.append((False, piece))
                    if j < len(pieces) - 1:
                        out.append((True, special))
            parts = out
        return parts

    def _encode_fragment(self, text):
        symbols = list(text.replace(" ", SPACE))
        n = len(symbols)
        if n == 0:
            return []
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        alive = [True] * n
        heap = []

        def push(left):
            right = nxt[left]
            if right < 0:
                return
            merged = symbols[left] + symbols[right]
            token = self.ids.get(merged)
            if token is not None:
                # heapq is a min-heap: highest score first, then leftmost.
                heapq.heappush(heap, (-self.scores[token], left, symbols[left], symbols[right]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, a, b = heapq.heappop(heap)
            right = nxt[left]
            # Stale entry: one side has changed since it was pushed.
            if not alive[left] or right < 0 or symbols[left] != a or symbols[right] != b:
                continue
            symbols[left] = a + b
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            if prev[left] >= 0:
                push(prev[left])
            push(left)
        ids = []
        i = 0
        while i >= 0:
            token = self.ids.get(symbols[i])
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self.byte_ids[b] for b in symbols[i].encode("utf-8"))
            i = nxt[i]
        return ids

    def encode(self, text):
        ids = []
        for is_special, fragment in self._partition(text):
            ids += [self.ids[fragment]] if is_special else self._encode_fragment(fragment)
        return ids

    def decode(self, ids):
        data = bytearray()
        for i in ids:
            ty = self.types[i]
            if ty == BYTE:
                data.append(int(self.tokens[i][3:-1], 16))
            elif ty == CONTROL:
                continue
            else:
                data += self.tokens[i].replace(SPACE, " ").encode("utf-8")
        return data.decode("utf-8", errors="replace")
