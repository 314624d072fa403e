"""The Engine's sampler (a mixin of runner.Engine): sampling.sample (HF's penalty, temperature,
top-k, top-p, min-p) over a decoding step's logits, with min_new_tokens' EOS mask and the
repetition penalty's seen ids; compiled with the layers on a GPU (compiled)."""

from __future__ import annotations

import torch

from ..sampling import sample  # HF's penalty, temperature, top-k, top-p, min-p: on the device


def compiled(compile: bool, device):
    """The Engine's sampler: sampling.sample compiled where the layers are, on a GPU, or None."""
    return (torch.compile(sample, dynamic=False)
            if compile and torch.device(device).type == "cuda" else None)


class Sampler:
    """draw: the Engine's tokens from its logits. It reads the Engine's sampler (compiled, or
    None), seen (the repetition penalty's ids) and eos_ids (min_new_tokens)."""

    def draw(self, logits: torch.Tensor, how: tuple, generator=None, read=None, held=None):
        """sampling.sample over the slots' logits [slots, V] (bf16 on a GPU: the sampler reads them
        once, in float32 inside its kernels); compiled with the layers on a GPU, where its passes
        over [N, V] fuse (its Exp(1) noise drawn eagerly from `generator`, graph-safe). read
        [slots]: the tokens the step fed, marked seen first when how has a repetition penalty.
        held [slots] (min_new_tokens): HF's MinNewTokensLengthLogitsProcessor, which runs after the
        penalty and before the temperature: the EOS ids' logits -inf in those rows, so that the
        token and its log-prob are the masked distribution's (the penalty leaves -inf as it is)."""
        if held is not None:
            logits = logits.masked_fill(held[:, None].bool() & self.eos_ids, float("-inf"))
        seen = None
        if how[4] != 1:  # HF penalises the ids in input_ids: the prompt and every token read
            seen = self.seen.scatter_(1, read[:, None], True)
        if self.sampler is None:
            return sample(logits, *how, seen=seen, generator=generator)
        if how[0] == 0:  # greedy: no noise
            return self.sampler(logits, *how, seen=seen)
        noise = torch.empty(logits.shape, device=logits.device).exponential_(generator=generator)
        return self.sampler(logits, *how, seen=seen, noise=noise)
