"""The PyTorch twin of TRL's Triton log-prob kernel: same numbers and gradients as the plain
full-logits computation, and the env switch forces either path."""
import pytest
import torch

from lowvram_grpo.training import logprobs_fallback as lf


def _reference(hidden, weight, bias, targets, temperature, softcap, scale):
    z = (hidden @ weight.t() + (bias if bias is not None else 0)) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("softcap,scale,use_bias", [(None, 1.0, False), (30.0, 0.5, True)])
def test_matches_full_logits_values_and_gradients(monkeypatch, softcap, scale, use_bias):
    monkeypatch.setattr(lf, "HOST_CHUNK_ELEMENTS", 3 * 50)  # force several chunks of 3 rows (a CPU tensor)
    torch.manual_seed(0)
    hidden = torch.randn(10, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50) if use_bias else None
    targets = torch.randint(0, 50, (10,))
    lp, ent, *rest = lf.torch_chunked_logprobs(hidden, weight, bias, targets, 0.7, None, softcap, scale,
                                               ("log_probs", "entropy"))
    ref_lp, ref_ent = _reference(hidden, weight, bias, targets, 0.7, softcap, scale)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-4)
    assert rest == [None, None, None]
    (g_h, g_w) = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
    (r_h, r_w) = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), (hidden, weight))
    assert torch.allclose(g_h, r_h, atol=1e-4) and torch.allclose(g_w, r_w, atol=1e-4)


def test_path_choice_by_device_and_forced(monkeypatch):
    from lowvram_grpo.training import trl_compat as tc

    monkeypatch.delenv(tc.ENV, raising=False)
    assert tc.use_torch_logprobs("cpu", kernel_available=True)
    assert not tc.use_torch_logprobs("cuda", kernel_available=True)
    assert tc.use_torch_logprobs("cuda", kernel_available=False)
    monkeypatch.setenv(tc.ENV, "torch")
    assert tc.use_torch_logprobs("cuda", kernel_available=True)
    monkeypatch.setenv(tc.ENV, "triton")
    assert not tc.use_torch_logprobs("cpu", kernel_available=True)


def test_install_routes_trl_and_is_idempotent():
    from trl.trainer import utils as trl_utils

    from lowvram_grpo.training.trl_compat import install_logprob_fallback

    install_logprob_fallback()
    first = trl_utils._ChunkedLogProbFunction
    install_logprob_fallback()
    assert trl_utils._ChunkedLogProbFunction is first and first._lowvram_dispatch
    hidden = torch.randn(4, 8)
    weight = torch.randn(20, 8)
    targets = torch.randint(0, 20, (4,))
    out = first.apply(hidden, weight, None, targets, 1.0, 4096, None, 1.0, ("log_probs",))
    assert torch.allclose(out[0], _reference(hidden, weight, None, targets, 1.0, None, 1.0)[0], atol=1e-5)


def test_a_micro_batch_without_a_scored_token_is_a_differentiable_zero():
    """TRL scores only unmasked tokens and scatters the log-probs back (trl.trainer.utils, `masked_scatter` 'keeps the
    output connected ... an all-masked microbatch contributes a differentiable zero'): with every completion masked
    (mask_truncated_completions, all cut off) the fallback gets no rows and must still be on the graph."""
    hidden = torch.randn(3, 16, requires_grad=True)
    weight = torch.randn(50, 16)
    mask = torch.zeros(3, dtype=torch.bool)
    lp, ent, *_ = lf.torch_chunked_logprobs(hidden[mask], weight, None, torch.zeros(0, dtype=torch.long), 1.0, None,
                                            None, 1.0, ("log_probs", "entropy"))
    assert lp.shape == ent.shape == (0,) and lp.grad_fn is not None
    loss = -lp.new_zeros(mask.shape).masked_scatter(mask, lp).sum()
    loss.backward()
    assert hidden.grad is not None and (hidden.grad == 0).all()
