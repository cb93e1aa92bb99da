"""Attention primitives: pure functions over `[batch, length, heads, head_dim]` arrays.

`REGISTRY` maps the names used in configs to the functions; `get(name)` looks one up and lists
the valid names when it is unknown. Dense reference masks for every pattern are in
`attention.masks`.
"""

from attention import masks
from attention.band import band_attention
from attention.block_sparse import block_sparse_attention
from attention.dot_product import dot_product_attention
from attention.favor import favor_attention, favor_features
from attention.linear import linear_attention
from attention.linformer import linformer_attention
from attention.lsh import lsh_attention
from attention.sparse_patterns import (bigbird_attention, block_local_attention,
                                       sparse_attention)
from attention.synthesizer import synthesizer_attention

REGISTRY = {
    "dot_product": dot_product_attention,
    "band": band_attention,
    "bigbird": bigbird_attention,
    "block_local": block_local_attention,
    "block_sparse": block_sparse_attention,
    "favor": favor_attention,
    "linear": linear_attention,
    "linformer": linformer_attention,
    "lsh": lsh_attention,
    "sparse": sparse_attention,
    "synthesizer": synthesizer_attention,
}


def get(name: str):
  """Returns the attention function registered under `name`."""
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(
        f"unknown attention {name!r}; valid names: {', '.join(sorted(REGISTRY))}.") from None


__all__ = ["REGISTRY", "band_attention", "dot_product_attention", "get", "masks",
           "favor_attention", "favor_features", "linear_attention",
           "linformer_attention", "lsh_attention", "synthesizer_attention",
           "bigbird_attention", "block_local_attention", "block_sparse_attention",
           "sparse_attention"]
