"""The flags every script shares (CommonArgs, which each script's Args extends with its objective's
own), their checks before any heavy work (one line naming the fix), and the defaults that depend on
the model and the task. Used at the top of each script's main().
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import torch
import tyro

from .checkpoint import STEP_DIR, catch_startup_signals, saved_flags
from .data import check_dataset
from .distributed import fail, launched, main_process
from .evaluation import Evaluation
from .lora import ALL_LINEAR, DEFAULT_ALPHA
from .sampling import Sampling


GenMode = Literal["repeat", "shared-prefill", "static", "engine", "engine-tp"]  # common.GEN_MODES
RolloutIsMode = Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"]
Aggregation = Literal["sum-then-normalize", "normalize-then-sum"]


# -------------------- the flags every script shares (each script's Args extends these)


@dataclass
class CommonArgs:
    """Flags shared by every script, in --help's order: those most runs set first (exp_name to
    resume), then the rest by what they shape (data, batch, sampling, optimizer, advantages,
    precision and generation, LoRA, evaluation, checkpoints, rewards, KL, logging); each script's
    Args adds its objective's own and names its runs after itself (exp_name)."""
    sequence_is_weights: ClassVar[bool] = True  # a sequence's ratio may weight it (sequence-* modes)
    masks_advantages: ClassVar[bool] = True  # a sequence's advantage may be zeroed alone (OPSM)
    exp_name: str = "run"
    """name of the run: logs and checkpoints go to {output_dir}/{exp_name}__{seed}__{unix time}"""
    seed: int = 1
    """seed of the model init (tiny), data order and sampling (offset per rank)"""
    model: str = "tiny"
    """'tiny' (built-in random-init Qwen3-architecture model, offline), 'tiny-moe' (the same as a
    Qwen3-MoE: 8 experts, top 2), a local folder, or a hub id"""
    dataset: str = "builtin"
    """'builtin' (offline: 'x%10=' for a digit x), 'gsm8k', 'math500', 'dapo17k' (hub sets with
    their own columns and instruction), a hub id, or a local json, jsonl, parquet, csv or arrow
    file (or a glob of them) read by `datasets.load_dataset`"""
    reward: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """the reward: the built-in math grader, or 'module:function' naming your
    f(completion, answer) -> float or TRL's f(prompts, completions, **columns) ->
    list[float | None] (imported from the current folder or the Python path; runs in worker
    processes, so sandbox code you execute); repeat it for several, summed with --reward-weights;
    built in: common:math_reward, common:think_format, common:length_penalty"""
    num_steps: int = 200
    """RL steps (one rollout batch each)"""
    prompts_per_rank: int = 16
    """prompts per rank per step; the rollout batch is prompts_per_rank x group_size completions per
    rank"""
    group_size: int = 8
    """G: completions per prompt"""
    learning_rate: float | None = None
    """AdamW learning rate (default: 5e-4 for --model tiny, 1e-6 otherwise)"""
    max_new_tokens: int | None = None
    """completion length limit (default: 2 for --dataset builtin, 1024 otherwise)"""
    temperature: float = 1.0
    """sampling temperature (log-probs are taken at the same temperature)"""
    eval_every: int = 50
    """evaluate on the held-out split every N steps, and at the start and the end (0: never)"""
    output_dir: str = "runs"
    """where runs are written"""
    resume: str | None = None
    """continue exactly from a checkpoint folder (.../step_N), or 'auto': the newest one of this
    exp_name and seed under --output-dir, a fresh run if there is none (use it with torchrun
    --max-restarts)"""
    trust_remote_code: bool = False
    """let transformers run code shipped with the model (off unless you trust the model's source)"""
    data_files: str | None = None
    """local files laid out in a named hub set's own columns (--dataset gsm8k, math500, dapo17k),
    read instead of the hub (offline mirror)"""
    prompt_column: str = "prompt"
    """the column of the prompts: text, or a list of {role, content} messages (conversational: the
    whole list goes through the chat template, system messages included)"""
    answer_column: str = "answer"
    """the column of the reference answers ('a.b': field b of column a); when 'answer' is absent,
    TRL's 'solution' or verl's 'reward_model.ground_truth' is read. Every other column is kept"""
    system_prompt: str | None = None
    """a system message put before each text prompt (conversational prompts keep their own)"""
    enable_thinking: bool | None = None
    """passed to the chat template when given (True / False); None: the template's own default
    (Qwen3: thinks, so the prompt does not end in an empty <think></think>)"""
    max_prompt_tokens: int = 2048
    """prompts longer than this (tokens, after the chat template) are dropped at load and counted"""
    num_minibatches: int = 4
    """optimizer steps per rollout batch, each over whole groups (4 in the GSPO paper)"""
    num_iterations: int = 1
    """mu: passes over each rollout's minibatches, pi_old fixed to the policy that generated it
    (GRPO paper's mu; TRL num_iterations, verl ppo_epochs): mu x --num-minibatches optimizer
    steps a rollout"""
    micro_batch_size: int = 0
    """sequences per forward/backward inside a minibatch (0: the whole minibatch); gradients
    accumulate and the loss is divided by the minibatch's count over all ranks, so this changes
    memory, never the gradient"""
    top_p: float = 1.0
    """nucleus sampling; 1.0 is off"""
    top_k: int = 0
    """top-k sampling; 0 is off"""
    min_p: float = 0.0
    """min-p sampling (HF's MinPLogitsWarper, after temperature, top-k and top-p): tokens less
    likely than min_p x the most likely one are not sampled; 0 is off. Evaluation uses it too"""
    repetition_penalty: float = 1.0
    """HF's repetition penalty, on the raw logits of every id in the prompt and the completion so
    far (divided by it when positive, multiplied when negative; > 1 discourages repeats); 1.0 is
    off. Evaluation uses it too. The engine's log-probs are then the penalised sampler's, not the
    policy's, so --old-logp rollout refuses it (docs/engine.md)"""
    gen_batch_size: int = 256
    """completions per `generate` call (memory only; not TRL's generation_batch_size, which is
    completions a step: --prompts-per-rank x --group-size here)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    max_nonfinite: int = 3
    """a non-finite loss or gradient skips that update on every rank; this many in a row stop the
    run"""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """learning-rate schedule after the warm-up, per optimizer step (DFPO paper: cosine; linear
    with --min-lr-ratio 0 is TRL's default, transformers' linear decay to 0)"""
    warmup_frac: float = 0.0
    """fraction of the optimizer steps spent in a linear warm-up (DFPO paper: 0.03)"""
    min_lr_ratio: float = 0.2
    """cosine and linear: the last learning rate as a fraction of the peak (DFPO paper: 0.2)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide the centred group rewards by the group's std (eq. 43), the whole batch's std (all
    ranks; with the group mean: REINFORCE++-baseline, arXiv 2501.03262), or nothing"""
    baseline: Literal["group-mean", "leave-one-out"] = "group-mean"
    """the baseline the rewards are centred on: the group's mean (GRPO, eq. 43), or the mean of
    the group's other completions (RLOO, arXiv 2402.14740: r_i - 1/(G-1) sum_j!=i r_j =
    G/(G-1) (r_i - mean); verl's rloo, with --scale-rewards none)"""
    adv_std: Literal["population", "bessel"] = "population"
    """the std of --scale-rewards: population (/n, the DFPO blog's worked example) or bessel
    (/(n-1), TRL's and verl's: A_1 of rewards [1,0,0,0] is 1.5, not 1.732)"""
    adv_eps: float = 1e-6
    """A_i = (r_i - mean) / (std + adv_eps): 1e-6 is verl's, TRL's is 1e-4"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (arXiv 2503.14476, Sec. 3.2; verl algorithm.filter_groups): a group
    whose rewards are all equal (A = 0, no gradient) is dropped, and further rounds of
    --prompts-per-rank prompts a rank (never the step's own; drawn from seed, step and round) are
    generated and scored until every rank holds --prompts-per-rank groups with a spread"""
    max_gen_rounds: int = 10
    """--dynamic-sampling: generation rounds a step at most, the first included (verl's
    max_num_gen_batches, 10 in its DAPO example); when they are spent the batch is filled with the
    earliest flat groups (A = 0) and the step goes on (verl raises instead), counted in
    charts/filled_groups"""
    mask_truncated: bool = False
    """completions cut at --max-new-tokens (no EOS) get zero loss weight; their rewards still set
    the group's A"""
    truncated_reward_scale: float | None = None
    """a completion cut at --max-new-tokens (no EOS) scores this fraction of its reward, in [0, 1]
    (default: 0.5 for --dataset builtin, whose task is the digit and a stop; 1.0, unchanged,
    otherwise; 0 scores every cut completion 0)"""
    dtype: Literal["auto", "bf16", "fp32", "bf16-pure"] = "auto"
    """compute dtype (auto: bf16 on GPU, fp32 on CPU). bf16 keeps fp32 master weights,
    gradients and AdamW state (16 bytes a parameter) and computes in bf16: torch.autocast in
    plain `python`, FSDP2's MixedPrecisionPolicy under torchrun. bf16-pure (plain `python`
    only) holds weights, gradients and AdamW state in bf16 (8 bytes a parameter): an update
    below half the bf16 spacing at its weight (2^-9 to 2^-8 of it) rounds away, so at lr 1e-6
    nearly every AdamW step is lost. Log-probs are always fp32"""
    activation_checkpointing: bool = False
    """recompute decoder layers in the backward pass (less memory, ~30% more compute)"""
    cpu_offload: bool = False
    """FSDP2: keep parameter shards, gradients and the AdamW step on the CPU (larger models per GPU,
    slower)"""
    gen_unshard: bool = False
    """FSDP2: gather each layer once per generate call, not once per decoded token (every GPU then
    holds the whole model in the compute dtype while generating)"""
    gen_mode: GenMode = "shared-prefill"
    """shared-prefill: each prompt prefilled once and its KV cache repeated to its group, whole
    groups a generate call; repeat: each prompt repeated group_size times and prefilled as many
    times; static: as repeat, with a KV cache allocated once (compiled decoding on one GPU);
    engine: engine.py, --gen-batch-size rows decoding at once, finished rows replaced while
    decoding (Qwen3/Qwen2/Llama; others: HF shared-prefill, said once); engine-tp: the engine's
    layers split over the torchrun ranks (tensor parallel), for models whose bf16 copy does not
    fit one GPU beside the training state (same tokens; benchmarks/README.md)"""
    min_new_tokens: int = 0
    """no completion ends before N new tokens: EOS's logit is masked until then (HF's
    min_new_tokens), in training and evaluation, in every --gen-mode; the length lab's control
    (docs/lab.md)"""
    gen_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """--gen-mode engine / engine-tp: the engine's weights and KV cache in this dtype (auto: the
    trainer's compute dtype); bf16 beside an fp32 trainer measures GSPO's precision claim"""
    old_logp: Literal["recompute", "rollout"] = "recompute"
    """pi_old: recomputed by the training forward (no grad), or the log-prob the engine computed as
    it sampled each token (--gen-mode engine / engine-tp; no recompute pass, as GSPO arXiv
    2507.18071 proposes; no losses/entropy)"""
    rollout_is_cap: float | None = None
    """the rollout correction's upper bound C_max (TRL's vllm_importance_sampling_clip_max): each
    token's loss weighted by pi_old / pi_rollout, truncated at or masked past C_max by
    --rollout-is-mode (a constant weight; --gen-mode engine log-probs; a sequence-level script
    weighs a sequence by its tokens' mean weight, as TRL's GSPO; off when not given)"""
    rollout_is_mode: RolloutIsMode = "token-truncate"
    """the rollout correction's form (TRL's vllm_importance_sampling_mode): the ratio of each token
    or of the whole sequence (the product over its tokens), truncated to [C_min, C_max] (TIS) or
    set to 0 outside it (masked: IcePop is token-mask with both bounds); TRL's default with vLLM
    is sequence-mask at C_max = 3"""
    rollout_is_min: float | None = None
    """the rollout correction's lower bound C_min (TRL's vllm_importance_sampling_clip_min; None:
    none); needs --rollout-is-cap"""
    routing_replay: bool = False
    """MoE models: force the experts each (token, layer) got in the old-log-prob pass in the
    training forward, weighted by the current router (Routing Replay, GSPO arXiv 2507.18071)"""
    off_policy_mask: float | None = None
    """off-policy sequence masking (OPSM, DeepSeek-V3.2 arXiv 2512.02556 eq. 9; TRL's
    off_policy_mask_threshold delta): a sequence with A_i < 0 whose mean log(pi_sample / pi_theta)
    over its tokens exceeds delta leaves the policy term (its advantage set to 0; the KL term
    stays); pi_sample: the engine's log-probs, else pi_old (None: off; TRL suggests 0.5)"""
    top_entropy_quantile: float = 1.0
    """rho: only the tokens whose entropy is in the step's top rho (pi_old's entropies over every
    completion token on all ranks) keep their policy term (the high-entropy minority, arXiv
    2506.01939: 0.2; TRL's top_entropy_quantile); the KL term stays; a sequence-level script
    weighs a sequence by its fraction kept (1.0: off)"""
    gen_cuda_graphs: bool = True
    """--gen-mode engine on one GPU: replay the decoding step as CUDA graphs, one per read length
    (a multiple of 256 positions), captured on first use; --no-gen-cuda-graphs decodes eagerly"""
    lora_rank: int = 0
    """LoRA rank r (0: off, full fine-tuning): train only adapters B A (alpha / r) on the target
    linear layers, the base frozen in the compute dtype (bf16 on a GPU); adapters and their AdamW
    state in fp32 (lora.py)"""
    lora_alpha: float = DEFAULT_ALPHA
    """LoRA alpha: the adapters' output is scaled by alpha / r"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input while training"""
    lora_target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    """names of the decoder's linear layers to adapt (e.g. q_proj v_proj); all-linear: every linear
    layer of the decoder (not the LM head)"""
    logprob_chunk_tokens: int = 1024
    """tokens per LM-head chunk: log-probs never hold more than chunk x vocab logits"""
    eval_size: int = 64
    """held-out prompts kept apart from --dataset's rows (a tenth of them at most) or taken from its
    test split, when there is no --eval-dataset"""
    eval_dataset: str | None = None
    """evaluate on this set instead (any form --dataset takes; its test split if it has one), in
    full: no held-out split is taken from --dataset"""
    eval_limit: int = 0
    """--eval-dataset and --eval-only: evaluate the first N prompts only (0: all)"""
    eval_temperature: float | None = None
    """sampling temperature of the evaluation (default: --temperature)"""
    eval_max_new_tokens: int | None = None
    """completion length limit of the evaluation (default: --max-new-tokens); its cost is
    --eval-size x --eval-n (or --eval-k) x this, at step 0, every --eval-every steps and the last"""
    eval_top_p: float | None = None
    """nucleus sampling of the evaluation (default: --top-p)"""
    eval_k: int = 8
    """k of avg@k and pass@k"""
    eval_n: int | None = None
    """samples per held-out prompt, n >= k (default k); pass@k is the unbiased
    1 - C(n-c, k) / C(n, k)"""
    eval_only: bool = False
    """evaluate --model (e.g. a checkpoint folder) on the whole of --eval-dataset, else of --dataset
    (its test split if it has one; builtin: --eval-size prompts), print the table, write eval.json,
    stop"""
    save_every: int = 0
    """write a checkpoint every N steps, and always at the end (0: only at the end). A checkpoint,
    step_N/, holds model/ (the bf16 export, 2 bytes a parameter) and state/ (fp32 master weights
    and AdamW's two moments, 12 bytes a parameter: what --resume needs); docs/checkpoints.md"""
    save_final: Literal["full", "model"] = "full"
    """what the end of the run writes: full (step_N/, resumable, as every --save-every save) or
    model (the bf16 export alone, {run}/final/model/, for a run that will not be resumed; a stop
    signal's save stays full); either way the end's save prints the size it wrote"""
    keep_checkpoints: int = 2
    """keep the newest K checkpoints of the run and delete older ones (0: keep all)"""
    reward_weights: list[float] = field(default_factory=list)
    """one weight per --reward (default 1 each): a completion's reward is the weighted sum of the
    rewards that apply to it (a TRL reward's None does not)"""
    multi_objective_aggregation: Aggregation = "sum-then-normalize"
    """several --reward: the advantage of their weighted sum (sum-then-normalize), or GDPO's (arXiv
    2601.05242): each reward normalised in its group, the weighted sum of those, normalised over
    the batch (normalize-then-sum; TRL's multi_objective_aggregation)"""
    reward_fail_steps: int = 3
    """stop the run when a reward fails on more than half of the completions in N steps in a row
    (or on every completion of the first step); 0: never"""
    reward_timeout: float = 1.0
    """seconds one reward call may take (the math grader: its worker's CPU seconds, at most 30x in
    wall time; a --reward function: wall seconds): past it the completion scores 0 and counts in
    charts/reward_errors"""
    kl_coef: float = 0.0
    """beta of the k3 KL penalty to the initial model, per token (0: no reference model is loaded
    at all; the GSPO and DFPO recipes use none)"""
    kl_ratio_correction: bool = False
    """multiply each token's k3 by the script's importance ratio (w_it, or s_i), as TRL's
    use_bias_correction_kl does (DeepSeek-V3.2): the KL of pi_theta, not pi_old, to pi_ref"""
    track: bool = False
    """log to Weights & Biases too, as CleanRL's --track (needs `pip install wandb`;
    WANDB_MODE=offline logs without a network), the same keys as tensorboard and metrics.jsonl"""
    wandb_project: str = "group-rl"
    """--track: the W&B project"""
    wandb_entity: str | None = None
    """--track: the W&B entity (team or user; None: your default)"""
    log_samples: int = 10
    """every N steps, the first 2 prompts of the step with their completions, rewards and
    advantages go to tensorboard (text, 'samples') and to samples.jsonl in the run folder
    (0: never)"""
    log_eval_samples: int = 0
    """at each evaluation, the first N held-out prompts (of rank 0's share) with their completions,
    rewards and extracted answers go to tensorboard (text, 'eval_samples') and to
    eval_samples.jsonl in the run folder, a row a completion with its step (0: none)"""
    energy_every: int = 0
    """Energy on frequent tokens (DFPO arXiv:2604.13088 eq. 24) logged at step 1, every N steps
    and the last (energy/*): each token's ||grad l_t|| of the step's loss, exact (one backward a
    token: ~1 CPU s a token at 135M parameters) on --energy-rows completions, bucketed by the
    tokens' frequency rank in the step's completions (0: never; one process only)"""
    energy_rows: int = 2
    """--energy-every: the completions measured (the first rows with a loss gradient of the step's
    first micro-batch that has any)"""
    noise_stats: bool = False
    """log the importance weights' spread and the gradient's noise each step (noise/*; the length
    lab, docs/lab.md): the variance over sequences of their mean token log-ratio (GSPO's log s_i)
    and of their sum (GRPO's log prod_t w_it) after the first update, and the cosine between the
    gradients of each minibatch's two halves (needs --micro-batch-size = half a minibatch's
    completions)"""
    energy_minibatch: Literal["first", "last"] = "first"
    """--energy-every: measure from the step's first minibatch on (pi = pi_old: GSPO and DFPO give
    every token the same coefficient there) or on its last only (ratios moved, the clip acting)"""


# -------------------- TRL's and verl's names for our flags (docs/trl-and-verl.md's tables)
# TRL's GRPOConfig (and the TrainingArguments it extends), by field name: what to give here instead.
# A name that is ours too (learning_rate, temperature, seed, num_iterations ...) is not listed.
TRL_FLAGS = {
    "num_generations": "use --group-size",
    "num_generations_eval": "use --eval-n",
    "max_completion_length": "use --max-new-tokens",
    "max_prompt_length": "use --max-prompt-tokens (longer prompts are dropped and counted)",
    "beta": "use --kl-coef",
    "epsilon": "use --clip-low (and --clip-high)",
    "epsilon_high": "use --clip-high",
    "loss_type": "use --loss-agg (grpo.py, gspo_token.py and the token-level scripts): dapo = "
                 "token-mean, grpo = seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm; cispo, "
                 "sapo, vespo: cispo.py, sapo.py, vespo.py; luspo: gspo.py --luspo",
    "sapo_temperature_pos": "use --tau-pos (sapo.py)",
    "sapo_temperature_neg": "use --tau-neg (sapo.py)",
    "delta": "use grpo.py --delta (two-sided clipping)",
    "vespo_k_pos": "use --k-pos (vespo.py)",
    "vespo_lambda_pos": "use --lambda-pos (vespo.py)",
    "vespo_k_neg": "use --k-neg (vespo.py)",
    "vespo_lambda_neg": "use --lambda-neg (vespo.py)",
    "importance_sampling_level": "use the script: token is grpo.py, sequence is gspo.py",
    "use_vllm": "use --gen-mode engine (the built-in engine; vLLM is not used)",
    "vllm_mode": "use --gen-mode engine (the built-in engine; vLLM is not used)",
    "per_device_train_batch_size": "use --micro-batch-size (completions a forward/backward)",
    "gradient_accumulation_steps": "use --micro-batch-size (gradients accumulate over a "
                                   "minibatch's micro-batches)",
    "generation_batch_size": "use --prompts-per-rank x --group-size (completions a step; "
                             "--gen-batch-size is completions a generate call)",
    "steps_per_generation": "use --num-minibatches (optimizer steps a rollout)",
    "reward_funcs": "use --reward module:function",
    "mask_truncated_completions": "use --mask-truncated",
    "use_bias_correction_kl": "use --kl-ratio-correction",
    "vllm_importance_sampling_correction": "use --rollout-is-cap C_max (the correction is on when "
                                           "a cap is given; --gen-mode engine)",
    "vllm_importance_sampling_mode": "use --rollout-is-mode (token-truncate, token-mask, "
                                     "sequence-truncate, sequence-mask)",
    "vllm_importance_sampling_clip_max": "use --rollout-is-cap",
    "vllm_importance_sampling_cap": "use --rollout-is-cap",
    "vllm_importance_sampling_clip_min": "use --rollout-is-min",
    "off_policy_mask_threshold": "use --off-policy-mask",
    "max_steps": "use --num-steps",
    "num_train_epochs": "use --num-steps (RL steps, one rollout batch each)",
    "lr_scheduler_type": "use --lr-schedule",
    "warmup_ratio": "use --warmup-frac",
    "warmup_steps": "use --warmup-frac (a fraction of the optimizer steps)",
    "gradient_checkpointing": "use --activation-checkpointing",
    "log_completions": "use --log-samples",
    "eval_steps": "use --eval-every",
    "save_steps": "use --save-every",
    "save_total_limit": "use --keep-checkpoints",
    "resume_from_checkpoint": "use --resume",
    "model_name_or_path": "use --model",
    "dataset_name": "use --dataset",
    "bf16": "use --dtype bf16",
    "report_to": "use --track for Weights & Biases (tensorboard and metrics.jsonl are always "
                 "written)",
    "logging_steps": "every step is logged",
}
# verl's trainer config keys (hydra overrides key=value): what to give here instead.
VERL_KEYS = {
    "data.train_files": "--dataset",
    "data.val_files": "--eval-dataset",
    "data.prompt_key": "--prompt-column",
    "data.train_batch_size": "--prompts-per-rank (x ranks)",
    "data.max_prompt_length": "--max-prompt-tokens",
    "data.max_response_length": "--max-new-tokens",
    "actor_rollout_ref.model.path": "--model",
    "actor_rollout_ref.rollout.n": "--group-size",
    "actor_rollout_ref.rollout.name": "--gen-mode",
    "actor_rollout_ref.rollout.temperature": "--temperature",
    "actor_rollout_ref.rollout.top_p": "--top-p",
    "actor_rollout_ref.rollout.top_k": "--top-k",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "--num-minibatches (prompts an optimizer step "
                                                   "= --prompts-per-rank x ranks / it)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "--micro-batch-size",
    "actor_rollout_ref.actor.ppo_epochs": "--num-iterations",
    "actor_rollout_ref.actor.clip_ratio_low": "--clip-low",
    "actor_rollout_ref.actor.clip_ratio_high": "--clip-high",
    "actor_rollout_ref.actor.loss_agg_mode": "--loss-agg",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "the script (gspo: gspo.py, geo_mean: gmpo.py, "
                                                     "cispo: cispo.py)",
    "actor_rollout_ref.actor.use_kl_loss": "--kl-coef",
    "actor_rollout_ref.actor.kl_loss_coef": "--kl-coef",
    "actor_rollout_ref.actor.optim.lr": "--learning-rate",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "--warmup-frac",
    "actor_rollout_ref.actor.optim.warmup_style": "--lr-schedule",
    "actor_rollout_ref.actor.grad_clip": "--max-grad-norm",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "--activation-checkpointing",
    "algorithm.adv_estimator": "the script (grpo: grpo.py); rloo: --baseline leave-one-out "
                               "--scale-rewards none; reinforce_plus_plus_baseline: --scale-rewards "
                               "batch",
    "algorithm.norm_adv_by_std_in_grpo": "--scale-rewards group / none (and --adv-std bessel)",
    "algorithm.filter_groups.enable": "--dynamic-sampling",
    "algorithm.filter_groups.max_num_gen_batches": "--max-gen-rounds (with --dynamic-sampling)",
    "algorithm.filter_groups.metric": "--dynamic-sampling (flat: equal rewards, the --reward the "
                                      "advantages use)",
    "custom_reward_function.path": "--reward module:function",
    "custom_reward_function.name": "--reward module:function",
    "trainer.total_training_steps": "--num-steps",
    "trainer.total_epochs": "--num-steps",
    "trainer.test_freq": "--eval-every",
    "trainer.save_freq": "--save-every",
    "trainer.default_local_dir": "--output-dir",
}
# TRL's loss_type -> --loss-agg (grpo.py, gspo_token.py); verl's loss_agg_mode names are ours
TRL_LOSS_TYPES = {"dapo": "token-mean", "grpo": "seq-mean-token-mean",
                  "dr_grpo": "seq-mean-token-sum-norm", "bnpo": "token-mean"}
TRL_LOSS_SCRIPTS = {"cispo": "cispo.py", "sapo": "sapo.py",  # TRL loss_types that are a script here
                    "vespo": "vespo.py", "luspo": "gspo.py --luspo"}
VERL_OVERRIDE = re.compile(r"\+?([a-z_]+(?:\.[a-z_]+)+)=")


def foreign_flag(argv: list[str], ours: set[str]) -> str | None:
    """The first of argv's flags that is TRL's or verl's name and not ours, as one line naming
    ours ("--num-generations is TRL's name: use --group-size"); None when there is none. ours:
    the field names of the script's Args."""
    for i, word in enumerate(argv):
        if (m := VERL_OVERRIDE.match(word)):
            key = m[1]
            hint = f"use {VERL_KEYS[key]}" if key in VERL_KEYS else (
                "give --flags; docs/trl-and-verl.md maps verl's config to them")
            return f"{key}=... is verl's config key: {hint}"
        if not word.startswith("--"):
            continue
        flag, eq, value = word[2:].partition("=")
        name = flag.replace("-", "_")
        if name == "loss_agg" and "loss_agg" in ours:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value in TRL_LOSS_TYPES:
                return (f"--loss-agg {value} is TRL's loss_type name: use --loss-agg "
                        f"{TRL_LOSS_TYPES[value]}")
            if value in TRL_LOSS_SCRIPTS:
                return (f"--loss-agg {value} is TRL's loss_type name for an objective: run "
                        f"{TRL_LOSS_SCRIPTS[value]}")
        if name in TRL_FLAGS and name not in ours:
            return f"--{flag} is TRL's name: {TRL_FLAGS[name]}"
    return None


# -------------------- parsing: tyro, its errors in one line, printed once
def parse_args(cls, argv: list[str] | None = None):
    """tyro.cli(cls), whose own errors (an unknown flag, a value of the wrong type) stop with one
    line, printed by rank 0 alone under torchrun, instead of a box of 6-9 lines from every rank:
    tyro's first sentence, the flag it suggests if any, and where the flags are listed. --help is
    tyro's, printed once."""
    import contextlib
    import io

    import tyro

    main = main_process()
    said = foreign_flag(sys.argv[1:] if argv is None else argv,
                        {f.name for f in dataclasses.fields(cls)})
    if said:  # a TRL or verl name: ours in one line, before tyro's "Unrecognized options"
        raise SystemExit(f"error: {said}" if main else 2)
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):
            args = tyro.cli(cls, args=argv, console_outputs=main,
                            description=script_description(cls))
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        raise SystemExit(f"error: {tyro_error_line(box.getvalue())}" if main else 2) from None
    sys.stderr.write(box.getvalue())  # anything else tyro said (warnings) is not lost
    # a plain --resume step_N: the flags not restated are the run's saved ones, not the defaults
    return dataclasses.replace(args, **saved_flags(args, sys.argv[1:] if argv is None else argv))


def script_description(cls) -> str:
    """--help's first lines: the first paragraph of the script's docstring (what it optimises and
    where it comes from), then where TRL's and verl's names are mapped."""
    import inspect

    doc = (inspect.getmodule(cls).__doc__ or "").strip()
    first = " ".join(doc.split("\n\n")[0].split())
    return (f"{first}\nThe flags most runs set come first (--exp-name to --resume), then the rest "
            "every script shares, then this script's objective's own; TRL's and verl's names for them: "
            "docs/trl-and-verl.md.")


def tyro_error_line(box: str) -> str:
    """One line from tyro's error box: its first paragraph, the flags under 'Perhaps you meant',
    and the script's --help."""
    # rich draws a box, or plain rules where it guesses the terminal cannot show one; either way the
    # first row is the title and the first paragraph after it says what was wrong
    rows = [row for line in box.splitlines() if (row := line.strip().strip("│|╭╰╮╯").strip())][1:]
    rules = [i for i, row in enumerate(rows) if set(row) <= set("─-━=")] + [len(rows)]
    start = 1 if rules[0] == 0 else 0
    first = rows[start:min(i for i in rules if i >= start)]
    meant = next((i for i, row in enumerate(rows) if row.startswith("Perhaps you meant")), None)
    suggested = [] if meant is None else [
        row.split()[0] for row in rows[meant + 1:min(i for i in rules if i > meant)]
        if row.startswith("--")]
    said = " ".join(first).rstrip(".") or "cannot parse the flags"
    hint = f" (did you mean {' or '.join(dict.fromkeys(suggested))}?)" if suggested else ""
    return f"{said}{hint}; python {os.path.basename(sys.argv[0])} --help lists every flag"


# -------------------- argument checks: every flag before any heavy work
def fill_defaults(args):
    """args with the defaults that depend on the model and the task filled in (each None until
    here); every script's main() calls it first, so the run is logged, checkpointed and compared on
    resume with these values, and nothing changes args after it:
    --learning-rate   5e-4 for the tiny models (random init learns fast with a large step), 1e-6
                      otherwise (the papers' scale)
    --max-new-tokens  2 for the built-in task (one digit, then EOS), 1024 otherwise (real tasks
                      reason)
    --truncated-reward-scale  0.5 for the built-in task, whose reward asks for the digit and a
                      stop (a right digit cut at the limit scores half), 1.0 otherwise
    --eval-max-new-tokens     --max-new-tokens"""
    builtin, tiny = args.dataset == "builtin", args.model in ("tiny", "tiny-moe")
    max_new_tokens = (2 if builtin else 1024) if args.max_new_tokens is None else args.max_new_tokens
    return dataclasses.replace(
        args,
        learning_rate=(5e-4 if tiny else 1e-6) if args.learning_rate is None else args.learning_rate,
        max_new_tokens=max_new_tokens,
        eval_max_new_tokens=max_new_tokens if args.eval_max_new_tokens is None
        else args.eval_max_new_tokens,
        truncated_reward_scale=(0.5 if builtin else 1.0) if args.truncated_reward_scale is None
        else args.truncated_reward_scale)


def rollout_sampling(args) -> Sampling:
    """The rollout's Sampling: how a step's completions are drawn (sampling, lengths, --gen-mode
    and its settings), passed whole to generation.generate and the engine."""
    return Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                    repetition_penalty=args.repetition_penalty,
                    min_new_tokens=args.min_new_tokens, mode=args.gen_mode,
                    gen_batch_size=args.gen_batch_size, unshard=args.gen_unshard,
                    cuda_graphs=args.gen_cuda_graphs, engine_dtype=args.gen_dtype)


def eval_plan(args, sampling: Sampling, reward) -> Evaluation:
    """The held-out evaluation's Evaluation: the rollout's sampling with the evaluation's own
    temperature, top_p and max_new_tokens (--eval-temperature, --eval-top-p,
    --eval-max-new-tokens: by default the training ones), --eval-k and --eval-n, the task's
    reward, --log-eval-samples and the name of an evaluation before the first step (the step-0
    one, or --eval-only's)."""
    own = dataclasses.replace(
        sampling, max_new_tokens=args.eval_max_new_tokens,
        temperature=args.temperature if args.eval_temperature is None else args.eval_temperature,
        top_p=args.top_p if args.eval_top_p is None else args.eval_top_p)
    return Evaluation(sampling=own, k=args.eval_k, n=args.eval_n, reward=reward,
                      log_samples=args.log_eval_samples,
                      first_name="the --eval-only evaluation" if args.eval_only
                      else "the step-0 evaluation")


# Upper bounds of the integer flags past which a run would load the model and then crash (a tensor,
# a KV cache or a seed too large) instead of failing here: far above any real run's values.
MAX_SEED = 2**32 - 1  # numpy's seed range (torch's is 2**64 - 1, less the per-rank offsets)
MAX_COMPLETIONS = 2**20  # completions a rank a step, held-out completions, rows a generate call
MAX_NEW_TOKENS = 2**20  # beyond any model's context
MAX_ITERATIONS = 1024  # passes over one rollout: far past any recipe's (TRL's, verl's default: 1)
MAX_GEN_ROUNDS = 1024  # generation rounds a step (--dynamic-sampling): far past verl's example's 10
MAX_GEN_ROUNDS_DEFAULT = CommonArgs.max_gen_rounds
MAX_REWARD_TIMEOUT_S = 86400.0  # a day; past ~9e9 s select() overflows in the reward pool


MIN_TEMPERATURE = 1e-3  # logits of ~100 / 1e-3 stay far inside float32's range (3.4e38); 1e-40 does not


def check_float(flag: str, x: float, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False, why: str = ""):
    """--flag x is finite and lies in [low, high] (each end open if asked); written so that NaN
    fails every comparison and is refused with the rest."""
    ok = (math.isfinite(x) and (x > low if low_open else x >= low)
          and (x < high if high_open else x <= high))
    if not ok:
        if high == math.inf:
            rule = f"be {'>' if low_open else '>='} {low:g} and finite"
        else:
            rule = (f"lie in {'(' if low_open else '['}{low:g}, {high:g}"
                    f"{')' if high_open else ']'}")
        fail(f"--{flag} {x}: must {rule}{why}")


def check_int(flag: str, n: int, low: int, high: int | None = None, why: str = ""):
    """--flag n lies in [low, high] (no upper bound if high is None)."""
    if not (n >= low and (high is None or n <= high)):
        rule = f"be >= {low}" if high is None else f"lie in [{low}, {high}]"
        fail(f"--{flag} {n}: must {rule}{why}")


def check_common_args(args):
    """Bad input fails with one line before any heavy work. Reads args, never writes them: main()
    has filled in the defaults already (fill_defaults)."""
    check_int("seed", args.seed, 0, MAX_SEED, " (numpy's seed range)")
    check_int("group-size", args.group_size, 2, MAX_COMPLETIONS,
              " (group-relative advantages need at least 2 completions a prompt)")
    check_int("max-new-tokens", args.max_new_tokens, 1, MAX_NEW_TOKENS)
    check_int("eval-max-new-tokens", args.eval_max_new_tokens, 1, MAX_NEW_TOKENS)
    check_float("truncated-reward-scale", args.truncated_reward_scale, 0, 1)
    check_float("clip-low", args.clip_low, 0, low_open=True)
    check_float("clip-high", args.clip_high, 0, low_open=True)
    check_int("prompts-per-rank", args.prompts_per_rank, 1, MAX_COMPLETIONS)
    if args.prompts_per_rank * args.group_size > MAX_COMPLETIONS:
        fail(f"--prompts-per-rank {args.prompts_per_rank} x --group-size {args.group_size} = "
             f"{args.prompts_per_rank * args.group_size} completions a rank a step: must be at "
             f"most {MAX_COMPLETIONS}")
    if args.num_minibatches < 1 or args.prompts_per_rank % args.num_minibatches:
        fail(f"--prompts-per-rank {args.prompts_per_rank} must be a multiple of --num-minibatches "
             f"{args.num_minibatches} (each minibatch holds whole groups)")
    if args.multi_objective_aggregation == "normalize-then-sum" and (
            args.scale_rewards != "group" or args.baseline != "group-mean"):
        fail("--multi-objective-aggregation normalize-then-sum normalises each reward in its group "
             "and their sum over the batch (GDPO): give no --scale-rewards or --baseline with it")
    if args.off_policy_mask is not None:
        check_float("off-policy-mask", args.off_policy_mask, 0,
                    why=" (delta, the mean log(pi_sample / pi_theta) past which OPSM drops a sequence)")
        if not args.masks_advantages:
            fail("--off-policy-mask zeroes a sequence's advantage, and DFPO's transform (eq. 63) "
                 "weighs every sequence of the group by all their advantages: not with dfpo.py")
    check_int("num-iterations", args.num_iterations, 1, MAX_ITERATIONS,
              " (passes over each rollout's minibatches)")
    check_int("max-gen-rounds", args.max_gen_rounds, 1, MAX_GEN_ROUNDS,
              " (generation rounds a step, the first included; verl's 0, no bound, is not offered: "
              "a task whose groups are all flat would generate for ever)")
    if args.max_gen_rounds != MAX_GEN_ROUNDS_DEFAULT and not args.dynamic_sampling:
        fail(f"--max-gen-rounds {args.max_gen_rounds} bounds the rounds of --dynamic-sampling: add "
             "--dynamic-sampling, or drop it")
    check_float("temperature", args.temperature, MIN_TEMPERATURE,
                why=" (RL samples from the policy; below, logits / T overflow float32)")
    check_int("log-samples", args.log_samples, 0, why=" (0: never)")
    check_int("log-eval-samples", args.log_eval_samples, 0, why=" (0: none)")
    check_int("energy-every", args.energy_every, 0, why=" (0: never)")
    check_int("energy-rows", args.energy_rows, 1)
    if args.energy_every and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("--energy-every measures per-token gradients of the whole model, which FSDP2 shards over "
             "ranks: run it in one process (torchrun --nproc-per-node 1, or python)")
    half = args.prompts_per_rank * args.group_size // args.num_minibatches // 2
    if args.noise_stats and args.micro_batch_size != half:
        fail(f"--noise-stats compares the gradients of each minibatch's two halves: give "
             f"--micro-batch-size {half} (half of a minibatch's {2 * half} completions)")
    if args.num_steps < 1:
        fail(f"--num-steps {args.num_steps}: must be >= 1")
    if args.micro_batch_size < 0:
        fail(f"--micro-batch-size {args.micro_batch_size}: must be >= 1 sequences, or 0 for the "
             "whole minibatch")
    if args.max_prompt_tokens < 1:
        fail(f"--max-prompt-tokens {args.max_prompt_tokens}: must be >= 1")
    if args.max_nonfinite < 1:
        fail(f"--max-nonfinite {args.max_nonfinite}: must be >= 1")
    if args.cpu_offload and not torch.cuda.is_available():
        fail("--cpu-offload moves FSDP2 shards between GPU and CPU memory: it needs a GPU (drop it "
             "on CPU)")
    if args.gen_mode in ("engine", "engine-tp") and args.gen_unshard:
        fail("--gen-unshard keeps FSDP2 units gathered for HF generate; --gen-mode engine gathers "
             "each weight once per rollout itself: drop --gen-unshard")
    if args.dtype == "bf16-pure" and launched():
        fail("--dtype bf16-pure: under torchrun FSDP2 keeps fp32 master weights; use --dtype bf16 "
             "(or auto), or plain `python` for bf16 weights")
    for flag in ("cpu_offload", "gen_unshard"):
        if getattr(args, flag) and not launched():
            fail(f"--{flag.replace('_', '-')} acts on FSDP2 shards, which plain `python` does not "
                 "make: launch with `torchrun --nproc-per-node N` (N = 1 is fine)")
    if args.eval_n is not None and args.eval_n < args.eval_k or args.eval_k < 1:
        fail(f"--eval-n {args.eval_n} / --eval-k {args.eval_k}: pass@k needs n >= k >= 1 samples a "
             "prompt")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_int("eval-size", args.eval_size, max(1, world), MAX_COMPLETIONS,
              f" (at least the world size {world}: every rank evaluates an equal share of the "
              "held-out prompts)")
    n_flag, n = ("eval-k", args.eval_k) if args.eval_n is None else ("eval-n", args.eval_n)
    if args.eval_size * n > MAX_COMPLETIONS:
        fail(f"--eval-size {args.eval_size} x --{n_flag} {n} = {args.eval_size * n} held-out "
             f"completions: must be at most {MAX_COMPLETIONS}")
    resume_dir = os.path.basename(os.path.normpath(args.resume or ""))
    if args.resume not in (None, "auto") and not (os.path.isdir(args.resume)
                                                  and STEP_DIR.match(resume_dir)):
        fail(f"--resume {args.resume}: not a checkpoint (a run's step_N folder); give one, or "
             "'auto' for the newest of this --exp-name and --seed")
    if args.keep_checkpoints < 0 or args.save_every < 0:
        fail(f"--keep-checkpoints {args.keep_checkpoints} / --save-every {args.save_every}: must "
             "be >= 0")
    check_float("warmup-frac", args.warmup_frac, 0, 1, high_open=True)
    check_float("min-lr-ratio", args.min_lr_ratio, 0, 1)
    check_float("learning-rate", args.learning_rate, 0, low_open=True)
    check_float("top-p", args.top_p, 0, 1, low_open=True, why=" (1 is off)")
    check_float("min-p", args.min_p, 0, 1, high_open=True, why=" (0 is off)")
    check_float("repetition-penalty", args.repetition_penalty, 0, low_open=True,
                why=" (1 is off; > 1 discourages repeats)")
    if args.top_k < 0:
        fail(f"--top-k {args.top_k}: must be >= 0 (0 is off)")
    check_int("gen-batch-size", args.gen_batch_size, 1, MAX_COMPLETIONS,
              " (completions a generate call)")
    if args.logprob_chunk_tokens < 1:
        fail(f"--logprob-chunk-tokens {args.logprob_chunk_tokens}: must be >= 1")
    check_float("weight-decay", args.weight_decay, 0)
    check_float("max-grad-norm", args.max_grad_norm, 0, low_open=True)
    # grader.load_reward refuses <= 0 too; here also NaN, inf and past what select() takes
    if not (0 < args.reward_timeout <= MAX_REWARD_TIMEOUT_S):
        fail(f"--reward-timeout {args.reward_timeout}: must be > 0 seconds and at most "
             f"{MAX_REWARD_TIMEOUT_S:g} (a day)")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every}: must be >= 0 (0: never)")
    check_lora_args(args)
    check_dataset(args.dataset, args.data_files)
    if args.eval_dataset is not None:
        check_dataset(args.eval_dataset, None, "--eval-dataset")
    check_int("eval-limit", args.eval_limit, 0, why=" (0: all)")
    if args.eval_temperature is not None:
        check_float("eval-temperature", args.eval_temperature, MIN_TEMPERATURE,
                    why=" (below, logits / T overflow float32)")
    if args.eval_top_p is not None:
        check_float("eval-top-p", args.eval_top_p, 0, 1, low_open=True, why=" (1 is off)")
    if args.system_prompt is not None and not args.system_prompt.strip():
        fail("--system-prompt is empty: give the text of the system message, or drop it")
    check_float("kl-coef", args.kl_coef, 0, why=" (0: no KL penalty and no reference model)")
    check_float("adv-eps", args.adv_eps, 0, why=" (added to the std of --scale-rewards)")
    if args.kl_ratio_correction and args.kl_coef == 0:
        fail("--kl-ratio-correction multiplies the KL penalty's k3 by the ratio: it needs "
             "--kl-coef > 0 (TRL's beta)")
    check_rollout_args(args)
    if args.gen_dtype != "auto" and args.gen_mode not in ("engine", "engine-tp"):
        fail(f"--gen-dtype {args.gen_dtype} sets the engine's dtype; --gen-mode {args.gen_mode} runs "
             "HF generate in the trainer's: use --gen-mode engine, or drop it")
    if args.track and importlib.util.find_spec("wandb") is None:
        fail("--track logs to Weights & Biases, which is not installed: pip install wandb "
             "(WANDB_MODE=offline logs without a network), or drop --track")
    from .modeling import check_sizes

    check_sizes(args)  # --lora-rank and --group-size against the model and the host's memory
    check_run_name(args.output_dir, args.exp_name)
    check_run_folder(args.output_dir, args.exp_name, args.seed)
    if not torch.cuda.is_available() and args.model not in ("tiny", "tiny-moe") and main_process():
        print(cpu_cost_line(args), flush=True)  # before the model loads
    catch_startup_signals()  # SIGINT, SIGTERM from here to the first step: one line


def cpu_cost_line(args) -> str:
    """What a run will generate at most, in one line (a real model on a CPU: said before it
    loads): training's steps x prompts x G x --max-new-tokens, and the evaluations' held-out
    prompts x samples x --eval-max-new-tokens, with their share; and where the CPU recipe is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = args.eval_n or args.eval_k
    whole = args.eval_dataset is not None or args.eval_only and args.dataset != "builtin"
    held = (args.eval_limit or None) if whole else args.eval_size  # None: a whole set, unread yet
    if args.eval_only:
        evals, train = 1, 0
    else:
        evals = (1 + args.num_steps // args.eval_every + bool(args.num_steps % args.eval_every)
                 if args.eval_every else 0)
        train = args.num_steps * args.prompts_per_rank * world * args.group_size * args.max_new_tokens
    prompts = "all the set's" if held is None else f"{held}"
    said = (f"{evals} evaluations x {prompts} held-out prompts x {n} samples x "
            f"{args.eval_max_new_tokens} tokens")
    if held is not None:
        tokens = evals * held * n * args.eval_max_new_tokens
        share = f", {tokens / (tokens + train):.0%} of all" if tokens + train else ""
        said += f" = {tokens:,}{share}"
    if not args.eval_only:
        said = (f"training {args.num_steps} steps x {args.prompts_per_rank * world} prompts x G "
                f"{args.group_size} x {args.max_new_tokens} tokens = {train:,}; evaluation {said}")
    return (f"on the CPU this run generates at most: {said} new tokens (a real model's CPU recipe: "
            "README.md, 'A real model on a CPU')")


def check_prompt_pool(args, n_train: int, world: int):
    """--dynamic-sampling draws its extra prompts from the train rows outside the step's own batch
    (common.extra_prompt_indices): there must be some. Called once the data is loaded, before the
    model."""
    if args.dynamic_sampling and not args.eval_only and n_train <= args.prompts_per_rank * world:
        fail(f"--dynamic-sampling replaces flat groups with prompts from outside the step's own "
             f"batch, and the {n_train} train rows fit in one step (--prompts-per-rank "
             f"{args.prompts_per_rank} x {world} ranks): use more data or a smaller "
             "--prompts-per-rank, or drop --dynamic-sampling")


def check_rollout_args(args):
    """--rollout-is-cap: a finite C > 0, on a script whose loss is a sum of token terms, with pi_old
    recomputed (the weight is pi_old / pi_rollout). --old-logp rollout: no repetition penalty (the
    engine's log-probs are then the penalised sampler's, not the policy's). What needs the model's
    config (a generation mode that returns log-probs, --routing-replay on an MoE model) is checked
    by modeling.check_model."""
    check_float("top-entropy-quantile", args.top_entropy_quantile, 0, 1, low_open=True,
                why=" (rho, the fraction of tokens kept by entropy; 1: all)")
    if args.top_entropy_quantile < 1 and args.old_logp == "rollout":
        fail(f"--top-entropy-quantile {args.top_entropy_quantile} ranks tokens by pi_old's "
             "entropies, computed by the recompute pass: use --old-logp recompute (the default)")
    check_int("min-new-tokens", args.min_new_tokens, 0,
              min(args.max_new_tokens, args.eval_max_new_tokens),
              " (at most --max-new-tokens and --eval-max-new-tokens)")
    if args.old_logp == "rollout" and args.min_new_tokens:
        fail(f"--old-logp rollout with --min-new-tokens {args.min_new_tokens}: the engine's "
             "log-probs of a completion's first tokens are then the EOS-masked sampler's, not the "
             "policy's, so pi_old would be wrong; use --old-logp recompute (the default)")
    if args.old_logp == "rollout" and args.repetition_penalty != 1:
        fail(f"--old-logp rollout with --repetition-penalty {args.repetition_penalty}: the "
             "engine's log-probs are then the penalised sampler's, not the policy's, so pi_old would "
             "be wrong; use --old-logp recompute (the default), or drop --repetition-penalty")
    cap = args.rollout_is_cap
    if cap is None:
        if args.rollout_is_min is not None:
            fail(f"--rollout-is-min {args.rollout_is_min} needs --rollout-is-cap (C_max; a large one "
                 "for none): the rollout correction is on when a cap is given")
        return
    check_float("rollout-is-cap", cap, 0, low_open=True,
                why=" (TIS weights each token by min(pi_old / pi_rollout, C))")
    if args.rollout_is_min is not None:
        check_float("rollout-is-min", args.rollout_is_min, 0, cap, low_open=True, high_open=True,
                    why=" (C_min, below --rollout-is-cap)")
    if args.rollout_is_mode.startswith("sequence") and not args.sequence_is_weights:
        fail(f"--rollout-is-mode {args.rollout_is_mode}: vespo.py folds the rollout's ratios into "
             "its sequence weight token by token; use token-truncate or token-mask (as TRL)")
    if args.old_logp == "rollout":
        fail(f"--rollout-is-cap {cap} weights by pi_old / pi_rollout, and --old-logp rollout makes "
             "pi_old the rollout's own: use --old-logp recompute, or drop --rollout-is-cap")


def check_lora_args(args):
    """Bad LoRA flags (lora.py) fail in one line before any heavy work."""
    others = [f"--lora-{name.replace('_', '-')}" for name, off in
              (("alpha", args.lora_alpha == DEFAULT_ALPHA), ("dropout", args.lora_dropout == 0.0),
               ("target_modules", list(args.lora_target_modules) == [ALL_LINEAR])) if not off]
    if args.lora_rank < 0 or args.lora_rank == 0 and others:
        fail(f"--lora-rank {args.lora_rank}" + (f" with {', '.join(others)}" if others else "")
             + ": LoRA needs a rank >= 1 (0 is off, and then give no other --lora-* flag)")
    if args.lora_rank == 0:
        return
    check_float("lora-alpha", args.lora_alpha, 0, low_open=True,
                why=" (the adapters' scale is alpha / rank)")
    check_float("lora-dropout", args.lora_dropout, 0, 1, high_open=True)
    if not args.lora_target_modules:
        fail(f"--lora-target-modules: give module names (e.g. q_proj v_proj) or {ALL_LINEAR}")
    if args.dtype == "bf16-pure":
        fail("--dtype bf16-pure with --lora-rank: under LoRA the frozen base is already held in "
             "bf16 with --dtype bf16 (or auto on a GPU) and the adapters stay fp32; use those")
    if args.cpu_offload:
        fail("--cpu-offload with --lora-rank: not supported (untested with LoRA's frozen and "
             "trainable parameters in one FSDP2 unit); LoRA's state is small enough to stay on the "
             "GPU (docs/scaling.md)")


def check_run_name(output_dir: str, exp_name: str):
    """--output-dir is (or can become) a writable folder, and --exp-name one folder name inside
    it."""
    if exp_name in ("", ".", "..") or "/" in exp_name or os.sep in exp_name:
        fail(f"--exp-name {exp_name!r}: must be one folder name (no '/', not '.' or '..'), so that "
             "the run stays inside --output-dir")
    if (m := re.fullmatch(r"(.+)__(\d+)", exp_name)):  # its folders start as --exp-name m[1]'s do
        fail(f"--exp-name {exp_name!r} ends in '__' and a number, as the seed in a run folder's "
             f"name does ({{exp_name}}__{{seed}}__{{time}}): its runs would read as runs of "
             f"--exp-name {m[1]} with --seed {m[2]}; name it otherwise (e.g. {m[1]}_{m[2]})")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(f"--output-dir {output_dir}: is a file, not a folder")
    existing = os.path.abspath(output_dir)
    while not os.path.lexists(existing):  # the folder that makedirs would create the rest in
        existing = os.path.dirname(existing)
    if not os.path.exists(existing):  # a link to nowhere: dangling, or a loop of links
        try:
            os.stat(existing)
        except OSError as e:
            fail(f"--output-dir {output_dir}: {existing} is a symbolic link that leads to no folder "
                 f"({e.strerror}): point it at a folder, or give another --output-dir")
    if not os.path.isdir(existing):
        fail(f"--output-dir {output_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--output-dir {output_dir}: {existing} is not writable")


def check_run_folder(output_dir: str, exp_name: str, seed: int):
    """A run folder, {exp_name}__{seed}__{unix time}, can be made under --output-dir: its name fits
    the file system's limit on one name, and a folder can be created where --output-dir is (or
    would be) made. os.access is not enough: root passes it on /proc and /sys, where no folder can
    be made; so a folder is made and removed there."""
    import tempfile
    import time

    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):  # check_run_name found it a folder
        existing = os.path.dirname(existing)
    name = f"{exp_name}__{seed}__{int(time.time()) + 1}"
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    over = len(os.fsencode(name)) - limit
    if over > 0:
        fail(f"--exp-name {exp_name[:40]}...: the run folder's name ({{exp_name}}__{seed}__<time>) "
             f"would have {len(os.fsencode(name))} bytes, over the {limit} this file system allows "
             f"in one name: give an --exp-name of at most {len(os.fsencode(exp_name)) - over} "
             "bytes")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_check_", dir=existing))
    except OSError as e:
        fail(f"--output-dir {output_dir}: no folder can be made in {existing} ({e.strerror}): "
             "give a folder on a writable disk")
