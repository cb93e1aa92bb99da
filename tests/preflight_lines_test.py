"""The attention lines a run prints (`lra.preflight_lines`): each layer's backend as the layer
itself chooses it, so on a GPU a causal band layer (MQAR's decoder) names cuDNN's sliding
window and a bidirectional one (a classifier's) the Pallas band kernel. (The character LMs'
relative positions compute with xla everywhere.)"""
import pytest

import configs
from lra import preflight_lines
from lra import tasks


@pytest.mark.parametrize("task, arg, causal", [
    ("text8", "attention=band,size=small", True),
    ("mqar", "", True),
    ("listops", "attention=band,size=small", None),
    ("needle", "attention=band", True),
    ("needle", "attention=band,variant=bidirectional", None),
])
def test_the_task_says_whether_its_layers_are_causal(task, arg, causal):
  config = configs.build_config(task, arg=arg)
  assert tasks.get_task(config.task).causal_attention(config.model) is causal


@pytest.mark.parametrize("task, platform, backend", [
    ("mqar", "gpu", "cudnn"),       # causal band: cuDNN's one-sided window
    ("listops", "gpu", "pallas"),   # bidirectional band: the band kernel
    ("text8", "gpu", "xla"),        # relative positions
    ("mqar", "cpu", "xla"),
    ("listops", "tpu", "splash"),
])
def test_band_layers_name_the_backend_their_layer_chooses(task, platform, backend):
  config = configs.build_config(task, arg="attention=band")
  pairs = preflight_lines.layer_backends(config, platform)
  assert pairs and all(pair == ("band", backend) for pair in pairs), pairs
  lines = preflight_lines.attention_lines(config, platform)
  assert lines and all(line.endswith(f"band         {backend} (auto on {platform})")
                       for line in lines), lines
