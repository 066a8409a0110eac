"""generate(): model.generate with every layer's attention served by tqkv,
the sequences dropped afterwards (or kept)."""
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
