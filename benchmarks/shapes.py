"""Qwen3 dense models' shapes, from the published config.json files (huggingface.co/Qwen/Qwen3-*), and a random-init
model and a word-level tokenizer of the same vocabulary size for the benchmarks (random weights run at the speed of
real ones; no download). memory_plan.plan reads these dicts as it reads a config.json."""

QWEN3_COMMON = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rope_theta=1_000_000, rms_norm_eps=1e-6, hidden_act="silu")
QWEN3 = {
    "0.6B": dict(QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "1.7B": dict(QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "4B": dict(QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=True),
    "8B": dict(QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=False),
}
# Parameters (billions) as the model cards give them, total and without the embeddings: what QWEN3 must reproduce
MODEL_CARDS = {"0.6B": (0.6, 0.44), "1.7B": (1.7, 1.4), "4B": (4.0, 3.6), "8B": (8.2, 6.95)}
# A CPU-sized stand-in with every code path of the real shapes (GQA, q/k norms, tied or untied head): --smoke
TINY = dict(QWEN3_COMMON, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def word_tokenizer(vocab_size: int):
    """A real HF fast tokenizer with exactly vocab_size ids: Qwen-style specials (pad, turn start, turn end = EOS)
    and words w3, w4, ... one token each, left padding. Prompts of k words are k tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left")


def random_model(shape: dict, tok, dtype, device="cpu"):
    """A Qwen3ForCausalLM of the given shape with random weights (HF's own init), in dtype on device."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    with torch.device(device):
        lm = Qwen3ForCausalLM(cfg).to(dtype)
    lm.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    lm.config.use_cache = True
    return lm.eval()


def prompts(n: int, tokens: int, vocab_size: int, seed: int = 0) -> list[str]:
    """n prompts of exactly `tokens` random words (tokens) each."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(tokens)) for _ in range(n)]
