"""The negative control: pagedspec's backend with each step's cached context dropped (every query
token sees only as many positions as its request has tokens in the step). A comparison that this
backend passes has no power."""
from __future__ import annotations

import dataclasses

from pagedspec.vllm import backend, layer_ops


class DroppedContextImpl(backend.PagedSpecAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:
            return output
        cu = attn_metadata.query_start_loc
        meta = dataclasses.replace(attn_metadata, seq_lens=(cu[1:] - cu[:-1]).int(), plan=None)
        key_cache, value_cache = self._caches(kv_cache, query.dtype)
        return layer_ops.attend(query, key_cache, value_cache, meta, self.scale,
                                *self._scales(layer), output)


class DroppedContextBackend(backend.PagedSpecAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return DroppedContextImpl
