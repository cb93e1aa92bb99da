"""The Transformer-XL / compressive memory settings' check (`check_memory`, part of
`lra.schema.check`): lengths, the compression rate and function, what a memory needs (the causal
kinds with relative positions, one stream per batch row) and what needs a memory.

Standard library and the attention kinds' records only (no jax), like `lra.schema`.
"""

from __future__ import annotations

from attention import kinds

COMPRESSIONS = ("mean", "max", "conv")   # the Compressive Transformer's compression functions


def check_memory(config) -> None:
  """Raises ValueError (one line) for a bad Transformer-XL / compressive memory setting."""
  model, data = config.get("model", {}), config.get("data", {})
  m_len, n_cm = model.get("memory_length", 0), model.get("compressed_length", 0)
  rate, kind = model.get("compression_rate", 1), model.get("compression", "conv")
  eval_fields = (("model.eval_memory_length", model.get("eval_memory_length", 0)),
                 ("model.clamp_len", model.get("clamp_len", 0)),
                 ("data.eval_streams", data.get("eval_streams", 0)))
  for field, v in (("model.memory_length", m_len), ("model.compressed_length", n_cm),
                   ("model.segment_length", model.get("segment_length", 0))) + eval_fields:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      raise ValueError(f"config.{field} = {v!r}: must be an integer >= 0 (0: none).")
  if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
    raise ValueError(f"config.model.compression_rate = {rate!r}: must be an integer >= 1.")
  if kind not in COMPRESSIONS:
    raise ValueError(f"config.model.compression = {kind!r}: must be one of "
                     f"{', '.join(COMPRESSIONS)} (the compression function).")
  same = model.get("same_length", False)
  if not isinstance(same, bool):
    raise ValueError(f"config.model.same_length = {same!r}: must be true or false (evaluation "
                     f"with every query seeing the same number of keys).")
  if same and not m_len:
    raise ValueError("config.model.same_length = True: needs config.model.memory_length > 0 (a "
                     "model without memory evaluates independent windows).")
  if not m_len:
    if n_cm:
      raise ValueError(f"config.model.compressed_length = {n_cm}: needs "
                       "config.model.memory_length > 0 (the memory feeds the compression).")
    for field, v in eval_fields:
      if v:
        raise ValueError(f"config.{field} = {v}: needs config.model.memory_length > 0 (a "
                         "model without memory evaluates independent windows).")
    return
  used = {model.attention.get("kind")} | {a.get("kind", model.attention.get("kind"))
                                         for a in (model.get("layer_attention") or ())}
  bad = sorted(k for k in used if not kinds.get(k).memory)
  if bad or model.get("pos_emb") != "relative":
    memory = kinds.names_where(lambda k: k.memory)
    raise ValueError(f"config.model.memory_length = {m_len}: needs the causal kinds "
                     f"{' or '.join(memory)} with pos_emb='relative', not attention "
                     f"{', '.join(bad or sorted(used))} with pos_emb={model.get('pos_emb')!r}.")
  length = data.get("max_length", 0)
  if n_cm and length % rate:
    raise ValueError(f"config.model.compression_rate = {rate}: must divide the segment "
                     f"config.data.max_length = {length}.")
  seg = model.get("segment_length", 0) or m_len
  if n_cm and seg % rate:
    raise ValueError(f"config.model.compression_rate = {rate}: must divide the evaluation "
                     f"segment {seg} (config.model.segment_length, 0: memory_length).")
  if data.get("streams", 0) != config.get("batch_size"):
    raise ValueError(f"config.data.streams = {data.get('streams', 0)!r}: must equal "
                     f"config.batch_size = {config.get('batch_size')} with a memory (each batch "
                     "row one contiguous stream).")
