"""Long-context retrieval: a pass key planted in filler text.

A prompt is: an instruction, filler sentences, the needle ("The pass key is
12345. Remember it. 12345 is the pass key.") at a given depth of the filler,
more filler, then the question "What is the pass key? The pass key is"; the
answer is " 12345". Prompts are built from token ids (each piece tokenized on
its own, then joined), so a prompt has exactly the requested length.

Scoring one prompt with one attention backend (attention.py's interface):
prefill the prompt (one call per layer with every prompt token), then decode
the answer one token at a time (one call per layer with one token: Append 1,
Attend 1 on a tqkv-server), feeding the true answer tokens (teacher forcing).
  logprob  sum over answer tokens of log p(answer token | prompt, earlier
           answer tokens)
  greedy   whether greedy decoding reproduces the answer: true exactly when
           every step's argmax is the true next token, which the same
           teacher-forced steps show (greedy decoding feeds the same tokens as
           long as it is right, and is wrong from its first miss on).
"""
from dataclasses import dataclass, field
from typing import List

import numpy as np

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant "
         "text. Find it and memorize it. I will quiz you about it.")
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.", "The river flows to the sea.", "Birds sing in the morning.",
          "The road is long and quiet."]
QUESTION = "What is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)


@dataclass
class Prompt:
    tokens: List[int]      # the prompt, BOS included when the model has one
    answer: List[int]      # the answer's tokens
    key: str
    depth: float
    needle_at: int         # token index where the needle starts
    context: int = field(default=0)


def make_prompt(encode, context, depth, key, seed=0, bos=None):
    """A prompt of exactly `context` tokens (BOS and question included) with
    the needle starting at `depth` (0..1) of the filler. `encode`: text -> ids."""
    rng = np.random.default_rng(seed)
    head = ([bos] if bos is not None else []) + encode(INTRO)
    needle = encode(" The pass key is %s. Remember it. %s is the pass key." % (key, key))
    tail = encode(" " + QUESTION)
    answer = encode(" " + key)
    room = context - len(head) - len(needle) - len(tail)
    if room < 8:
        raise ValueError("context %d is too short for the pass key prompt" % context)
    sentences = [encode(" " + s) for s in FILLER]
    filler = []
    while len(filler) < room:
        filler += sentences[rng.integers(len(sentences))]
    filler = filler[:room]
    cut = int(round(depth * room))
    # Put the needle at a sentence boundary near the requested depth.
    period = set(encode(".")) | set(encode(" ."))
    while 0 < cut < room and filler[cut - 1] not in period:
        cut -= 1
    tokens = head + filler[:cut] + needle + filler[cut:] + tail
    assert len(tokens) == context
    return Prompt(tokens, answer, key, depth, len(head) + cut, context)


def prompts(encode, contexts, per_cell, bos=None, depths=DEPTHS, seed=1):
    """per_cell prompts for every (context, depth); keys are 5-digit numbers."""
    rng = np.random.default_rng(seed)
    out = []
    for context in contexts:
        for depth in depths:
            for i in range(per_cell):
                key = str(int(rng.integers(10000, 100000)))
                out.append(make_prompt(encode, context, depth, key, seed=int(rng.integers(1 << 30)),
                                       bos=bos))
    return out


def log_softmax(logits):
    m = logits.max()
    return logits - (m + np.log(np.exp(logits - m).sum()))


def score(model, prompt, backend):
    """(answer log-probability in nats, greedy reproduces the answer)."""
    hidden = model.forward(prompt.tokens, backend)
    lp = log_softmax(model.logits(hidden[-1:])[0])
    total, greedy = float(lp[prompt.answer[0]]), int(np.argmax(lp)) == prompt.answer[0]
    position = len(prompt.tokens)
    for j in range(1, len(prompt.answer)):
        hidden = model.forward([prompt.answer[j - 1]], backend, start=position)
        position += 1
        lp = log_softmax(model.logits(hidden[-1:])[0])
        total += float(lp[prompt.answer[j]])
        greedy = greedy and int(np.argmax(lp)) == prompt.answer[j]
    return total, greedy
