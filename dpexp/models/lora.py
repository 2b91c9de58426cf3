"""LoRA adapters (Hu et al. 2021) on causal LMs (GPT-2, Llama) through peft, as in He et al. (2023, sec. 5.3,
app. C.2).

He et al. fine-tune with LoRA of rank 32 and otherwise "reused hyperparameters adopted by Hu et al. (2021)".
Hu et al. (sec. 4.1) scale the update by alpha / r and set alpha to the first rank they try without tuning
it, hence the default alpha = r = 32 (scale 1). Hu et al. adapt the query and value projections; GPT-2 fuses
query, key and value into one ``c_attn`` Conv1D, so adapting ``c_attn`` adapts all three (peft cannot adapt
a slice of a fused projection). Adding ``c_proj`` would also hit the MLP output projections, which share the
name, so it is not a default. Llama-style models have separate ``q_proj`` and ``v_proj`` linear layers, Hu et
al.'s choice. Only the adapter matrices are trainable; the base model, including a tied input embedding and
output head, is frozen.
"""

from __future__ import annotations

from collections.abc import Sequence

from peft import LoraConfig, get_peft_model
from torch import nn


def apply_lora(
    model: nn.Module,
    rank: int = 32,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("c_attn",),
) -> nn.Module:
    """Wrap a causal LM in peft LoRA: ``W x + (alpha / rank) * B A x`` on each target module.

    A (rank, d_in) is initialised randomly and B (d_out, rank) at zero, so the wrapped model starts equal to
    the base model. GPT-2's Conv1D stores weights as (d_in, d_out), hence ``fan_in_fan_out=True`` when the
    targets are Conv1D layers (``nn.Linear`` targets, as in Llama, store (d_out, d_in)).
    Returns a ``peft.PeftModelForCausalLM`` whose only trainable parameters are the ``lora_A``/``lora_B``.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank}")
    targets = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in set(target_modules)]
    kinds = {type(m).__name__ for m in targets}
    if not targets or len(kinds) > 1:
        raise ValueError(
            f"LoRA target_modules {list(target_modules)} must name layers of one kind in "
            f"{type(model).__name__}; found {sorted(kinds) or 'none'} (GPT-2: c_attn; Llama: q_proj, v_proj)"
        )
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        fan_in_fan_out=kinds == {"Conv1D"},
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, config)
    trainable = [name for name, p in wrapped.named_parameters() if p.requires_grad]
    stray = [name for name in trainable if "lora_" not in name]
    if not trainable or stray:
        raise RuntimeError(f"LoRA left unexpected trainable parameters {stray or 'none at all'}")
    return wrapped
