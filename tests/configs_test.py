"""Tests for configs/: every attention kind and size builds, arguments are checked, the sweep
covers every kind, and the docstring gives the command."""

import ml_collections
import pytest

import attention
import configs
from configs import common, listops
from lra import identity, schema
from lra import phases


@pytest.mark.parametrize("size", listops.SIZES)
@pytest.mark.parametrize("kind", sorted(attention.REGISTRY))
def test_every_kind_and_size_builds(kind, size):
  c = listops.get_config(f"attention={kind},size={size}")
  assert isinstance(c, ml_collections.ConfigDict)
  assert c.model.attention.kind == kind and c.task == "listops"
  assert c.data.max_length > 0 and c.batch_size % 8 == 0 and c.eval_batch_size % 8 == 0
  assert c.model.qkv_dim % c.model.num_heads == 0
  c.to_json_best_effort()  # the trainer saves it


def test_base_is_the_lra_setting():
  c = listops.get_config("size=base")
  assert (c.data.max_length, c.model.num_layers, c.model.emb_dim, c.model.num_heads) == \
      (2000, 4, 512, 8)
  assert (c.model.mlp_dim, c.batch_size, c.num_train_steps) == (1024, 32, 5000)
  assert (c.learning_rate, c.schedule, c.warmup_steps, c.weight_decay) == \
      (0.05, "rsqrt", 1000, 0.1)


def test_small_is_sized_for_a_cpu():
  small, base = listops.get_config("size=small"), listops.get_config("size=base")
  assert small.data.max_length < base.data.max_length
  assert small.data.gen_max_length <= small.data.max_length + 1
  assert small.model.emb_dim < base.model.emb_dim


def test_cpu_size_resolves_validates_and_ends_at_the_lra_length():
  c = configs.build_config("listops", size="cpu")
  schema.check(c)
  staged = [phases.phase_config(c, k) for k in range(len(c.phases))]
  for k, p in enumerate(staged):
    schema.check(p, context=f"config.phases[{k}] gives ")
  base = listops.data_config()
  assert c.model.attention.kind == "band" and c.model.pool == "cls"
  assert c.model.pos_emb == "sinusoidal"   # no parameter depends on the length
  # the LRA data and evaluation length: trees of 500-2,000 tokens, 2,000 test trees
  for key in ("max_length", "gen_min_length", "gen_max_length", "num_test"):
    assert c.data[key] == base[key]
  assert staged[-1].data.max_length == base.max_length
  # the short phase sees every token the CLS output depends on (layers x one-sided window)
  receptive = c.model.num_layers * c.model.attention.window
  assert all(p.data.max_length > receptive for p in staged)
  assert sum(p["steps"] for p in c.phases) == c.num_train_steps


def test_window_argument_reaches_band():
  assert listops.get_config("attention=band,window=7").model.attention.window == 7


def test_bad_arguments_list_the_valid_ones():
  with pytest.raises(ValueError, match="valid names: .*dot_product"):
    listops.get_config("attention=flashy")
  with pytest.raises(ValueError, match="valid sizes: base, small"):
    listops.get_config("size=huge")
  with pytest.raises(ValueError, match="valid arguments: attention, size, window"):
    listops.get_config("layers=3")


def test_parse_arg_types():
  a = common.parse_arg("n=3,x=0.5,flag=false,name=abc", n=1, x=1.0, flag=True, name="")
  assert (a.n, a.x, a.flag, a.name) == (3, 0.5, False, "abc")
  with pytest.raises(ValueError, match="n=three: expected an integer"):
    common.parse_arg("n=three", n=1)


@pytest.mark.parametrize("text, current, expected", [
    ("true", False, True), ("No", True, False), ("1", False, True),
    ("7", 3, 7), ("-2", 3, -2), ("2.5", 1.0, 2.5), ("3", 1.0, 3.0),
    ("abc", "", "abc"), ("12", "", "12"), ("(1, 2)", (), (1, 2)), ("[3]", (4,), (3,)),
    ("8", None, 8), ("fixed", None, "fixed"), ("{'a': 1}", None, {"a": 1}),
])
def test_one_converter_for_args_and_overrides(text, current, expected):
  got = common.convert(text, current)
  assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("text, current, message", [
    ("maybe", True, "true or false"), ("2.5", 3, "an integer"), ("True", 3, "an integer"),
    ("x", 1.0, "a number"), ("5", (1,), "a tuple"),
])
def test_converter_refuses_values_of_another_type(text, current, message):
  with pytest.raises(ValueError, match=message):
    common.convert(text, current)
  with pytest.raises(ValueError, match=message):  # the same rule for `arg` strings
    common.parse_arg(f"k={text}", k=current)


def test_sweep_adds_every_kind_but_exact_copies():
  runs = []
  listops.sweep(lambda **kw: runs.append(kw))
  kinds = {r["config_arg"].split(",")[0].split("=")[1] for r in runs}
  assert kinds == {"adaptive_span", "band", "bigbird", "block_local", "block_sparse",
                   "dot_product", "entmax", "favor", "linear", "linformer", "lsh", "sparse",
                   "synthesizer"}  # not flash
  assert len(runs) == 3 * len(kinds)


def test_docstring_gives_the_command_and_expected_result():
  doc = listops.__doc__
  assert "lra run listops" in doc and "accuracy" in doc


def test_an_attention_kind_override_takes_the_kinds_arguments_as_attention_does():
  """`--config.model.attention.kind=K` is `--attention K`: the task's arguments for K, then the
  other overrides, in whatever order they were given; a paper's name resolves; an unknown name
  is one line naming the field."""
  by_flag = configs.build_config("text", size="small", attention="band")
  by_field = configs.build_config("text", size="small",
                                  overrides=[("model.attention.kind", "band")])
  assert dict(by_field.model.attention) == dict(by_flag.model.attention)
  assert (by_field.size, identity.arg(by_field)) == (by_flag.size, identity.arg(by_flag))
  for order in ([("model.attention.window", "8"), ("model.attention.kind", "band")],
                [("model.attention.kind", "band"), ("model.attention.window", "8")]):
    c = configs.build_config("text", size="small", overrides=order)
    assert dict(c.model.attention) == {"kind": "band", "window": 8}
  back = configs.build_config("listops", size="small", attention="band",
                              overrides=[("model.attention.kind", "dot_product")])
  assert dict(back.model.attention) == {"kind": "dot_product"}     # no band window left over
  favor = configs.build_config("text", size="small",
                               overrides=[("model.attention.kind", "performer")])
  assert favor.model.attention.kind == "favor" and "num_features" in favor.model.attention
  with pytest.raises(ValueError, match=r"^config.model.attention.kind = 'flashy': unknown "
                                       r"attention kind; valid: .*band"):
    configs.build_config("text", overrides=[("model.attention.kind", "flashy")])


def test_a_size_override_takes_the_sizes_fields_as_size_does():
  """`--config.size=S` is `--size S`: every field of that size, then the other overrides; the
  size is a field of the config, read by the run's identity (lra.identity), never parsed back."""
  by_flag = configs.build_config("listops", size="base", attention="band")
  by_field = configs.build_config("listops", size="small", attention="band",
                                  overrides=[("model.emb_dim", "96"), ("size", "base")])
  assert by_field.size == by_flag.size == "base"
  assert by_field.model.num_layers == by_flag.model.num_layers != (
      configs.build_config("listops", size="small").model.num_layers)
  assert by_field.model.emb_dim == 96                  # the other overrides on top
  assert identity.workdir_name(by_field) == "listops-band-base"
  with pytest.raises(ValueError, match="unknown size 'huge'; valid sizes: base, small"):
    configs.build_config("listops", overrides=[("size", "huge")])
