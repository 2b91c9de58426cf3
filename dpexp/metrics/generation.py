"""Beam-search decoding of token-id prompts with a causal language model or an encoder-decoder
(transformers' ``generate``).

Li et al. (2022, app. K) decode E2E and DART with beam size 5; He et al. (2023, app. C.2) decode SAMSum with
beam size 4. Prompts are left-padded per batch (a causal LM continues from the last position, so padding
goes in front and is masked out); batches are formed from prompts of similar length and the original order
is restored, which does not change any output. An encoder-decoder (``model.config.is_encoder_decoder``)
reads the prompt with its encoder and returns only the decoder's tokens, after its start token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _strip_after_eos(ids: list[int], eos_token_id: int) -> list[int]:
    """Keep the tokens before the first end-of-sequence token (the rest is eos or padding)."""
    return ids[: ids.index(eos_token_id)] if eos_token_id in ids else ids


@torch.no_grad()
def beam_search(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    eos_token_id: int,
    num_beams: int,
    max_new_tokens: int,
    batch_size: int,
) -> list[list[int]]:
    """Continue every prompt by beam search; return the generated ids of each, without prompt and eos.

    ``prompts[i]`` is a non-empty list of token ids; output ``i`` has at most ``max_new_tokens`` ids.
    The model is put in eval mode for decoding and restored to its previous mode afterwards.
    """
    if batch_size < 1 or num_beams < 1 or max_new_tokens < 1:
        raise ValueError(
            f"batch_size ({batch_size}), num_beams ({num_beams}) and max_new_tokens ({max_new_tokens}) "
            "must all be positive"
        )
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token (the separator) to condition on")
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in rows)
            input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                input_ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i], dtype=torch.long)
                attention_mask[r, width - len(prompts[i]) :] = 1
            generated = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                num_beams=num_beams,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_token_id,
                eos_token_id=eos_token_id,
            )
            start = 1 if getattr(model.config, "is_encoder_decoder", False) else width
            for r, i in enumerate(rows):
                outputs[i] = _strip_after_eos(generated[r, start:].tolist(), eos_token_id)
    finally:
        model.train(was_training)
    return outputs
