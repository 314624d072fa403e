"""The copies the design keeps on purpose stay alike across the scripts (each loss function copies alone, so the
helpers and the KL it needs are written out in each script; DESIGN.md "Layout"): `aggregate` byte-equal in every
script that defines it, and the k3 KL block of every loss (`if ref_logp is not None and kl_coef > 0:`, the penalty
and its logged mean) line for line, indentation and comments aside, once each script's own names are put back: the
ratio it weights k3 with under --kl-ratio-correction and where the penalty lands (token terms or the sequence's
mean). An edit to one copy fails here until every copy has it."""
import ast
import difflib
import os
import re
import textwrap

from conftest import ROOT, SCRIPTS

AGGREGATE = ["grpo", "gspo_token", "cispo", "sapo", "vespo"]  # the token-level losses, which take --loss-agg

# k3 under pi_theta from pi_old's samples, ratio x k3 (TRL's use_bias_correction_kl: coef_1 x k3): each loss's ratio
KL_RATIO = {"grpo": "w", "cispo": "w", "sapo": "w", "vespo": "w",  # the token's w_it
            "gspo": "s[:, None]", "gmpo": "s[:, None]", "dfpo": "log_s.exp()[:, None]",  # the sequence's s_i
            "gspo_token": "s_it"}  # GSPO-token's s_it (value s_i)
# where the penalty lands: each token's term (then aggregate), or the sequence's mean beside the objective
LANDS = {"token": "token_terms = token_terms - kl_coef * k3 * mask",
         "sequence": "per_seq = objective - kl_coef * (k3 * mask).sum(1) / lengths"}
SPELLED = {  # the same expression under another name, as the script writes it
    "dfpo": {"torch.where(mask.bool(),": "torch.where(valid,"},  # the others' valid = mask.bool()
    "gspo_token": {"token_terms = per_token -": "token_terms = token_terms -"},  # token_terms = per_token above
}


def functions(script: str) -> dict[str, tuple[str, ast.FunctionDef]]:
    """The script's top-level functions: name -> (source text, node)."""
    src = open(os.path.join(ROOT, f"{script}.py")).read()
    return {n.name: (src, n) for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}


def test_aggregate_is_byte_equal_in_every_script_that_has_it():
    copies = {}
    for script in SCRIPTS:
        funcs = functions(script)
        if "aggregate" in funcs:
            src, node = funcs["aggregate"]
            copies[script] = ast.get_source_segment(src, node)
    assert sorted(copies) == sorted(AGGREGATE), sorted(copies)
    for script, text in copies.items():
        diff = "\n".join(difflib.unified_diff(copies["grpo"].split("\n"), text.split("\n"), "grpo.py",
                                              f"{script}.py", lineterm=""))
        assert text == copies["grpo"], f"aggregate in {script}.py differs from grpo.py's: edit every copy\n{diff}"


def kl_blocks(script: str) -> list[list[str]]:
    """The loss's `if ref_logp is not None and kl_coef > 0:` blocks (the penalty, then the logged mean), each as
    lines dedented, comments dropped, the script's own spellings replaced (SPELLED)."""
    src, loss = functions(script)[f"{script}_loss"]
    blocks = []
    for node in ast.walk(loss):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "ref_logp is not None and kl_coef > 0":
            lines = src.split("\n")[node.lineno - 1:node.end_lineno]
            text = textwrap.dedent("\n".join(re.sub(r"\s+#.*$", "", line) for line in lines))
            for theirs, ours in SPELLED.get(script, {}).items():
                text = text.replace(theirs, ours)
            blocks.append(text.split("\n"))
    return sorted(blocks, key=lambda b: not any("k3 = log_ref" in line for line in b))


def test_the_k3_kl_block_is_one_copy_in_every_loss():
    """The penalty beta k3, k3 = pi_ref/pi - log(pi_ref/pi) - 1 >= 0, written alike in all eight losses: the same
    lines but for the ratio (KL_RATIO) and where it lands (LANDS); its logged mean (losses/kl_ref) the same line."""
    want_penalty = None
    want_mean = None
    for script in SCRIPTS:
        blocks = kl_blocks(script)
        assert len(blocks) == 2, (script, blocks)
        penalty, logged = blocks
        ratio = [m.group(1) for line in penalty for m in [re.fullmatch(r"\s*k3 = (.+) \* k3", line)] if m]
        assert ratio == [KL_RATIO[script]], f"{script}_loss weights k3 by {ratio}, not {KL_RATIO[script]}"
        penalty = [re.sub(r"k3 = .+ \* k3", "k3 = RATIO * k3", line) for line in penalty]
        family = "token" if script in AGGREGATE else "sequence"
        assert penalty[-1].strip() == LANDS[family], f"{script}_loss: {penalty[-1].strip()}, not {LANDS[family]}"
        penalty[-1] = penalty[-1].replace(LANDS[family], "LANDS")
        want_penalty = want_penalty or (script, penalty)
        want_mean = want_mean or (script, logged)
        for (first, want), got in [(want_penalty, penalty), (want_mean, logged)]:
            diff = "\n".join(difflib.unified_diff(want, got, f"{first}.py", f"{script}.py", lineterm=""))
            assert got == want, f"the k3 block in {script}_loss differs from {first}_loss's: edit every copy\n{diff}"
