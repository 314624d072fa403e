"""The flags every script shares: CommonArgs, which each script's Args extends with its objective's
own. Checked by checks.py, parsed by parsing.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import tyro

from ..lora import ALL_LINEAR, DEFAULT_ALPHA


GenMode = Literal["repeat", "shared-prefill", "static", "engine", "engine-tp"]  # common.GEN_MODES
RolloutIsMode = Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"]
Aggregation = Literal["sum-then-normalize", "normalize-then-sum"]


# -------------------- the flags every script shares (each script's Args extends these)


@dataclass
class CommonArgs:
    """Flags shared by every script, in sections, each headed by a `# -- name: heading` comment that
    --help shows as a box of its own (parsing.help_view): those most runs set first (exp_name to
    resume), then the rest by what they control; each script's Args adds its objective's own (its
    last box) and names its runs after itself (exp_name). The fields stay flat: args.top_p."""
    sequence_is_weights: ClassVar[bool] = True  # a sequence's ratio may weight it (sequence-* modes)
    masks_advantages: ClassVar[bool] = True  # a sequence's advantage may be zeroed alone (OPSM)
    # -- run: The flags most runs set
    exp_name: str = "run"
    """name of the run: logs and checkpoints go to {output_dir}/{exp_name}__{seed}__{unix time}"""
    seed: int = 1
    """seed of the model init (tiny), data order and sampling (offset per rank)"""
    model: str = "tiny"
    """'tiny' (built-in random-init Qwen3-architecture model, offline), 'tiny-moe' (the same as a
    Qwen3-MoE: 8 experts, top 2), 'tiny-tools' (tiny over the tool task's characters and its one
    call token: grouprl/tool_task.py), a local folder, or a hub id"""
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
    """AdamW learning rate (default: 5e-4 for the tiny models, 1e-6 otherwise)"""
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

    # -- model: Parameters that control the model: loading, precision, memory and LoRA
    trust_remote_code: bool = False
    """let transformers run code shipped with the model (off unless you trust the model's source)"""
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
    logprob_chunk_tokens: int = 1024
    """tokens per LM-head chunk: log-probs never hold more than chunk x vocab logits"""
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

    # -- data: Parameters that control the data: columns, the chat template, prompt lengths
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

    # -- generation: Parameters that control generation: sampling, lengths and the engine
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
    min_new_tokens: int = 0
    """no completion ends before N new tokens: EOS's logit is masked until then (HF's
    min_new_tokens), in training and evaluation, in every --gen-mode; the length lab's control
    (docs/lab.md)"""
    gen_batch_size: int = 256
    """completions per `generate` call (memory only; not TRL's generation_batch_size, which is
    completions a step: --prompts-per-rank x --group-size here)"""
    gen_mode: GenMode = "shared-prefill"
    """shared-prefill: each prompt prefilled once and its KV cache repeated to its group, whole
    groups a generate call; repeat: each prompt repeated group_size times and prefilled as many
    times; static: as repeat, with a KV cache allocated once (compiled decoding on one GPU);
    engine: grouprl/engine/, --gen-batch-size rows decoding at once, finished rows replaced while
    decoding (Qwen3/Qwen2/Llama; others: HF shared-prefill, said once); engine-tp: the engine's
    layers split over the torchrun ranks (tensor parallel), for models whose bf16 copy does not
    fit one GPU beside the training state (same tokens; benchmarks/README.md)"""
    gen_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """--gen-mode engine / engine-tp: the engine's weights and KV cache in this dtype (auto: the
    trainer's compute dtype); bf16 beside an fp32 trainer measures GSPO's precision claim"""
    gen_unshard: bool = False
    """FSDP2: gather each layer once per generate call, not once per decoded token (every GPU then
    holds the whole model in the compute dtype while generating)"""
    gen_cuda_graphs: bool = True
    """--gen-mode engine on one GPU: replay the decoding step as CUDA graphs, one per read length
    (a multiple of 256 positions), captured on first use; --no-gen-cuda-graphs decodes eagerly"""

    # -- rewards: Parameters that control the rewards
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
    mask_truncated: bool = False
    """completions cut at --max-new-tokens (no EOS) get zero loss weight; their rewards still set
    the group's A"""
    truncated_reward_scale: float | None = None
    """a completion cut at --max-new-tokens (no EOS) scores this fraction of its reward, in [0, 1]
    (default: 0.5 for --dataset builtin, whose task is the digit and a stop; 1.0, unchanged,
    otherwise; 0 scores every cut completion 0)"""

    # -- advantages: Parameters that control the advantages and which groups are kept
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

    # -- training: Parameters that control the updates: minibatches, the optimizer and its schedule
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

    # -- objective: Parameters that control the objective every script shares (its own follow)
    kl_coef: float = 0.0
    """beta of the k3 KL penalty to the initial model, per token (0: no reference model is loaded
    at all; the GSPO and DFPO recipes use none)"""
    kl_ratio_correction: bool = False
    """multiply each token's k3 by the script's importance ratio (w_it, or s_i), as TRL's
    use_bias_correction_kl does (DeepSeek-V3.2): the KL of pi_theta, not pi_old, to pi_ref"""
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

    # -- evaluation: Parameters that control evaluation on held-out prompts
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
    log_eval_samples: int = 0
    """at each evaluation, the first N held-out prompts (of rank 0's share) with their completions,
    rewards and extracted answers go to tensorboard (text, 'eval_samples') and to
    eval_samples.jsonl in the run folder, a row a completion with its step (0: none)"""

    # -- checkpoints: Parameters that control checkpoints and the final save
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

    # -- logging: Parameters that control logging and the diagnostics
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

    # -- tools: Parameters that control tool use (episodes)
    tools: str | None = None
    """FILE.py:fn[,fn...]: plain functions the model may call (TRL's tools=; the Qwen3/Hermes
    <tool_call> format): each completion becomes an episode, only the model's tokens in the loss
    (grouprl/episodes.py; HF --gen-mode only, one process; off when not given)"""
    environment: str | None = None
    """FILE.py:Class: TRL's environment_factory, one instance per episode in the tool worker: its
    public methods are the tools, reset(**row) -> str | None (appended to the prompt's last
    message), get_reward() -> float (one more reward, weight 1, rewards/<Class>/), and
    get_turn_rewards() -> list[float] (a reward per model turn); with --tools or alone"""
    max_tool_calls: int = 5
    """--tools, --environment: the most rounds of tool calls an episode makes (TRL's
    max_tool_calling_iterations: rounds, not calls); --max-new-tokens holds over the episode"""

    # -- staleness: Parameters that control stale rollouts
    max_staleness: int = 0
    """each step's rollout sampled by the policy as it was k weight versions before (TRL's
    max_staleness; a version every --weight-sync-steps steps, whatever their optimizer steps; the
    first k versions sample with the initial weights; LoRA: the adapters kept); the rollout carries
    the behaviour policy's log-probs, stale/versions_behind and stale/kl logged
    (grouprl/staleness.py, docs/objectives.md; 0: today's run; under torchrun with
    --async-rollouts only)"""
    weight_sync_steps: int = 1
    """W: a new weight version (a sync to the sampler) every W steps (TRL's weight_sync_steps, in
    steps, not optimizer steps): step s samples with the weights after W max(0, (s - 1) // W - k)
    steps, k = --max-staleness (W > 1 with k = 0: the last sync's weights); 1: every step"""
    async_rollouts: bool = False
    """under torchrun: the last --rollout-ranks ranks generate while the others train (FSDP2 over
    the trainers), a weight version every --weight-sync-steps; each step sampled with the weights
    one process samples it with under the same flags (grouprl/rollout_ranks.py)"""
    rollout_ranks: int = 1
    """--async-rollouts: how many ranks generate (the last ones; each serves trainer t mod R)"""
