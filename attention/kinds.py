"""One record per attention kind: the only place that knows what an attention kind is and can do.

A `Kind` says everything the rest of the codebase needs to know about one attention kind: the
primitive it calls, the dense mask builders in `attention.masks` that define its pattern, whether
it can be causal (and why not when it cannot), whether its query and key are one shared
projection, the NNX class in `models.attention_extras` that owns its per-layer arrays, its config
defaults and every config argument it accepts, how its cost grows with the length, which
position schemes and memories it combines with, whether it runs with the sequence split over
devices, whether MPNet's permutation masks compose with it, whether it is an exact copy of
another kind, and which backends run it. `KINDS` is the one registry of names, `get(name)` the
one check of a name (an unknown name raises a ValueError listing every valid one), and every
other module reads these records instead of keeping its own list of names.

This module is pure Python and imports neither jax nor numpy, so config files can read the names
and defaults without loading jax (`from attention import kinds` loads no primitive).

Adding a kind: a file in `attention/` with its function, its dense mask in `attention/masks.py`,
one record in `KINDS` below, and, when the kind owns per-layer arrays (parameters, buffers,
seeds), an extras class in `models/attention_extras.py` named by the record. `register(kind)`
adds a record at run time (a kind defined outside this package, or in a test).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

Defaults = Callable[[int, int], dict[str, Any]]


def _no_arguments(window: int, max_length: int) -> dict[str, Any]:
  del window, max_length
  return {}


COSTS = ("quadratic", "subquadratic", "linear")
RELATIVE_FORMS = ("dense", "factorised")
# The implementations a kind may have (`attention.backends`): "xla" is the portable one every kind
# has; "cudnn" (jax's cuDNN attention on a GPU: dense, causal band), "tokamax" (GPU kernels, an
# optional extra), "splash" (TPU block-sparse kernel), "pallas" (our GPU kernels: band, and the
# block-pattern kinds).
BACKENDS = ("xla", "cudnn", "tokamax", "splash", "pallas")
_DENSE_BACKENDS = ("xla", "cudnn", "tokamax", "splash")
_BLOCK_MASK_BACKENDS = ("xla", "splash", "pallas")

# Value rules of the config arguments, by argument name, whichever kind takes them: the smallest
# integer allowed and what the argument means (for the one-line refusal). A None value is the
# primitive's own default and is not checked.
ARGUMENTS: dict[str, tuple[int, str]] = {
    "window": (0, "the one-sided band window, in tokens"),
    "block_size": (1, "tokens per block"),
    "stride": (1, "the sparse pattern's stride"),
    "chunk_size": (1, "tokens per chunk"),
    "num_features": (1, "FAVOR+ random features"),
    "num_hashes": (1, "LSH hash rounds"),
    "num_buckets": (1, "LSH buckets"),
    "max_span": (1, "adaptive span's largest span S, in tokens"),
    "ramp": (1, "adaptive span's soft-mask ramp R, in tokens"),
}


@dataclasses.dataclass(frozen=True)
class Kind:
  """What the layer, the configs and the trainer need to know about one attention kind.

  Attributes:
    name: the config name (`model.attention.kind`).
    module: the module holding the function: a submodule of the `attention` package
      (`attention.<module>`), or a full dotted module path for a kind defined elsewhere.
    function: the primitive's name (exported as `attention.<function>` for the package's own
      kinds); it is called as `fn(q, k, v, key_mask=..., **args)`, or `fn(qk, v, ...)` when
      `shared_qk`.
    masks: names of the dense builders in `attention.masks` that define the kind's pattern (its
      specification in tests); empty when the kind attends every pair or approximates dense
      attention.
    causal: True when the primitive accepts `causal=True`, else the reason it cannot be causal
      (shown to whoever asks for it in a language model).
    shared_qk: the query and key are one projection (Reformer's shared-QK); the layer then owns
      no key kernel.
    extras: name of the class in `models.attention_extras` that owns the kind's per-layer
      arrays and consumes some config arguments, or None when the kind needs none.
    defaults: `(window, max_length) -> dict` of the kind's arguments in the task configs, sized
      by `window` (a rough "how far can a query see" knob shared by the local kinds) and the
      model's longest sequence.
    arguments: every config argument the kind accepts (`model.attention.<name>`), sorted: the
      primitive's keyword arguments that a config can set (not q, k, v, key_mask, query_mask,
      causal, array arguments such as `mask`, nor what the extras class supplies) plus the
      extras class's `CONSUMES`. The config check refuses any other name; tests/validate_test.py
      checks the tuple against the signatures. Values are checked by `ARGUMENTS`.
    cost: how the work and memory of the scores grow with the length L: "quadratic" (every
      (query, key) pair, or [L, L] weights), "subquadratic" (L log L or L sqrt L) or "linear".
      The preflight suggests the linear kinds for a run that does not fit; Path-X leaves the
      quadratic ones out of its sweep.
    relative: how the kind takes Transformer-XL relative positions (`pos_emb="relative"`):
      "dense" (its own relative logits, `attention.relative.relative_attention`),
      "factorised" (the relative features appended to q and k) or None (not supported).
    memory: it runs with a Transformer-XL / compressive memory (needs `relative` and causal).
    sequence_parallel: the function of `attention.sequence_parallel` that runs the kind with
      the length split over devices, or None when it cannot run split.
    pattern: the builder in `attention.masks` of the pairs the kind allows over positions,
      called `pattern(length, num_heads, args)` -> bool `[H|1, L, L]`, which MPNet's
      permutation masks are composed with; None when the kind's attention is not a pattern over
      positions, and then `no_pattern` says why.
    no_pattern: why MPNet's permutation masks cannot be composed with the kind.
    copy_of: the kind whose attention this one computes exactly (flash is dot_product in O(L)
      memory): its LRA sweep points would repeat that kind's numbers and are left out.
    from_inputs: a function next to `function` that takes the layer's inputs and projection
      kernels instead of q, k and v (the same attention with less work), used when the kind's
      extras say it applies (`takes_inputs`); None when there is none.
    backends: the implementations that compute the kind (`attention.backends`, which picks one
      per layer and platform); "xla" is the portable one and every kind has it.
    paper: the paper (or method) whose attention the kind computes, as researchers cite it.
    summary: the pattern in a few words (`lra list`).
    aliases: other names a user may type for it, such as the paper's (`performer` for favor);
      `resolve` turns them into the kind's name wherever a kind is chosen by name
      (`--attention`, the config argument); configs themselves hold the kind's name.
  """

  name: str
  module: str
  function: str
  masks: tuple[str, ...] = ()
  causal: bool | str = True
  shared_qk: bool = False
  extras: str | None = None
  defaults: Defaults = _no_arguments
  arguments: tuple[str, ...] = ()
  cost: str = "linear"
  relative: str | None = None
  memory: bool = False
  sequence_parallel: str | None = None
  pattern: str | None = None
  no_pattern: str = ""
  copy_of: str | None = None
  from_inputs: str | None = None
  backends: tuple[str, ...] = ("xla",)
  paper: str = ""
  summary: str = ""
  aliases: tuple[str, ...] = ()

  def __post_init__(self):
    where = f"kind {self.name!r}"
    if self.causal is not True and not (isinstance(self.causal, str) and self.causal):
      raise ValueError(f"{where}: causal must be True or the reason it cannot be "
                       f"causal, got {self.causal!r}.")
    unknown = set(self.defaults(8, 64)) - set(self.arguments)
    if unknown:
      raise ValueError(f"{where}: defaults set {sorted(unknown)}, which are not in "
                       f"its arguments {self.arguments}.")
    if self.cost not in COSTS:
      raise ValueError(f"{where}: cost {self.cost!r} must be one of {', '.join(COSTS)}.")
    if self.relative is not None and self.relative not in RELATIVE_FORMS:
      raise ValueError(f"{where}: relative {self.relative!r} must be None or one of "
                       f"{', '.join(RELATIVE_FORMS)}.")
    if self.memory and (self.relative is None or not self.supports_causal):
      raise ValueError(f"{where}: a memory needs relative positions and a causal kind.")
    if (self.pattern is None) == (not self.no_pattern):
      raise ValueError(f"{where}: give either pattern (a builder in attention.masks) or "
                       f"no_pattern (why MPNet's permutation masks do not compose with it).")
    unknown = set(self.backends) - set(BACKENDS)
    if "xla" not in self.backends or unknown:
      raise ValueError(f"{where}: backends {self.backends} must include 'xla' and be among "
                       f"{', '.join(BACKENDS)}.")

  @property
  def supports_causal(self) -> bool:
    """Whether the primitive can run with `causal=True`."""
    return self.causal is True

  def check_causal(self) -> None:
    """Raises ValueError with the reason when this kind cannot be causal."""
    if not self.supports_causal:
      raise ValueError(f"attention {self.name!r} cannot be causal: {self.causal}")

  @property
  def module_path(self) -> str:
    """The importable path of `module`."""
    return self.module if "." in self.module else f"attention.{self.module}"


def _block(window: int) -> int:
  return max(4, window // 2)


def _lsh_defaults(window: int, max_length: int) -> dict[str, Any]:
  del window
  chunk = 64 if max_length >= 1024 else 16
  return {"num_hashes": 2, "chunk_size": chunk,
          "num_buckets": 2 * max(1, round(max_length / (2 * chunk)))}


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("dot_product", "dot_product", "dot_product_attention", cost="quadratic",
         paper="Transformer (Vaswani et al. 2017)", summary="dense softmax attention, the reference",
         aliases=("transformer", "dense"),
         relative="dense", memory=True, pattern="all_pairs_pattern", backends=_DENSE_BACKENDS),
    Kind("band", "band", "band_attention", masks=("longformer_mask",),
         paper="Longformer (Beltagy et al. 2020)",
         summary="sliding window, dilation per head, global tokens",
         aliases=("longformer", "sliding_window"),
         defaults=lambda window, max_length: {"window": window},
         arguments=("block_size", "dilation", "max_global", "window"),
         relative="factorised", memory=True,
         sequence_parallel="sequence_parallel_band_attention", pattern="band_pattern",
         backends=BACKENDS),
    Kind("bigbird", "sparse_patterns", "bigbird_attention", masks=("bigbird_mask",),
         paper="BigBird (Zaheer et al. 2020)", summary="window + global + random blocks",
         aliases=("big_bird",),
         causal="BigBird's global and random blocks are bidirectional (bigbird_attention has "
                "no causal mode); use sparse, block_local or band for language models.",
         extras="BigBirdSeed",
         defaults=lambda window, max_length: {
             "block_size": _block(window), "num_global_blocks": 2, "num_random_blocks": 3},
         arguments=("block_size", "num_global_blocks", "num_random_blocks", "random_blocks",
                    "seed"),
         backends=_BLOCK_MASK_BACKENDS,
         no_pattern="its per-layer random blocks are not composed with the permutation masks "
                    "yet."),
    Kind("block_local", "sparse_patterns", "block_local_attention",
         paper="local attention (Image Transformer, Parmar et al. 2018)",
         summary="contiguous blocks attend within themselves", aliases=("local",),
         masks=("block_local_mask",),
         defaults=lambda window, max_length: {"block_size": max(4, window)},
         arguments=("block_size",), pattern="block_local_pattern",
         backends=_BLOCK_MASK_BACKENDS),
    Kind("block_sparse", "block_sparse", "block_sparse_attention",
         paper="block-sparse attention (Child et al. 2019 layouts)",
         summary="any static block layout, empty blocks skipped",
         masks=("block_layout_mask",), extras="BlockSparseLayout",
         defaults=lambda window, max_length: {
             "block_size": _block(window), "window_blocks": 1, "global_blocks": 1},
         arguments=("block_size", "global_blocks", "window_blocks"),
         backends=_BLOCK_MASK_BACKENDS,
         no_pattern="its per-layer block layout is not composed with the permutation masks "
                    "yet."),
    Kind("adaptive_span", "adaptive_span", "adaptive_span_attention", extras="AdaptiveSpan",
         paper="Adaptive Attention Span (Sukhbaatar et al. 2019)",
         summary="soft span learned per head, on a band of the largest span",
         aliases=("adaptive_attention_span",), relative="factorised", memory=True,
         defaults=lambda window, max_length: {"max_span": max(1, min(max_length, 8192)),
                                              "ramp": 32, "penalty": 2e-6, "span_init": 0.0,
                                              "train_span": True},
         arguments=("block_size", "max_span", "penalty", "ramp", "span_init", "train_span"),
         no_pattern="its soft mask weights the pairs of a band; it is not a bool pattern."),
    Kind("entmax", "entmax", "entmax_attention", extras="EntmaxAlpha", cost="quadratic",
         paper="Adaptively Sparse Transformers (Correia et al. 2019)",
         summary="alpha-entmax weights, alpha learned per head: exact zeros",
         aliases=("adaptively_sparse", "adaptive_sparse"),
         defaults=lambda window, max_length: {"alpha": "learned"}, arguments=("alpha",),
         pattern="all_pairs_pattern"),
    Kind("favor", "favor", "favor_attention", extras="FavorFeatures",
         paper="Performer (Choromanski et al. 2021)", summary="FAVOR+ random features",
         aliases=("performer",),
         defaults=lambda window, max_length: {"num_features": 256, "redraw": False},
         arguments=("chunk_size", "kernel", "num_features", "precision", "redraw"),
         sequence_parallel="sequence_parallel_favor_attention",
         no_pattern="its random-feature kernel has no per-pair mask beyond causal prefix "
                    "sums."),
    Kind("flash", "flash", "flash_attention", arguments=("block_size",), cost="quadratic",
         paper="FlashAttention (Dao et al. 2022), the algorithm",
         summary="exact dense attention in O(L) memory", aliases=("flash_attention",),
         pattern="all_pairs_pattern", copy_of="dot_product", backends=_DENSE_BACKENDS),
    Kind("linear", "linear", "linear_attention", arguments=("chunk_size", "precision"),
         paper="Linear Transformer (Katharopoulos et al. 2020)",
         summary="elu+1 kernel attention", aliases=("linear_transformer",),
         sequence_parallel="sequence_parallel_linear_attention",
         no_pattern="its kernel attention has no per-pair mask beyond causal prefix sums."),
    Kind("linformer", "linformer", "linformer_attention",
         paper="Linformer (Wang et al. 2020)", summary="keys and values projected along the length",
         causal="Linformer projects keys and values along the length axis, so every "
                "compressed key mixes future positions; it cannot be causal.",
         extras="LinformerProjections",
         defaults=lambda window, max_length: {"k": 256 if max_length >= 1024 else 32},
         arguments=("k", "sharing"), from_inputs="linformer_from_inputs",
         no_pattern="it projects keys and values along the length axis, so every compressed "
                    "key mixes all positions, predicted tokens included."),
    Kind("lsh", "lsh", "lsh_attention", masks=("lsh_pair_counts",), shared_qk=True,
         paper="Reformer (Kitaev et al. 2020)", summary="LSH buckets, shared query-key",
         aliases=("reformer",),
         extras="LshKey", defaults=_lsh_defaults,
         arguments=("chunk_size", "num_buckets", "num_hashes"), cost="subquadratic",
         no_pattern="its hash buckets decide the pairs from the data, not from positions."),
    Kind("sparse", "sparse_patterns", "sparse_attention", masks=("strided_mask", "fixed_mask"),
         paper="Sparse Transformer (Child et al. 2019)", summary="strided or fixed patterns",
         aliases=("sparse_transformer",),
         defaults=lambda window, max_length: {"pattern": "fixed", "stride": max(4, window)},
         arguments=("block_size", "num_summary_offsets", "pattern", "stride",
                    "summary_width"), cost="subquadratic", pattern="sparse_pattern",
         backends=_BLOCK_MASK_BACKENDS),
    Kind("synthesizer", "synthesizer", "synthesizer_attention", extras="SynthesizerParams",
         paper="Synthesizer (Tay et al. 2021)", summary="synthesized weights mixed with dot product",
         defaults=lambda window, max_length: {"components": "random+dot_product"},
         arguments=("components", "hidden", "k"), cost="quadratic",
         no_pattern="its synthesized weights are per position, not masked pairs of tokens."),
)}


def names() -> tuple[str, ...]:
  """Every valid kind name, sorted."""
  return tuple(sorted(KINDS))


def names_where(test: Callable[[Kind], Any]) -> tuple[str, ...]:
  """The sorted names of the kinds whose record passes `test` (e.g. `lambda k: k.relative`)."""
  return tuple(name for name in names() if test(KINDS[name]))


def get(name: str) -> Kind:
  """The record of kind `name`; raises ValueError listing the valid names when it is unknown."""
  try:
    return KINDS[name]
  except (KeyError, TypeError):
    raise ValueError(
        f"unknown attention {name!r}; valid names: {', '.join(names())}.") from None


def defaults(name: str, *, window: int, max_length: int) -> dict[str, Any]:
  """Default config arguments of kind `name` in a model over `max_length` tokens (a new dict)."""
  return dict(get(name).defaults(window, max_length))


def aliases() -> dict[str, str]:
  """Every alias -> the name of its kind."""
  return {alias: kind.name for kind in KINDS.values() for alias in kind.aliases}


def resolve(name: str) -> str:
  """The kind name of `name`, a kind's name or one of its aliases (`performer` -> `favor`);
  an unknown one raises ValueError listing the names and the aliases."""
  if name in KINDS:
    return name
  known = aliases()
  if name in known:
    return known[name]
  listed = ", ".join(f"{alias} ({kind})" for alias, kind in sorted(known.items()))
  raise ValueError(f"unknown attention {name!r}; valid names: {', '.join(names())}; or a "
                   f"paper's name: {listed}.")


def _check_new_names(kind: Kind) -> None:
  taken = set(KINDS) | set(aliases())
  for name in (kind.name, *kind.aliases):
    if name in taken:
      raise ValueError(f"attention kind {kind.name!r}: the name {name!r} is already "
                       f"registered.")
    taken.add(name)


def register(kind: Kind) -> Kind:
  """Adds `kind` to `KINDS` (a kind defined outside this module, or in a test); returns it.

  Raises ValueError when its name or an alias is taken or `copy_of` names an unknown kind."""
  if kind.name in KINDS:
    raise ValueError(f"attention kind {kind.name!r} is already registered.")
  _check_new_names(kind)
  if kind.copy_of is not None:
    get(kind.copy_of)
  KINDS[kind.name] = kind
  return kind


def unregister(name: str) -> None:
  """Removes a kind added by `register`."""
  get(name)
  del KINDS[name]


def check_permutation(kinds_used: Iterable[str]) -> None:
  """Raises ValueError (one line) for the first kind MPNet's permutation masks cannot be
  composed with, saying why."""
  for name in kinds_used:
    kind = get(name)
    if kind.pattern is None:
      raise ValueError(f"config.pretrain.objective = 'mpnet' with attention {name!r}: its "
                       f"masks cannot be composed with MPNet's permutation: "
                       f"{kind.no_pattern} Use mlm, or another kind.")


_ALIASES = [alias for kind in KINDS.values() for alias in kind.aliases]
if len(set(_ALIASES)) != len(_ALIASES) or set(_ALIASES) & set(KINDS):
  raise ValueError(f"attention kind aliases must be unique and not kind names: {_ALIASES}")
for _kind in KINDS.values():
  if _kind.copy_of is not None:
    get(_kind.copy_of)


__all__ = ["ARGUMENTS", "BACKENDS", "COSTS", "KINDS", "Kind", "RELATIVE_FORMS", "aliases",
           "check_permutation", "defaults", "get", "names", "names_where", "register", "resolve",
           "unregister"]
