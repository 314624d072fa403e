"""The rollout's sampler on the device: HF's repetition penalty, temperature, top-k, top-p and
min-p, then one draw, with no sort of the vocabulary, no host sync and no data-dependent shape.

sample(logits [R, V], ...) -> (tokens [R], log-probs [R]): the kept set is HF's processors' (in
the order HF's generate applies them); the draw is an exponential race, argmax over the kept set
of exp(s - max) / E with E ~ Exp(1) (torch.multinomial's own algorithm for one sample); the
log-prob is the token's under the temperature-scaled softmax over the whole vocabulary of the
penalised logits (before top-k/top-p/min-p). How each step is computed, what it reads and how it
was measured: docs/engine.md (the sampler, step by step).

Sampling: how a rollout's completions are drawn, one object passed whole from the command line
(cli.sampling) to generation.generate, evaluation.evaluate and the engine.
"""
from dataclasses import dataclass

import torch

RADIX_BITS = 8
BUCKETS = 1 << RADIX_BITS


@dataclass(frozen=True)
class Sampling:
    """What is drawn (HF generate's names and meanings; 0, 1, 0, 1, 0 are off) and by which path
    (--gen-mode and its settings; docs/engine.md)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0  # EOS masked for a completion's first tokens
    mode: str = "shared-prefill"  # --gen-mode: repeat, shared-prefill, static, engine, engine-tp
    gen_batch_size: int = 256  # rows a generate call (the engine: slots)
    unshard: bool = False  # --gen-unshard (FSDP2: each layer gathered once a generate call)
    cuda_graphs: bool = True  # --gen-cuda-graphs (the engine's decode step)
    engine_dtype: str = "auto"  # --gen-dtype: the engine's weights' precision
    flex: bool | None = None  # the engine's attention: FlexAttention (None: where it runs)
    compile_step: bool | None = None  # the engine's compiled decode step (None: on a GPU)


def sample(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, repetition_penalty: float = 1.0, *,
           seen: torch.Tensor | None = None, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None):
    """One token a row from HF's processed softmax of logits [R, V] (bf16 or fp32) -> (tokens [R]
    int64, log-probs [R] float32 under softmax(penalised logits / temperature) over the whole
    vocabulary). top_k 0, top_p 1, min_p 0 and repetition_penalty 1 are off. seen: [R, V] bool,
    the ids each row has read (needed with a penalty). noise: Exp(1) draws [R, V] (float32), else
    drawn from `generator` (default: torch's global stream on the logits' device)."""
    x = penalise(logits.float(), repetition_penalty, seen)
    if temperature == 0:  # a Python value: no branch on the data
        tokens = x.argmax(-1)
        logp = x.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(x, -1)
        return tokens, logp
    s, keep, e, lse = _warp(x, temperature, top_k, top_p, min_p)
    if noise is None:
        noise = torch.empty_like(s).exponential_(generator=generator)
    # the race: argmax of e / E, e = exp(s - max) (Gumbel-max: argmax s - log E), as
    # torch.multinomial draws one sample; removed tokens score -1, below any kept one
    race = e / noise
    if keep is not None:
        race = race.masked_fill(~keep, -1.0)
    tokens = race.argmax(-1)
    logp = s.gather(1, tokens[:, None])[:, 0] - lse
    return tokens, logp


def kept(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
         min_p: float = 0.0):
    """The kept set [R, V] bool: True where HF's warpers leave a finite score."""
    s, keep, _, _ = _warp(logits.float(), temperature, top_k, top_p, min_p)
    return torch.ones_like(s, dtype=torch.bool) if keep is None else keep


def penalise(x: torch.Tensor, penalty: float, seen: torch.Tensor | None) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor on float32 logits x [R, V]: a seen id's logit divided
    by the penalty when positive, multiplied when negative (both make it less likely for a
    penalty > 1); the rest as they are. penalty 1: x itself."""
    if penalty == 1.0:  # a Python value: no branch on the data
        return x
    if seen is None:
        raise ValueError("a repetition penalty needs `seen`, the ids each row has read")
    return torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)


def _warp(x, temperature, top_k, top_p, min_p=0.0):
    """-> (scores s [R, V], kept [R, V] bool or None for all, exp(s - max) [R, V], log Z [R])."""
    s = x / temperature  # HF divides (TemperatureLogitsWarper), in float32
    vocab = s.shape[-1]
    k = min(top_k, vocab) if top_k > 0 else 0
    keep = top = None
    if k:
        top = torch.topk(s, k).values  # [R, k], descending: top[:, :1] is the max
        m = top[:, :1]
        keep = s >= top[:, -1:]
    else:
        m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    z = e.sum(-1)
    lse = m[:, 0] + torch.log(z)
    if top_p < 1.0:
        key = _key(s)
        if k:
            zk = torch.where(keep, e, 0.0).sum(-1, keepdim=True)
            cand_key, cand_mass = _key(top), torch.exp(top - m)
        else:
            zk = z[:, None]
            cand_key, cand_mass = key, e
        target = top_p * zk  # keep j iff the mass strictly above j is < top_p (of the kept mass)
        v, above = _boundary(cand_key, cand_mass, target)
        tie = key == v  # the boundary's tie group (all inside top-k's set: v >= the k-th value)
        # members of higher index rank above (a stable ascending sort puts them last)
        higher = tie.sum(-1, keepdim=True, dtype=torch.int32) - tie.cumsum(-1, dtype=torch.int32)
        q = torch.exp(_value(v) - m)  # one member's mass
        in_group = tie & ((higher == 0) | (above + higher * q < target))
        keep_p = (key > v) | in_group
        keep = keep_p if keep is None else keep & keep_p
    if min_p > 0:  # p_j >= min_p max p, i.e. exp(s_j - max) >= min_p (the max: exp(0) = 1)
        keep = e >= min_p if keep is None else keep & (e >= min_p)
    return s, keep, e, lse


def _key(s: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 whose signed order is the floats' order (-0.0 and +0.0 one key)."""
    bits = s.view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return key.masked_fill(key == -1, 0)  # -0.0's key is -1: as +0.0


def _value(key: torch.Tensor) -> torch.Tensor:
    """The inverse of _key (the flip of the low 31 bits under a set sign is its own inverse)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).view(torch.float32)


def _boundary(key: torch.Tensor, mass: torch.Tensor, target: torch.Tensor):
    """Radix select from the top: the largest key v such that the mass of keys >= v reaches
    target (or the smallest key with mass if none does) -> (v [R, 1] int32, the mass of keys > v
    [R, 1]). Four rounds of 8 bits of the key, each a histogram of the mass inside the range of
    keys the rounds before fixed (int32 keys throughout: no int64 copy of [R, W])."""
    rows = key.shape[0]
    buckets = torch.arange(BUCKETS, device=key.device)
    low = torch.full((rows, 1), -(1 << 31), dtype=torch.long, device=key.device)  # range's start
    above = torch.zeros(rows, 1, dtype=mass.dtype, device=key.device)
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        # the digit of the unsigned key (sign bit flipped); & drops the arithmetic shift's sign
        digit = ((key >> shift) & (BUCKETS - 1)).long()
        if shift == 32 - RADIX_BITS:
            digit = digit ^ (BUCKETS >> 1)
            w = mass
        else:
            span = 1 << (shift + RADIX_BITS)
            w = torch.where((key >= low) & (key < low + span), mass, 0.0)
        hist = torch.zeros(rows, BUCKETS, dtype=mass.dtype, device=key.device)
        hist = hist.scatter_add(1, digit, w)
        down = hist.flip(-1).cumsum(-1).flip(-1)  # mass of buckets >= b
        over = torch.cat([down[:, 1:], torch.zeros_like(down[:, :1])], -1)  # buckets > b
        filled = hist > 0
        reach = filled & (above + down >= target)
        hi = torch.where(reach, buckets, -1).amax(-1, keepdim=True)
        lo = torch.where(filled, buckets, BUCKETS).amin(-1, keepdim=True)
        b = torch.where(hi >= 0, hi, lo)
        above = above + over.gather(1, b)
        low = low + (b << shift)
    return low.int(), above
