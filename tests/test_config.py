"""Every config option and recipe composes and validates; bad configs stop before training."""

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ortflow.errors import OrtflowError
from ortflow.paths import config_dir
from ortflow.validate import problems, validate
from tests.conftest import REPO, make_cfg

NOT_GROUPS = ("recipe", "hparams_search", "hydra")  # presets and Hydra's own groups, tested elsewhere
OPTIONAL = ("peft",)  # groups with no default, added with +group=option
GROUPS = sorted(p.name for p in config_dir().iterdir() if p.is_dir() and p.name not in NOT_GROUPS)
RECIPES = sorted(p.stem for p in (REPO / "recipes").rglob("*.yaml"))
ACCELS = sorted(p.stem for p in (config_dir() / "accel").glob("*.yaml"))


def test_the_config_tree_has_every_group_the_runner_needs():
    expected = {"model", "data", "accel", "distributed", "debug", "optim", "scheduler", "trainer", "logger"}
    assert expected <= set(GROUPS)
    assert set(ACCELS) == {"none", "ortmodule", "artifacts", "compile", "auto"}
    assert {"transformer", "digits"} <= set(RECIPES)


@pytest.mark.parametrize(
    "override",
    [
        f"{'+' if group in OPTIONAL else ''}{group}={p.stem}"
        for group in GROUPS
        for p in sorted((config_dir() / group).rglob("*.yaml"))
    ],
)
def test_every_group_option_composes(override):
    group = override.split("=")[0].lstrip("+")
    extra = {  # options that need a companion setting to be complete
        "debug": ["accel=ortmodule"],  # debug options apply to ortmodule only
        "model=custom": ["model._target_=tests.helpers.user_model.build_bigram"],  # custom has no builder of its own
        "model=mlp": ["data=digits"],  # the MLP takes digits' 64 features, not token ids
        "data=custom": ["data._target_=tests.helpers.zoo.masked_text"],
        "data=diabetes": ["model=mlp", "loss=mse"],
        "data=image_folder": ["data.root=/any/folder"],  # the user's folder is required
        "loss=custom": ["loss._target_=tests.helpers.zoo.mean_abs_error"],
        "loss=mse": ["objective=eval/mae"],
    }
    cfg = make_cfg(override, *extra.get(group, []), *extra.get(override, []))
    assert cfg[group] is not None
    if not (group == "scheduler" and cfg.scheduler.warmup_steps >= cfg.trainer.max_steps):
        found = problems(cfg)
        if override == "distributed=deepspeed" and importlib.util.find_spec("deepspeed") is None:
            found = [p for p in found if "pip install 'ortflow[deepspeed]'" not in p]  # an optional extra
        assert found == []


@pytest.mark.parametrize("search", sorted(p.stem for p in (config_dir() / "hparams_search").glob("*.yaml")))
def test_every_hparams_search_composes_with_its_sweeper(search):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", [f"+hparams_search={search}"], return_hydra_config=True)
    assert cfg.hydra.sweeper.params and cfg.objective == "eval/loss"
    validate(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))


@pytest.mark.parametrize("accel", ACCELS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates_with_every_accel(recipe, accel):
    cfg = make_cfg(f"+recipe={recipe}", f"accel={accel}")
    assert cfg.accel._target_ == f"ortflow.accel.{accel}.build"
    validate(cfg)


def test_custom_model_without_a_builder_names_the_missing_key():
    assert any(p.startswith("model._target_ is required") for p in problems(make_cfg("model=custom")))


def test_recipe_overrides_really_apply():
    base, recipe = make_cfg(), make_cfg("+recipe=digits")
    assert recipe.model._target_.endswith("build_mlp") and base.model._target_.endswith("build_transformer")
    assert recipe.trainer.max_steps == 300


def test_command_line_overrides_win_over_the_recipe():
    cfg = make_cfg("+recipe=transformer", "trainer.max_steps=7", "model.d_model=64")
    assert (cfg.trainer.max_steps, cfg.model.d_model) == (7, 64)


def test_seed_zero_is_a_real_seed_and_flows_to_the_data():
    cfg = make_cfg("seed=0")
    assert cfg.seed == 0 and cfg.data.seed == 0
    assert make_cfg("seed=5").data.seed == 5


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("accel=foo", "accel/foo"),
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("trainer.nope=1", "trainer.nope"),
        ("model.d_model=wide", "model.d_model"),
        ("optim.name=adam", "optim.name"),
        ("debug.log_level=LOUD", "debug.log_level"),
        ("+recipe=missing_recipe", "recipe/missing_recipe"),
    ],
)
def test_schema_rejects_bad_overrides_naming_the_key(override, named):
    with pytest.raises(Exception) as info:
        make_cfg(override)
    chain = f"{info.value} {info.value.__cause__} {info.value.__context__}"
    assert named in chain


def test_cross_field_problems_are_reported_together_naming_each_key():
    cfg = make_cfg("accel=artifacts", "accel.opset=17", "debug=onnx", "trainer.max_steps=0", "optim.lr=-1")
    with pytest.raises(OrtflowError) as info:
        validate(cfg)
    message = str(info.value)
    for key in ("accel.opset=17", "debug", "trainer.max_steps=0", "optim.lr=-1"):
        assert key in message


@pytest.mark.parametrize("override", ["+trainer.nope=1", "+accel.threads=2", "+top_level=1"])
def test_keys_appended_with_plus_that_no_schema_declares_are_refused(override):
    key = override[1:].split("=")[0]
    found = problems(make_cfg(override))
    assert any(p.startswith(f"{key} is not a setting") for p in found), found


def test_artifacts_sgd_with_momentum_is_refused():
    found = problems(make_cfg("accel=artifacts", "optim=sgd", "optim.momentum=0.9"))
    assert any("optim.momentum" in p for p in found)


def test_the_user_can_add_a_recipe_directory(tmp_path: Path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /optim: sgd\ntrainer:\n  max_steps: 12\n"
    )
    cfg = make_cfg(f"hydra.searchpath=[file://{tmp_path}]", "+recipe=mine")
    assert cfg.trainer.max_steps == 12 and cfg.optim.name.value == "sgd"
