"""GRPO / DAPO pure functions against hand-computed tensors (numbers worked out in comments)."""
import math

import pytest
import torch

from tlt.rl.grpo import entropy_from_logits, group_advantages, kl_k3, masked_mean, policy_loss, zero_std_groups

# Groups: 0 -> rewards 1,0,0,1 (mean .5, unbiased std sqrt(1/3)); 1 -> 2,2 (std 0); 2 -> one sample.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 9])  # arbitrary, non-contiguous ids


def test_group_advantages_scaled_by_group_std():
    # (1 - .5) / sqrt(1/3) = .5 * sqrt(3) = 0.8660254; all-equal and singleton groups give 0.
    a = 0.5 * math.sqrt(3.0)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, GROUPS), expected, atol=1e-5, rtol=0)


def test_group_advantages_unscaled_is_centred():
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, GROUPS, scale=False), expected)


def test_group_advantages_interleaved_groups():
    # rows of two prompts interleaved: group 0 -> 3, 1 (mean 2, std sqrt(2)), group 1 -> 0, 4 (mean 2, std 2*sqrt(2))
    adv = group_advantages(torch.tensor([3.0, 0.0, 1.0, 4.0]), torch.tensor([0, 1, 0, 1]))
    r2 = 1 / math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([r2, -r2, -r2, r2]), atol=1e-5, rtol=0)


def test_zero_std_groups():
    expected = torch.tensor([False, False, False, False, True, True, True])
    assert torch.equal(zero_std_groups(REWARDS, GROUPS), expected)


def _two_rows():
    """Row 0: ratios 1.5, 0.5, 1.0, A=+2. Row 1: ratios 1.5, 0.5 (+ one padded token), A=-1."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]])
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 7.0]])
    logp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp, old, adv, mask


def test_policy_loss_clip_higher_token_mean():
    logp, old, adv, mask = _two_rows()
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # Row 0 (A=2): surr 3.0, 1.0, 2.0; clipped ratios 1.28, 0.8, 1.0 -> 2.56, 1.6, 2.0; min 2.56, 1.0, 2.0.
    # Row 1 (A=-1): surr -1.5, -0.5; clipped -1.28, -0.8; min -1.5, -0.8.
    # Token mean over the 5 masked tokens of the batch (DAPO): -(2.56 + 1 + 2 - 1.5 - 0.8) / 5 = -0.652.
    assert loss.item() == pytest.approx(-0.652, abs=1e-5)
    # Clipped term active on row 0 token 0 and row 1 token 1 -> 2 / 5.
    assert stats["clip_ratio"].item() == pytest.approx(0.4, abs=1e-6)
    # k3 of KL(old||new): r - 1 - ln r: 1.5 -> 0.0945349, 0.5 -> 0.1931472, 1 -> 0; twice -> 0.5753641 / 5.
    assert stats["approx_kl"].item() == pytest.approx(0.5753641 / 5, abs=1e-6)


def test_policy_loss_gradient_zero_where_clipped():
    logp, old, adv, mask = _two_rows()
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # d/dlogp of -ratio*A/5 = -A*ratio/5 where unclipped; 0 where the clipped term is active or masked.
    expected = torch.tensor([[0.0, -2 * 0.5 / 5, -2 * 1.0 / 5], [1.5 / 5, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected, atol=1e-6, rtol=0)


def test_policy_loss_micro_batches_sum_to_full_batch():
    logp, old, adv, mask = _two_rows()
    full, full_stats = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    denom = mask.sum()
    parts = [policy_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], 0.2, 0.28, denom) for i in range(2)]
    assert sum(p[0].item() for p in parts) == pytest.approx(full.item(), abs=1e-6)
    assert sum(p[1]["clip_ratio"].item() for p in parts) == pytest.approx(full_stats["clip_ratio"].item(), abs=1e-6)
    # Not the per-sequence mean: (-5.56/3 + 2.3/2) / 2 = -0.3516667.
    assert full.item() != pytest.approx(-0.3516667, abs=1e-3)


def test_kl_k3_hand_values():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1, 1, 0]])
    # d = ref - logp: ln .5 -> .5 + .6931472 - 1 = .1931472; ln 2 -> 2 - .6931472 - 1 = .3068528; mean .25
    assert kl_k3(logp, ref, mask).item() == pytest.approx(0.25, abs=1e-6)
    assert kl_k3(logp, logp, mask).item() == 0.0


def test_masked_mean_empty_mask_is_zero():
    x = torch.tensor([[1.0, 2.0]])
    assert masked_mean(x, torch.zeros_like(x, dtype=torch.bool)).item() == 0.0
    assert masked_mean(x, torch.tensor([[1, 1]])).item() == 1.5
    assert masked_mean(x, torch.tensor([[1, 1]]), denom=6).item() == 0.5


def test_entropy_from_logits_hand_values_and_chunking():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]])
    # uniform over 4 -> ln 4 = 1.3862944; p = (.25, .75) -> .25 ln 4 + .75 ln(4/3) = 0.5623351
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[1.3862944, 0.5623351]]))
    big = torch.randn(2, 7, 11, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(entropy_from_logits(big, chunk=3), entropy_from_logits(big, chunk=1024))
    ref = -(big.softmax(-1) * big.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(big), ref)
