"""What a user calls: generate() (model.generate served by tqkv, the
sequences dropped afterwards), served() (the model switched to
attn_implementation "tqkv" for a block), token_nll() and perplexity()
(a teacher-forced pass through any cache, in decode-like chunks)."""
import contextlib

from tqkv.hf._attention import ATTN_IMPLEMENTATION
from tqkv.hf._cache import TqkvCache


@contextlib.contextmanager
def served(model):
    """Within the block the model's attention is attn_implementation "tqkv";
    the one it had is restored after."""
    before = model.config._attn_implementation
    if before == ATTN_IMPLEMENTATION:
        yield model
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def generate(model, client, *args, cache: str = "", prefill: str = "local", keep: bool = False,
             sequence_ids=None, check: bool = True, stats: dict = None, **kwargs):
    """model.generate(*args, **kwargs) served by tqkv: a TqkvCache on the
    client's cache `cache` (prefill, keep, sequence_ids, check as in
    TqkvCache), the model switched to attn_implementation "tqkv" for the
    call. The sequences are dropped when it returns or fails, unless keep.
    With a dict `stats`, fills in what the cache counted: sequence_ids,
    messages, stored_bytes, stored_bytes_bf16, lengths. Returns what
    model.generate returns."""
    if "cache" in kwargs or "past_key_values" in kwargs:
        raise ValueError("tqkv.hf.generate makes its own cache; call model.generate with "
                         "cache=TqkvCache(...) to bring one")
    with served(model), TqkvCache(model, client, cache=cache, prefill=prefill, keep=keep,
                                  sequence_ids=sequence_ids, check=check) as kv:
        out = model.generate(*args, cache=kv, **kwargs)
        if stats is not None:
            stats.update(sequence_ids=list(kv.sequence_ids or []), messages=kv.messages,
                         stored_bytes=kv.stored_bytes, stored_bytes_bf16=kv.stored_bytes_bf16,
                         lengths=None if kv.lengths is None else kv.lengths.copy())
        return out


def token_nll(model, input_ids, *, cache=None, chunk: int = 16):
    """float64 [batch, tokens - 1]: -log p(token t | tokens < t) for t >= 1,
    teacher-forced through `cache` (a TqkvCache, any transformers Cache, or
    None: a DynamicCache) in forwards of `chunk` tokens (0: one forward of
    every token), the way a decode node sees a text: each chunk's queries
    attend over the chunks before it as the cache holds them. Rows of equal
    length, no padding. With a TqkvCache the model runs as
    attn_implementation "tqkv" for the call."""
    import torch
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    tokens = input_ids.shape[1]
    step = chunk or tokens
    context = served(model) if isinstance(cache, TqkvCache) else contextlib.nullcontext()
    out = []
    with context, torch.no_grad():
        for start in range(0, tokens, step):
            logits = model(input_ids[:, start:start + step], cache=cache, use_cache=True).logits
            out.append(torch.log_softmax(logits.double(), dim=-1))
    logp = torch.cat(out, dim=1)[:, :-1]
    return -logp.gather(-1, input_ids[:, 1:, None].to(logp.device))[..., 0]


def perplexity(model, input_ids, *, cache=None, chunk: int = 16) -> float:
    """exp(mean token_nll): the perplexity of the rows of input_ids through
    `cache`, in forwards of `chunk` tokens (see token_nll)."""
    return float(token_nll(model, input_ids, cache=cache, chunk=chunk).mean().exp())
