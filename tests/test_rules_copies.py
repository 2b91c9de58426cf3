"""Copies of a layer class take its rule (dpexp.privacy.rules.copies): the same bases and class body but for
``__init__``, as Hugging Face copies Llama's RMSNorm and Gemma's scaled embedding into other models' files;
any difference in code, constants, defaults, the globals the code reads, or bases leaves the class on the
fallback. The models that depend on it are exact in every strategy x clipping mode (test_engine_oracle's
``gemma2`` and ``glm`` cases, and their sensitivity cases)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.rules import rule_for
from dpexp.privacy.rules.copies import is_copy
from tests.engine_models import gemma2, glm

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.func fallback")

SOURCE = """
class Norm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x, scale=1.0):
        return self.weight * helper(x, self.eps) * scale
"""


def _define(source: str = SOURCE, helper=None, **names) -> type:
    """The class of ``source`` defined in a namespace of its own (as in a model file of its own)."""
    namespace = {"nn": nn, "torch": torch, "helper": helper or _normalise, **names}
    exec(source, namespace)
    return namespace["Norm"]


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_a_class_defined_again_from_the_same_source_is_a_copy():
    assert is_copy(_define(), _define())


def test_a_different_init_is_still_a_copy():
    other_init = SOURCE.replace("self.eps = eps", "self.eps = 2 * eps")
    assert is_copy(_define(other_init), _define())


@pytest.mark.parametrize(
    "change",
    [
        ("* scale", "* scale * 2"),  # code
        ("scale=1.0", "scale=2.0"),  # a default
        ("self.eps) * scale", "self.eps + 1e-3) * scale"),  # a constant
        ("        return self.weight", "        y = 1\n        return self.weight"),  # extra code
        ("(nn.Module)", "(nn.Linear)"),  # the bases
    ],
)
def test_a_changed_class_body_is_no_copy(change):
    assert not is_copy(_define(SOURCE.replace(*change)), _define())


def test_an_extra_method_makes_no_copy():
    extra = SOURCE + "\n    def extra_repr(self):\n        return 'x'\n"
    assert not is_copy(_define(extra), _define())


def test_the_same_code_reading_another_helper_is_no_copy():
    """Two module-level helpers of the same name are different objects, whatever their source."""

    def another(x: torch.Tensor, eps: float) -> torch.Tensor:
        return x

    assert not is_copy(_define(helper=another), _define())


def test_a_subclass_is_no_copy():
    original = _define()
    subclass = type("Norm", (original,), {})
    assert not is_copy(subclass, original)


def test_hugging_face_copies_take_the_rule_of_their_original():
    from transformers.models.glm.modeling_glm import GlmRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.xglm.modeling_xglm import XGLMScaledWordEmbedding

    assert rule_for(GlmRMSNorm(4)) is rule_for(LlamaRMSNorm(4))
    embedding = XGLMScaledWordEmbedding(10, 4, padding_idx=0, embed_scale=2.0)
    assert rule_for(embedding).per_example_grads.__name__ == "scaled_embedding_grads"


def test_clips_copies_take_its_class_embedding_rule():
    """GIT's, MetaCLIP-2's, X-CLIP's, AltCLIP's and Chinese-CLIP's vision embeddings are copies of CLIP's
    (stop 54); CLIPSeg's, whose forward differs, is not."""
    import importlib

    from transformers import CLIPVisionConfig

    config = CLIPVisionConfig(
        hidden_size=8, num_attention_heads=2, image_size=8, patch_size=4, num_channels=3
    )
    copies = {"git": "GitVisionEmbeddings", "metaclip_2": "MetaClip2VisionEmbeddings",
              "x_clip": "XCLIPVisionEmbeddings", "altclip": "AltCLIPVisionEmbeddings",
              "chinese_clip": "ChineseCLIPVisionEmbeddings",
              "clipseg": "CLIPSegVisionEmbeddings"}  # fmt: skip
    for family, name in copies.items():
        module = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)(
            config
        )
        rule = rule_for(module)
        assert (rule is not None and rule.per_example_grads.__name__ == "clip_class_embedding_grads") == (
            family != "clipseg"
        ), name


def test_copies_are_looked_up_in_their_own_library_only():
    """A class outside transformers with the body of Llama's RMSNorm takes no rule from it."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    body = {k: v for k, v in vars(LlamaRMSNorm).items() if k not in ("__dict__", "__weakref__", "__init__")}
    outside = type("LlamaRMSNorm", LlamaRMSNorm.__bases__, {**body, "__module__": "user_models"})
    assert is_copy(outside, LlamaRMSNorm)
    assert rule_for(outside()) is None


@pytest.mark.parametrize("factory", [gemma2, glm])
def test_models_built_of_copies_need_no_fallback(factory):
    assert unsupported_modules(factory()) == {}


def _wrapped_forward(cls: type) -> type:
    """A decorator putting one wrapper function around each class's own forward (as transformers'
    ``use_experts_implementation`` does): the wrappers share their code and differ in their closures."""
    original = cls.forward

    def forward(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    cls.forward = forward
    return cls


@pytest.mark.parametrize("same", [True, False])
def test_wrappers_compare_the_functions_they_close_over(same):
    other = SOURCE if same else SOURCE.replace("* scale", "* scale * 2")
    assert is_copy(_wrapped_forward(_define(other)), _wrapped_forward(_define())) is same


def test_zero_argument_super_reads_each_class_itself():
    """``super()`` closes over ``__class__``, a different class in each copy: the same call all the same."""
    source = SOURCE.replace("return self.weight", "return super().forward(x) if False else self.weight")
    assert is_copy(_define(source), _define(source))


def test_a_subclass_that_only_configures_its_parent_takes_its_rule():
    """PoolFormer's GroupNorm subclass only fixes the number of groups in ``__init__``: GroupNorm's rule. A
    subclass that defines anything else (its own forward) takes none."""
    from transformers.models.poolformer.modeling_poolformer import PoolFormerGroupNorm

    class OwnForward(nn.GroupNorm):
        def forward(self, x):
            return super().forward(x) * 2

    assert rule_for(PoolFormerGroupNorm(4)) is rule_for(nn.GroupNorm(1, 4)) is not None
    assert rule_for(OwnForward(1, 4)) is None
