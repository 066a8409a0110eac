"""TqkvCache: a transformers Cache whose K/V live in a tqkv-server.

    model = AutoModelForCausalLM.from_config(config, attn_implementation="tqkv")
    with tqkv.Client(target) as client, TqkvCache(model, client) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=32)
    # the sequences are dropped when the with-block ends (keep=True keeps them)

What happens per forward pass, layer by layer (transformers calls the cache's
update and then the attention function registered as "tqkv"):

  * The first forward (the prompt) with prefill="local" (the default):
    attention is computed here, exactly, over the prompt's own K/V, as a
    prefill node would; each layer's K/V of the real (unpadded) tokens are
    held, and after the last layer every sequence's prompt goes to the server
    in one AppendStream ([layers, tokens, kv_heads, head_dim] in chunks of
    prefill_chunk tokens), at positions 0.. of its own.
  * Every later forward (each decode step, or a chunk of a teacher-forced
    pass), and the first one with prefill="served": per layer one
    DecodeStream message, an AppendAttend with one item per sequence that
    has real new tokens: store them at the sequence's length in that layer
    and attend with their queries (causal among themselves; windowed in
    sliding-window layers), with the layer's scaling and sink logits.

Sequences. Row b of the batch is the server sequence sequence_ids[b]
("hf-<random>/<b>" unless given; one routing key for the batch, so that one
stream reaches every sequence behind a router). A sequence holds only its
real tokens: with left padding, row b's first real token is position 0 on
the server, which is the position transformers' generate gives it
(position_ids from the attention mask), so the RoPE the server's pre-RoPE
centering assumes at position t is the one the key was rotated with.

Lengths. get_seq_length() is the padded length transformers sees (every
token of the batch's token axis, pads included); `lengths` [layers, batch]
is what each layer of each sequence holds on the server.

Not supported (Unsupported): beam search and other batch reordering,
cropping (assisted decoding), dropout. Attention logit soft-capping (Gemma
2) is served: every step carries it (logit_softcap).
"""
import uuid
from typing import List, Optional, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tqkv._errors import NotFound, TqkvError
from tqkv._messages import AppendAttendItem
from tqkv.client import Client
from tqkv.hf import _attention as att
from tqkv.hf._config import ModelSpec, Unsupported, check_server_cache, key_permutation, \
    model_spec, refuse_unservable

PREFILL_MODES = ("local", "served")


class TqkvLayer(CacheLayerMixin):
    """One layer of a TqkvCache: counts the tokens transformers has seen and
    hands each update's K/V to the attention call that follows. Holds no
    tensors of its own."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "TqkvCache", index: int, window: Optional[int]):
        super().__init__()
        self._owner = owner
        self.index = index
        self.sliding_window = window
        self.is_sliding = window is not None
        self.seen = 0

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Counts the new tokens and returns them as they are (the server holds
        the past; the attention function sends these)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += int(key_states.shape[-2])
        att.leave_note(att.Pending(self._owner, self.index, key_states, value_states))
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        # Masks span every token seen (pads included): the attention function
        # reads each new token's padding from its diagonal.
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        self.seen = 0
        self.is_initialized = False

    def offload(self):
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int):
        raise Unsupported("a TqkvCache cannot be cropped (assisted or speculative decoding "
                          "through transformers is not served)")

    def reorder_cache(self, beam_idx):
        raise Unsupported("a TqkvCache cannot reorder its batch (beam search is not served; "
                          "use greedy or sampling)")

    def batch_repeat_interleave(self, repeats: int):
        raise Unsupported("a TqkvCache cannot repeat its batch once filled")

    def batch_select_indices(self, indices):
        raise Unsupported("a TqkvCache cannot select from its batch once filled")


class TqkvCache(Cache):
    """A transformers Cache served by a tqkv-server (module docstring).

    model: the transformers model (or its config; see tqkv.hf.model_spec).
    client: a tqkv.Client, or a target "host:port" (the cache then owns a
    client and closes it). cache: the server's cache name ("" its first).
    prefill: "local" (exact, then AppendStream) or "served" (the prompt too
    goes through DecodeStream). keep: leave the sequences on the server at
    close() (for prefix reuse); default drop them. sequence_ids: one per
    batch row (default "hf-<random>/<row>"). resume: the sequences already
    hold a prefix (kept by an earlier cache): their lengths are read from
    the server and every forward is served. check: compare the server's
    cache with the model (GetServerInfo) now: CacheMismatch when it cannot
    serve it, a RopeMismatchWarning when it centers with another RoPE.

    Not thread-safe: one forward at a time.
    """

    def __init__(self, model, client, *, cache: str = "", prefill: str = "local",
                 keep: bool = False, sequence_ids: Optional[Sequence[str]] = None,
                 resume: bool = False, check: bool = True, prefill_chunk: int = 256,
                 pair_layout: Optional[int] = None):
        if prefill not in PREFILL_MODES:
            raise ValueError("prefill=%r: want one of %s" % (prefill, PREFILL_MODES))
        self.spec: ModelSpec = model if isinstance(model, ModelSpec) else model_spec(model)
        refuse_unservable(self.spec)
        self._owns_client = isinstance(client, str)
        self.client: Client = Client(client) if self._owns_client else client
        self.cache_name = cache
        self.cache_info = check_server_cache(self.spec, self.client.info(), cache) if check \
            else None
        self._perm = self._key_permutation(pair_layout)
        super().__init__(layers=[TqkvLayer(self, i, self.spec.window(i))
                                 for i in range(self.spec.layers)])
        self.prefill, self.keep, self.prefill_chunk = prefill, keep, prefill_chunk
        self.sequence_ids: Optional[List[str]] = list(sequence_ids) if sequence_ids else None
        self._auto_ids = sequence_ids is None
        self.lengths: Optional[np.ndarray] = None   # int64 [layers, batch]
        self._prefilled = prefill == "served"
        self._held = None                           # local prefill: per layer, per row (k, v)
        self._stream = None
        self.stored_bytes = 0         # the server's count of what this cache's calls stored
        self.stored_bytes_bf16 = 0
        self.messages = 0             # DecodeStream messages sent
        if resume:
            self._resume()

    def _key_permutation(self, pair_layout):
        rope = self.spec.rope
        if rope is None:
            return None
        if pair_layout is None and self.cache_info is not None \
                and self.cache_info.config.HasField("rope"):
            pair_layout = self.cache_info.config.rope.pair_layout
        if pair_layout is None:
            return None
        idx = key_permutation(self.spec.head_dim, rope.rotary_dims, rope.pair_layout,
                              pair_layout)
        return None if idx is None else np.asarray(idx)

    def _keys_out(self, array):
        """Keys or queries [..., head_dim] in the layout they are stored in."""
        return array if self._perm is None else np.ascontiguousarray(array[..., self._perm])

    # -- lifecycle ------------------------------------------------------------

    def _start(self, batch: int):
        if self.lengths is not None:
            if batch != self.lengths.shape[1]:
                raise Unsupported("this TqkvCache holds %d sequences; a forward of batch %d "
                                  "needs a new one" % (self.lengths.shape[1], batch))
            return
        if self.sequence_ids is None:
            prefix = "hf-%s" % uuid.uuid4().hex[:12]
            self.sequence_ids = ["%s/%d" % (prefix, b) for b in range(batch)]
        if len(self.sequence_ids) != batch:
            raise ValueError("%d sequence_ids for a batch of %d" % (len(self.sequence_ids), batch))
        self.lengths = np.zeros((self.spec.layers, batch), dtype=np.int64)

    def _resume(self):
        if not self.sequence_ids:
            raise ValueError("resume=True needs the sequence_ids to resume")
        self._start(len(self.sequence_ids))
        for b, sid in enumerate(self.sequence_ids):
            info = self.client.get_sequence(sid, cache=self.cache_name)
            self.lengths[:, b] = info.layer_tokens
        for layer in self.layers:
            layer.seen = int(self.lengths.max()) if self.lengths.size else 0
            layer.is_initialized = True
        self._prefilled = True

    def close(self, drop: Optional[bool] = None):
        """Ends the stream and drops the sequences from the server (unless
        keep, or drop=False); closes the client the cache made. Safe to call
        twice."""
        self._release((not self.keep) if drop is None else drop)
        if self._owns_client:
            self.client.close()
            self._owns_client = False

    def _release(self, drop: bool):
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if drop and self.lengths is not None:
            for sid in self.sequence_ids:
                try:
                    self.client.drop(sid, cache=self.cache_name)
                except NotFound:
                    pass  # never stored (a row of padding only), or dropped already
            self.lengths = None

    def reset(self):
        """Drops the sequences and starts empty (with new sequence ids unless
        they were given)."""
        self._release(True)
        if self._auto_ids:
            self.sequence_ids = None
        self.lengths, self._held = None, None
        self._prefilled = self.prefill == "served"
        for layer in self.layers:
            layer.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- attention ----------------------------------------------------------------

    def attend(self, layer: int, query, key, value, mask, scaling: float, sinks,
               softcap: Optional[float] = None):
        """The layer's attention output [batch, tokens, query_heads, head_dim]
        for the new tokens' queries (tqkv_attention calls it); softcap: the
        attention logit soft cap (Gemma 2), None or 0 for none."""
        batch, _, tokens, _ = query.shape
        self._start(batch)
        real = att.real_tokens(mask, batch, tokens)
        if not self._prefilled:
            out = att.exact_attention(query, key, value, mask, scaling, sinks,
                                      self.spec.window(layer), softcap)
            self._hold(layer, key, value, real)
            if layer == self.spec.layers - 1:
                self._flush()
            return out
        return self._served(layer, query, key, value, real, scaling, sinks, softcap)

    def _hold(self, layer: int, key, value, real: np.ndarray):
        if self._held is None:
            self._held = [None] * self.spec.layers
        k = self._keys_out(att.to_wire(key.transpose(1, 2)))  # [batch, tokens, kv_heads, dim]
        v = att.to_wire(value.transpose(1, 2))
        self._held[layer] = [(k[b][real[b]], v[b][real[b]]) for b in range(k.shape[0])]

    def _flush(self):
        """The prompt of every sequence to the server, one AppendStream each."""
        held, self._held = self._held, None
        if held is None or any(h is None for h in held):
            raise TqkvError("the prefill forward did not reach every layer; reset() the cache")
        for b, sid in enumerate(self.sequence_ids):
            keys = np.stack([held[layer][b][0] for layer in range(self.spec.layers)])
            values = np.stack([held[layer][b][1] for layer in range(self.spec.layers)])
            count = keys.shape[1]
            if count == 0:
                continue
            chunks = [(keys[:, s:s + self.prefill_chunk], values[:, s:s + self.prefill_chunk])
                      for s in range(0, count, self.prefill_chunk)]
            result = self.client.append_stream(sid, chunks, cache=self.cache_name)
            self.stored_bytes += result.stored_bytes
            self.stored_bytes_bf16 += result.stored_bytes_bf16
            self.lengths[:, b] = count
        self._prefilled = True

    def _served(self, layer: int, query, key, value, real: np.ndarray, scaling: float, sinks,
                softcap: Optional[float]):
        q = self._keys_out(att.to_wire(query.transpose(1, 2)))  # [batch, tokens, heads, dim]
        k = self._keys_out(att.to_wire(key.transpose(1, 2)))
        v = att.to_wire(value.transpose(1, 2))
        items, rows = [], []
        for b, sid in enumerate(self.sequence_ids):
            sel = real[b]
            if not sel.any():
                continue
            items.append(AppendAttendItem(sid, int(self.lengths[layer, b]), k[b][sel], v[b][sel],
                                          q[b][sel]))
            rows.append(b)
        batch, tokens = real.shape
        out = torch.zeros((batch, tokens) + tuple(q.shape[2:]), dtype=query.dtype)
        if items:
            result = self._step(layer, items, scaling, sinks, softcap, att.wire_dtype(query.dtype))
            for b, item in zip(rows, result):
                if item.error is not None:
                    raise type(item.error)("layer %d, sequence %s: %s"
                                           % (layer, self.sequence_ids[b], item.error.message))
                out[b, torch.from_numpy(real[b])] = att.from_wire(item.output, query.dtype)
                self.lengths[layer, b] += int(real[b].sum())
        return out.to(query.device)

    def _step(self, layer: int, items, scaling: float, sinks, softcap: Optional[float],
              output_dtype: str):
        if self._stream is None:
            self._stream = self.client.decode_stream(cache=self.cache_name)
        sink_logits = None
        if sinks is not None:
            sink_logits = sinks.detach().float().cpu().numpy()
        result = self._stream.step(layer, items, scale=scaling, sink_logits=sink_logits,
                                   output_dtype=output_dtype, logit_softcap=float(softcap or 0.0))
        self.messages += 1
        self.stored_bytes += result.stored_bytes
        self.stored_bytes_bf16 += result.stored_bytes_bf16
        return result
