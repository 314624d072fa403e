"""Per-turn credit for GSPO-token over episodes (issue 62 item 4) and only the model's tokens in every script's loss
(item 2), in float64 against values computed by hand from the equations (docs/objectives.md, GSPO-token):
turn_advantages' D_it for a hand-written group of episodes of 1, 2 and 3 turns; gspo_token_loss with A_it = A_i +
c D_it, value and gradient, against the GSPO paper's eq. 13-14 written out token by token; equal per-turn advantages
give GSPO exactly; no gradient at a tool token; the one-line refusals."""
import importlib
import inspect
import math
import os
import statistics
import types

import pytest
import torch
from conftest import SCRIPTS
from helpers import ROOT, fails_before_any_model, run_script, value_and_grad

import gspo_token
from grouprl import episodes
from grouprl.cli import parse_args
from gspo import gspo_loss
from gspo_token import gspo_token_loss, turn_advantages

TOOLS_FILE = os.path.join(ROOT, "tests", "programs", "tools_example.py")
TURNS_ENV = os.path.join(ROOT, "tests", "programs", "turns_env.py")  # scores each model turn
G = 3  # episodes a group
# two groups of three episodes: M a model token, . a tool-turn token (template glue included), _ padding;
# turn k of a row is its k-th run of M
ROWS = ["MMMM________",  # 1 turn
        "MMM...MM____",  # 2 turns
        "MM..MMM..MM_",  # 3 turns
        "MMMMM..MMM__",  # 2 turns
        "MMMMMMMMMMMM",  # 1 turn, no padding
        "M.M.M_______"]  # 3 turns of one token
TURN_REWARDS = [[0.5], [1.0, 0.0], [1.0, -0.5, 0.25],
                [0.2, 0.2], [1.0], [0.0, 0.0, 2.0]]
A = [1.2, -0.3, -0.4, 0.7, 0.0, -0.7]  # each episode's outcome advantage A_i


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def mask_of(rows):
    return torch.tensor([[float(c == "M") for c in row] for row in rows])


def turns_of(row: str) -> list[int]:
    """Each position's model turn (1-based), 0 off the model's tokens: read from the row's text."""
    out, k = [], 0
    for t, c in enumerate(row):
        if c == "M" and (t == 0 or row[t - 1] != "M"):
            k += 1
        out.append(k if c == "M" else 0)
    return out


def d_by_hand(rows, turn_rewards, group_size, eps=1e-6):
    """D_it from the equations, in plain Python floats: G_ik = sum_{k' >= k} r_ik'; Gh_ik = (G_ik - mean_g) /
    (std_g + eps) over every turn of the group's episodes (population std); D_it = Gh_ik(t) minus its mean over the
    episode's model tokens."""
    returns = [[sum(r[k:]) for k in range(len(r))] for r in turn_rewards]
    D = []
    for i, row in enumerate(rows):
        group = returns[i // group_size * group_size:(i // group_size + 1) * group_size]
        pooled = [g for episode in group for g in episode]
        mean, std = statistics.fmean(pooled), statistics.pstdev(pooled)
        gh = [(g - mean) / (std + eps) for g in returns[i]]
        k_t = turns_of(row)
        on = [gh[k - 1] for k in k_t if k]
        centre = sum(on) / len(on)
        D.append([gh[k - 1] - centre if k else 0.0 for k in k_t])
    return torch.tensor(D)


# ---- the estimator


def test_turn_advantages_by_hand():
    mask = mask_of(ROWS)
    D = turn_advantages(TURN_REWARDS, mask, G)
    assert D.dtype == torch.float64 and D.shape == mask.shape
    torch.testing.assert_close(D, d_by_hand(ROWS, TURN_REWARDS, G), rtol=1e-12, atol=1e-15)
    # worked out on paper for the first group: returns {0.5}, {1, 0}, {0.75, -0.25, 0.25}, mean 3/8, population
    # std sqrt(35/192); the 2-turn episode's turns (3 then 2 tokens) get Gh = 5/8 / std and -3/8 / std, whose
    # token mean is 9/40 / std: D = 2/5 / std and -3/5 / std
    std = math.sqrt(35 / 192)
    assert D[1, 0].item() == pytest.approx(1 / (std + 1e-6) * 2 / 5, rel=1e-12)
    assert D[1, 6].item() == pytest.approx(-1 / (std + 1e-6) * 3 / 5, rel=1e-12)
    assert (D[mask == 0] == 0).all()  # nothing off the model's tokens
    torch.testing.assert_close(D.sum(1), torch.zeros(6), rtol=0, atol=1e-14)  # sum_t D_it = 0: |y_i| A_i stays
    assert (D[0] == 0).all() and (D[4] == 0).all()  # one turn: A_it = A_i
    assert D[5].abs().max() < 1e-14  # rewards only on the last turn: G_ik constant over the turns, D = 0
    assert D[2, 0] > D[2, 4] < D[2, 9]  # 3 turns: the credit follows the return from each turn on


def test_turn_advantages_refuse_rewards_that_do_not_fit_in_one_line():
    mask = mask_of(ROWS)
    bad = [TURN_REWARDS[:1] + [[1.0]] + TURN_REWARDS[2:], "episode 1 has 2 model turns but 1 turn rewards"]
    for rewards, needle in [bad, (TURN_REWARDS[:-1] + [[0.0, math.nan, 1.0]], "not all finite"),
                            (TURN_REWARDS[:-1] + [[0.0, "1", None]], "are not all numbers"),
                            (TURN_REWARDS[:5], "5 rows of turn rewards for 6 episodes")]:
        with pytest.raises(ValueError, match=needle):
            turn_advantages(rewards, mask, G)
        roll = types.SimpleNamespace(turn_rewards=rewards, mask=mask)
        with pytest.raises(SystemExit) as e:  # the loop's call: one line, no traceback
            gspo_token.turn_credit(roll, types.SimpleNamespace(group_size=G, adv_eps=1e-6))
        assert str(e.value.code).startswith("error: --turn-credit: ") and "\n" not in str(e.value.code)
    with pytest.raises(SystemExit) as e:  # an environment without get_turn_rewards: no turn rewards at all
        gspo_token.turn_credit(types.SimpleNamespace(turn_rewards=None, mask=mask),
                               types.SimpleNamespace(group_size=G, adv_eps=1e-6))
    msg = str(e.value.code)
    assert msg.startswith("error: --turn-credit: ") and "\n" not in msg and "get_turn_rewards" in msg


# ---- GSPO-token with those advantages, against eq. 13-14 token by token


def batch(seed=0, wild=True):
    """log pi_theta, log pi_old and log pi_ref [6, 12]: model tokens near each other, tool tokens and padding far off
    (were they counted, every number would move)."""
    g = torch.Generator().manual_seed(seed)
    mask = mask_of(ROWS)
    logp = -torch.rand(mask.shape, generator=g) * 3
    old = logp + 0.03 * torch.randn(mask.shape, generator=g)
    ref = logp + 0.05 * torch.randn(mask.shape, generator=g)
    if wild:
        logp = torch.where(mask > 0, logp, -30.0)
        old = torch.where(mask > 0, old, 0.0)
        ref = torch.where(mask > 0, ref, -50.0)
    return logp, old, ref, mask


def gspo_token_by_hand(lp, old, adv, clip_low, clip_high, token_mean=False):
    """-J_GSPO-token (eq. 13) with s_it of eq. 14, over each row's model tokens named by the row's text:
    s_i = exp(1/|y_i| sum_t (lp - old)); each token's term min(s_it A_it, clip(s_it) A_it) with
    s_it = sg[s_i] exp(lp_it - sg[lp_it]) (value s_i, gradient s_i d lp_it)."""
    terms, count = [], 0
    for i, row in enumerate(ROWS):
        model = [t for t, c in enumerate(row) if c == "M"]
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in model) / len(model)).detach()
        row_terms = []
        for t in model:
            s_t = s * torch.exp(lp[i, t] - lp[i, t].detach())
            row_terms.append(torch.min(s_t * adv[i, t], s_t.clamp(1 - clip_low, 1 + clip_high) * adv[i, t]))
        terms.append(sum(row_terms) if token_mean else sum(row_terms) / len(model))
        count += len(model)
    return -sum(terms) / (count if token_mean else len(ROWS))


def grad_by_hand(lp, old, adv, clip_low, clip_high, token_mean=False):
    """The gradient written out (Observation 3; the GSPO paper's GSPO-token gradient): d(-J)/d lp_it =
    -s_i A_it / (B |y_i|) (token-mean: / sum_i |y_i|) where the min takes s_it A_it, 0 where it takes the clipped
    constant (A_it > 0 and s_i > 1 + eps_high, or A_it < 0 and s_i < 1 - eps_low) and at every other position."""
    grad = torch.zeros_like(lp)
    count = sum(row.count("M") for row in ROWS)
    for i, row in enumerate(ROWS):
        model = [t for t, c in enumerate(row) if c == "M"]
        s = math.exp(sum((lp[i, t] - old[i, t]).item() for t in model) / len(model))
        for t in model:
            a = adv[i, t].item()
            clipped = (a > 0 and s > 1 + clip_high) or (a < 0 and s < 1 - clip_low)
            grad[i, t] = 0.0 if clipped else -s * a / (count if token_mean else len(ROWS) * len(model))
    return grad


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_with_turn_credit_by_hand(loss_agg, seed):
    """A_it = A_i + c D_it (c = 0.5, D_it by hand): gspo_token_loss's value and gradient equal eq. 13-14 token by
    token and the gradient written out; per-token clip decisions differ inside a row (A_it changes sign), and every
    tool and padding position has exactly 0 gradient."""
    logp, old, _, mask = batch(seed)
    adv = torch.tensor(A)[:, None] + 0.5 * d_by_hand(ROWS, TURN_REWARDS, G)  # A_i, not 0, off the mask too
    clip_low, clip_high = 0.01, 0.012  # s_i spreads about +-0.02 here: some rows clipped, some not
    token_mean = loss_agg == "token-mean"
    value, grad = value_and_grad(lambda lp: gspo_token_loss(lp, old, adv, mask, clip_low=clip_low,
                                                            clip_high=clip_high, loss_agg=loss_agg)[0], logp)
    hand_value, hand_grad = value_and_grad(
        lambda lp: gspo_token_by_hand(lp, old, adv, clip_low, clip_high, token_mean), logp)
    torch.testing.assert_close(value, hand_value, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, hand_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, grad_by_hand(logp, old, adv, clip_low, clip_high, token_mean),
                               rtol=1e-12, atol=1e-15)
    assert (grad[mask == 0] == 0).all()  # exactly: no tool token, no padding
    assert ((adv[2] > 0) & (mask[2] > 0)).any() and ((adv[2] < 0) & (mask[2] > 0)).any()  # signs differ in a row
    assert (grad[mask > 0] == 0).any() and (grad[mask > 0] != 0).any()  # the clip takes some tokens, not all


@pytest.mark.parametrize("seed", range(3))
def test_equal_turn_credit_is_gspo(seed):
    """Per-turn advantages equal over an episode's turns give GSPO's loss and gradient: a constant A_it = A_i + e_i
    is GSPO with A_i + e_i; and turn rewards whose return is the same from every turn (rewards on the last turn
    only, or one turn) give D = 0, A_it = A_i: GSPO with the outcome's A_i."""
    logp, old, ref, mask = batch(seed)
    kw = dict(clip_low=0.01, clip_high=0.012, ref_logp=ref, kl_coef=0.04)
    outcome = torch.tensor(A)
    last_only = [[0.5], [0.0, 1.0], [0.0, 0.0, 0.25], [0.0, 0.2], [1.0], [0.0, 0.0, 2.0]]
    D = turn_advantages(last_only, mask, G)
    assert D.abs().max() < 1e-14
    shift = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5, -0.4])  # e_i: the same for every turn of episode i
    for seq_adv, token_adv in [(outcome, outcome[:, None] + D),
                               (outcome + shift, (outcome + shift)[:, None].expand_as(mask))]:
        value, grad = value_and_grad(lambda lp: gspo_loss(lp, old, seq_adv, mask, **kw)[0], logp)
        value_t, grad_t = value_and_grad(lambda lp: gspo_token_loss(lp, old, token_adv, mask, **kw)[0], logp)
        torch.testing.assert_close(value_t, value, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad_t, grad, rtol=1e-12, atol=1e-15)
        assert (grad_t[mask == 0] == 0).all() and (grad_t[mask > 0] != 0).any()


# ---- item 2: every script's loss over an episode is its loss over the model's tokens


def script_loss(script, loss_agg=None):
    """The script's loss function as its loop calls it, with its Args' defaults (clip ranges, tau, k, lambda), a KL
    term (beta 0.04, so that the KL's masking is covered too)."""
    mod = importlib.import_module(script)
    fn = getattr(mod, f"{script}_loss")
    params = inspect.signature(fn).parameters
    defaults = mod.Args()
    kw = {name: getattr(defaults, name) for name in params
          if params[name].kind == inspect.Parameter.KEYWORD_ONLY and hasattr(defaults, name)
          and name not in ("loss_agg", "max_new_tokens", "kl_coef")}
    if "group_size" in params:
        kw["group_size"] = G
    if loss_agg is not None:
        kw.update(loss_agg=loss_agg, max_new_tokens=16)

    def loss(lp, old, adv, mask, ref, terms=False):  # terms: m_i, each sequence's term (the group metrics')
        return fn(lp, old, adv, mask, ref_logp=ref, kl_coef=0.04, **kw)[1 if terms else 0]

    return loss, params


def compact(x, mask):
    """Each row's model tokens alone, in order, right-padded with 0 to 3 more than the longest: the row with its tool
    turns removed, in a width other than the episodes' (a loss that read T, not |y_i|, would differ)."""
    rows = [x[i][mask[i] > 0] for i in range(x.shape[0])]
    width = max(len(r) for r in rows) + 3
    return torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])


@pytest.mark.parametrize("script", SCRIPTS)
def test_episode_loss_is_the_model_tokens_only(script):
    """For every script: the loss, its gradient and each sequence's term m_i on the episodes (tool turns between the
    model's, mask 0, with far-off log-probs there) equal those on the same rows with the tool tokens removed
    (padding moved to the end), float64 to 1e-12; the gradient at every tool and padding position is exactly 0. Every
    objective here depends on a row only through its mask-1 tokens in order (|y_i| = the mask's sum, the sums and
    means over them, Dr. GRPO's constant L_max), so removing the mask-0 tokens is exactly the same loss;
    GSPO's, GRPO's (tests/test_episodes.py) and GSPO-token's (above) are also checked by hand."""
    logp, old, ref, mask = batch(0)
    adv = c_adv = torch.tensor(A)
    if script == "gspo_token":  # per-turn credit: A_it = A_i + 0.5 D_it, D from the episodes' turns
        adv = adv[:, None] + 0.5 * turn_advantages(TURN_REWARDS, mask, G)  # A_i, not 0, at the tool tokens
        c_adv = compact(adv, mask)
    aggs = [None]
    if "loss_agg" in inspect.signature(getattr(importlib.import_module(script), f"{script}_loss")).parameters:
        aggs = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
    c_mask = compact(mask, mask)
    assert c_mask.shape[1] == 15 and c_mask.sum() == mask.sum() and (c_mask[:, :3] == 1).all()
    for agg in aggs:
        loss, _ = script_loss(script, agg)
        value, grad = value_and_grad(lambda lp: loss(lp, old, adv, mask, ref), logp)
        c_value, c_grad = value_and_grad(
            lambda lp: loss(lp, compact(old, mask), c_adv, c_mask, compact(ref, mask)), compact(logp, mask))
        assert torch.isfinite(value) and value != 0
        torch.testing.assert_close(value, c_value, rtol=1e-12, atol=0)
        torch.testing.assert_close(compact(grad, mask), c_grad, rtol=1e-12, atol=1e-15)
        terms = loss(logp, old, adv, mask, ref, terms=True)
        c_terms = loss(compact(logp, mask), compact(old, mask), c_adv, c_mask, compact(ref, mask), terms=True)
        torch.testing.assert_close(terms, c_terms, rtol=1e-12, atol=1e-15)  # m_i too: |y_i| is the model's tokens
        assert (grad[mask == 0] == 0).all(), (script, agg)  # exactly 0 at every tool token and padding
        assert (grad[mask > 0] != 0).any(), (script, agg)


# ---- the flags: gspo_token.py checks them before any model, every other script refuses per-turn credit


@pytest.mark.parametrize("argv, needle", [
    (["--turn-credit", "1"], "--turn-credit needs turn rewards: give --environment"),
    (["--turn-credit", "-0.5"], "--turn-credit -0.5: must be >= 0"),
    (["--turn-credit", "1", "--post-answer-penalty", "0.1"], "--post-answer-penalty finds the answer in a single"),
    (["--tools", f"{TOOLS_FILE}:multiply", "--post-answer-penalty", "0.1"],
     "(--tools, --environment, --turn-credit) has tool turns"),
])
def test_gspo_token_checks_turn_credit_before_any_model(argv, needle, monkeypatch, tmp_path):
    fails_before_any_model("gspo_token", argv, needle, monkeypatch, tmp_path)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "gspo_token"])
def test_other_scripts_refuse_turn_credit_in_one_line(script, monkeypatch):
    """One advantage per sequence elsewhere: --turn-credit is not their flag, and parse_args says so in one line
    naming it (tyro's "Unrecognized options", folded to one line by grouprl/cli/parsing.py), before anything."""
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--turn-credit", "1"])
    with pytest.raises(SystemExit) as e:
        parse_args(importlib.import_module(script).Args)
    msg = str(e.value.code)
    assert msg.startswith("error: Unrecognized options: --turn-credit") and "\n" not in msg, msg
    assert msg.endswith(f"python {script}.py --help lists every flag"), msg


# ---- the loop: gspo_token.py hands A_i + c D_it to the loss


def test_the_loop_passes_turn_credit_to_the_loss(monkeypatch, tmp_path):
    """gspo_token.py --turn-credit 0.5 over --environment episodes whose class scores each model turn
    (get_turn_rewards, run in the tool worker; every turn scripted as a call): the rollout carries the turn
    rewards, and the loss gets (A_i + 0.5 D_it) x mask, D_it = turn_advantages of the rollout's own mask."""
    env = TURNS_ENV
    call = {"name": "add", "arguments": {"n": 1}}
    monkeypatch.setattr(episodes, "parse_calls", lambda text: [call])
    seen = {}
    sample = gspo_token.sample_groups

    def recorded(*a, **k):
        seen["roll"] = sample(*a, **k)
        return seen["roll"]

    def group_advantages(*a, **k):
        seen["A"] = real_advantages(*a, **k)
        return seen["A"]

    def loss(logp, old_logp, advantages, mask, **kw):
        seen.setdefault("adv", []).append(advantages.detach().clone())
        return real_loss(logp, old_logp, advantages, mask, **kw)

    real_advantages, real_loss = gspo_token.group_advantages, gspo_token.gspo_token_loss
    monkeypatch.setattr(gspo_token, "sample_groups", recorded)
    monkeypatch.setattr(gspo_token, "group_advantages", group_advantages)
    monkeypatch.setattr(gspo_token, "gspo_token_loss", loss)
    try:
        run_script("gspo_token", ["--environment", f"{env}:Turns", "--max-tool-calls", "2", "--turn-credit", "0.5",
                                  "--num-steps", "1", "--prompts-per-rank", "2", "--group-size", "2",
                                  "--num-minibatches", "1", "--max-new-tokens", "48",
                                  "--eval-every", "0", "--log-samples", "0"], monkeypatch, tmp_path / "o")
    finally:
        episodes._TOOLS.pop((None, f"{env}:Turns", 2)).stop()
    roll = seen["roll"]
    assert max(len(r) for r in roll.turn_rewards) > 1  # some episode went on after a tool turn
    starts = ((roll.mask > 0) & ~torch.nn.functional.pad(roll.mask > 0, (1, 0))[:, :-1]).sum(1).tolist()
    assert roll.turn_rewards == [[0.5 * k - 0.3 for k in range(n)] for n in starts]  # the worker's, per turn
    mask = roll.mask
    expected = (seen["A"][0].to(mask.dtype)[:, None] + 0.5 * turn_advantages(roll.turn_rewards, mask, 2)) * mask
    (adv,) = seen["adv"]
    torch.testing.assert_close(adv, expected.to(adv.dtype), rtol=1e-6, atol=1e-7)
    assert (adv != seen["A"][0][:, None] * mask).any()  # the turns moved some credit
