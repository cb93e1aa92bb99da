"""A run's identity, read from its config's own fields: the task (`config.task`), the size
(`config.size`) and the attention kind with its arguments (`config.model.attention`).

Each task config sets these once (`configs.common.set_attention`); everything that names a run
derives from them here: the banner's label, the default workdir's name and the `get_config`
argument that rebuilds the task's default config of the same identity (what `lra results` and
the dry run compare a run's fields with). Nothing else reads a run's identity back from text.

The functions take a `ConfigDict` or the plain dict of a `config.json`. A `config.json` written
before the size was a field holds it only in the `config_arg` text it had instead ("attention=
band,size=small,window=0"); `size` and `kind` read it from there, the one place that does.
"""

from __future__ import annotations

from typing import Any, Mapping


def _get(tree: Any, key: str, default: Any = None) -> Any:
  return tree.get(key, default) if isinstance(tree, Mapping) or hasattr(tree, "get") else default


def upgraded(saved: dict[str, Any]) -> dict[str, Any]:
  """A config.json's dict as this version writes it: an older one's `config_arg` becomes the
  `size` field (the kind is model.attention.kind in both), so comparing a finished run's
  config with the same command's config sees no change where there is none."""
  if not isinstance(saved, dict) or "config_arg" not in saved:
    return saved
  out = {k: v for k, v in saved.items() if k != "config_arg"}
  out.setdefault("size", size(saved))
  return out


def attention(config: Any) -> Mapping[str, Any]:
  """The model's attention settings (kind and its arguments); {} when there are none."""
  found = _get(_get(config, "model") or {}, "attention")
  return found if found is not None and hasattr(found, "get") else {}


def _legacy(config: Any, key: str) -> str:
  """Item `key` of the `config_arg` text of a config.json from before the size was a field."""
  text = _get(config, "config_arg")
  items = (item.partition("=") for item in (text if isinstance(text, str) else "").split(","))
  return next((value.strip() for name, _, value in items if name.strip() == key), "")


def kind(config: Any) -> str:
  """The attention kind of every layer that does not set its own (`model.attention.kind`)."""
  return str(_get(attention(config), "kind") or _legacy(config, "attention"))


def size(config: Any) -> str:
  """The config's size (`small`, `base`, ...; a memory LM's `xl-small`); "" when unknown."""
  return str(_get(config, "size") or _legacy(config, "size"))


def arg(config: Any) -> str:
  """The `get_config` argument that builds the task's default config of this identity,
  `attention=band,size=small`: the window and every other field at the task's default, so that
  a window set by `window=` or by `--config.model.attention.window` shows as a change."""
  return f"attention={kind(config)},size={size(config)}"


def workdir_name(config: Any, task: str | None = None) -> str:
  """The default workdir's folder name: `TASK-KIND-SIZE` (the config's task unless `task` is
  given), with `-spt-OBJECTIVE` for a self-pretrained run (which never shares a scratch run's
  folder)."""
  spt = ""
  if _get(config, "protocol", "scratch") == "spt":
    spt = f"-spt-{_get(_get(config, 'pretrain') or {}, 'objective')}"
  return f"{task or _get(config, 'task')}-{kind(config)}-{size(config)}{spt}"


def label(config: Any) -> str:
  """What a banner says a run is: its attention kind, size and the effective window (the
  config's, not the `window=0` of an argument that left it at the kind's default), and the
  backend when one is named: `attention=band,size=small,window=16`."""
  settings = attention(config)
  parts = [f"attention={kind(config)}"]
  if size(config):
    parts.append(f"size={size(config)}")
  value = _get(settings, "window")
  if isinstance(value, (list, tuple)):
    value = ",".join(map(str, value))
  if value is not None:
    parts.append(f"window={value}")
  if _get(settings, "implementation") not in (None, "", "auto"):
    parts.append(f"implementation={settings['implementation']}")
  return ",".join(parts)
