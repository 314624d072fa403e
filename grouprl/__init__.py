"""The subsystems a reader of one algorithm need not read, one module each; the scripts and
common.py import them, none of them imports a script or common.py.

    distributed   torchrun set-up, ranks and seeds, collectives, one-line errors (the base layer)
    cli           CommonArgs (the flags every script shares), parsing them, their checks
    data          tasks: the built-in task, hub sets, local files, the chat template
    modeling      the tokenizer, the weights, Policy (the log-probs the losses read), FSDP2
    logprobs      the LM head's log-probs and entropy in chunks of tokens
    lora          LoRA through peft (--lora-rank)
    moe           MoE routing across a step: flips counted, --routing-replay
    energy        Energy on frequent tokens (DFPO arXiv:2604.13088 eq. 24, --energy-every)
    rewards       score: rewards per completion, the watch over a run's rewards
    grader        the math grader and the worker processes for it and for --reward
    reward_worker the worker's program (started by file path; imports nothing of the project)
    checkpoint    run folders, checkpoints, exact resume, graceful stop
    engine        the rollout engine of --gen-mode engine / engine-tp (engine.runs: for a model?)
    sampling      the engine's sampler on the device
    stats         the loop's statistics: reduced over micro-batches and ranks, log-ratio spread and
                  noise, the high-entropy mask, pass@k
    progress      generation's progress bars (evaluation, a slow step's rollout)
"""
