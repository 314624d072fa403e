"""The subsystems a reader of one algorithm need not read, a module or a folder each; the scripts
and common.py import them, none of them imports a script or common.py.

    distributed   torchrun set-up, ranks and seeds, collectives, one-line errors (the base layer)
    cli/          CommonArgs in headed sections, parsing them, rollout_sampling and eval_plan, checks
    data          Task and load_task: the built-in task, hub sets, local files, the chat template
    modeling      the tokenizer, the weights, Policy (the log-probs the losses read), FSDP2
    logprobs      the LM head's log-probs and entropy in chunks of tokens
    sampling      Sampling (how completions are drawn) and the engine's sampler on the device
    generation    generate -> Rollout (HF generate's modes or the engine), Rollout.merge
    staleness     --max-staleness k: rollouts sampled by the weights of k versions before
    rollout_ranks --async-rollouts: rollout ranks beside the FSDP2 trainers under torchrun
    engine/       the rollout engine of --gen-mode engine / engine-tp (engine.runs: for a model?)
    episodes      the tool loop (--tools, --environment): turns, tool results masked out
    tools         the episodes' tools: schemas, the prompt's tools, the worker's client
    tool_worker   the tools' worker program (started by file path; imports nothing of the project)
    tool_task     the episode tasks: the tiny model's secret digit (--model tiny-tools), products
    evaluation    held-out avg@k and pass@k (an Evaluation), the --eval-only table
    runlog        tensorboard and metrics.jsonl (Logger), a resumed run's rows, samples
    lora          LoRA through peft (--lora-rank)
    moe           MoE routing across a step: flips counted, --routing-replay
    energy        Energy on frequent tokens (DFPO arXiv:2604.13088 eq. 24, --energy-every)
    rewards       score: rewards per completion, the watch over a run's rewards; built-in rewards
    grader/       the math grader and the worker processes for it and for --reward
    reward_worker the worker's program (started by file path; imports nothing of the project)
    checkpoint/   run folders, checkpoints, exact resume, graceful stop
    stats         the loop's statistics: reduced over micro-batches and ranks, log-ratio spread and
                  noise, the high-entropy mask, pass@k
    progress      generation's progress bars (evaluation, a slow step's rollout)
"""
