"""A pagedspec draft checkpoint as a ``transformers`` model, for ``generate(assistant_model=...)``.

A draft that borrows tensors from its target (``pagedspec_borrowed_weights`` in config.json, e.g.
the shipped SmolLM2 draft, which reuses the target's embedding) cannot be loaded by
``from_pretrained`` alone: the borrowed tensors are not in its file and would be left random.
:func:`load_draft_in_transformers` fills them from the target model. In ``transformers`` the
draft keeps its full vocabulary (its ``draft_vocab.json`` is pagedspec's restriction of the LM
head); it is a valid assistant either way. ``transformers`` is imported on use only: it is not a
runtime dependency of pagedspec.
"""
from __future__ import annotations

import os
from typing import Union

import torch

from pagedspec.models.loader import CheckpointError, load_checkpoint


def load_draft_in_transformers(draft: Union[str, os.PathLike], target,
                               dtype: torch.dtype = torch.float32):
    """The draft checkpoint ``draft`` (a directory or shipped name) as a ``transformers`` causal
    LM in ``dtype``, eval mode, its borrowed tensors copied from ``target`` (a ``transformers``
    model of the target, e.g. ``AutoModelForCausalLM.from_pretrained(target_dir)``).

    Raises CheckpointError when a tensor would be left uninitialized or is unexpected."""
    import transformers
    from safetensors.torch import load_file

    ckpt = load_checkpoint(draft)
    if ckpt.config.eagle:
        raise CheckpointError(f"{ckpt.path}: an EAGLE head, which reads the target's hidden "
                              "states; transformers' assisted generation runs standalone drafts "
                              "only")
    if ckpt.path.is_file():
        raise CheckpointError(f"{ckpt.path}: a GGUF draft; load it with transformers' "
                              "from_pretrained(gguf_file=...)")
    config = transformers.AutoConfig.from_pretrained(ckpt.path)
    model = transformers.AutoModelForCausalLM.from_config(config)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(set(ckpt.weight_files.values())):
        state.update(load_file(path))
    lent = dict(target.named_parameters())
    for name in ckpt.borrowed_weights:
        if name not in lent:
            raise CheckpointError(f"{ckpt.path}: borrows {name!r}, which the target model "
                                  f"({type(target).__name__}) does not have")
        state[name] = lent[name].detach()
    tied = getattr(config, "tie_word_embeddings", False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    unexpected = [u for u in unexpected if not u.endswith(("k_scale", "v_scale"))]
    if missing or unexpected:
        what = (f"no value for {missing[0]!r} ({len(missing)} missing)" if missing
                else f"unexpected tensor {unexpected[0]!r}")
        raise CheckpointError(f"{ckpt.path}: as a transformers "
                              f"{type(model).__name__}: {what}")
    if tied:
        model.tie_weights()
    return model.to(dtype).eval()
