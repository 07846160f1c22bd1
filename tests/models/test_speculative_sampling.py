"""Speculative sampling is lossless: its outputs follow the target's own sampling distribution, with drafts
proposed as servers propose them (q's argmax, q one-hot) and as the papers sample them (d ~ q).

Chi-square tests at significance 1e-3 with enough samples that the classic bugs (sampling the correction
from p instead of max(0, p - q), dropping the bonus token, processing p and q differently) fail; the test's
power is checked on those buggy rules too.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftheads.models.speculative import (Proposal, Sampling, accept_chain, plain_decode, prompt_lookup_decode,
                                           propose, speculative_decode)
from tests.helpers import StubDrafter, chi2_rejects
from tests.helpers import exact_joint as _exact_joint
from tests.helpers import pair_counts as _pair_counts

V, G, N = 6, 2, 8_000
SAMPLING = Sampling(temperature=0.7, top_k=5, proposal=Proposal.sample)
SERVED = Sampling(temperature=0.7, top_k=5, proposal=Proposal.argmax)


def _emitted(rule, target_logits, draft_logits, sampling, generator):
    """Samples of (first, second, third) emitted tokens, -1 where the step emitted fewer."""
    out = torch.full((N, 3), -1)
    for s in range(N):
        draft, q = propose(draft_logits, sampling, generator)
        n, nxt = rule(draft, q, target_logits, sampling, generator)
        seq = draft[:n].tolist() + [nxt]
        out[s, :min(3, len(seq))] = torch.tensor(seq[:3])
    return out


def _position_rejections(samples, probs):
    """Which of the first three emitted positions reject ``probs[i]`` (the target's context-free p_i)."""
    return [chi2_rejects(torch.bincount(samples[samples[:, i] >= 0, i], minlength=V), probs[i]) for i in range(3)]


def _wrong_residual(draft, q, target_logits, sampling, generator):
    p = sampling.probs(target_logits)
    for i, x in enumerate(draft.tolist()):
        if torch.rand(1, generator=generator) * q[i, x] >= p[i, x]:
            return i, int(torch.multinomial(p[i], 1, generator=generator))  # bug: p, not max(0, p - q)
    return len(draft), int(torch.multinomial(p[-1], 1, generator=generator))


def _no_bonus(draft, q, target_logits, sampling, generator):
    n, nxt = accept_chain(draft, q, target_logits, sampling, generator)
    return (n, nxt) if n < len(draft) else (n - 1, int(draft[-1]))  # bug: last draft repeated, no bonus


def _hot_draft(draft, q, target_logits, sampling, generator):
    return accept_chain(draft, (q.log() * 2.0).softmax(-1), target_logits, sampling, generator)  # bug: q at T/2


def _sampled_q_for_argmax_drafts(draft, q, target_logits, sampling, generator):
    """bug: argmax drafts verified against the sampled q (min(1, p/q)) instead of q one-hot."""
    return accept_chain(draft, sampling.probs(target_logits[:-1] + 1.0), target_logits, sampling, generator)


@pytest.fixture(scope="module")
def logits():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(G + 1, V, generator=g) * 1.5
    return target, target[:G] + torch.randn(G, V, generator=g)  # a drafter that is often right


@pytest.mark.parametrize("sampling", [SERVED, SAMPLING], ids=["argmax", "sample"])
def test_every_emitted_position_follows_the_target_distribution(logits, sampling):
    target_logits, draft_logits = logits
    samples = _emitted(accept_chain, target_logits, draft_logits, sampling, torch.Generator().manual_seed(1))
    assert _position_rejections(samples, sampling.probs(target_logits)) == [False, False, False]
    assert (samples[:, 2] >= 0).float().mean() > 0.2  # the third position, the bonus token, is exercised


@pytest.mark.parametrize("bug, sampling", [(_wrong_residual, SAMPLING), (_no_bonus, SAMPLING), (_hot_draft, SAMPLING),
                                           (_wrong_residual, SERVED), (_sampled_q_for_argmax_drafts, SERVED)])
def test_the_test_catches_classic_bugs(logits, bug, sampling):
    target_logits, draft_logits = logits
    samples = _emitted(bug, target_logits, draft_logits, sampling, torch.Generator().manual_seed(2))
    assert any(_position_rejections(samples, sampling.probs(target_logits)))


def test_argmax_drafts_are_accepted_with_the_target_probability_of_the_draft():
    """The served rule at position 1: P(accept d) = p(d), measured against the sampled-q rule's min(1, p/q)."""
    target_logits, draft_logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([[0.0, 3.0, 0.0]])
    p = SERVED.probs(target_logits[0])
    accepted = {}
    for sampling in (SERVED, Sampling(temperature=0.7, proposal=Proposal.sample)):
        gen, hits, drafts = torch.Generator().manual_seed(3), 0, 0
        for _ in range(4000):
            draft, q = propose(draft_logits, sampling, gen)
            if int(draft[0]) == 1:
                drafts += 1
                hits += accept_chain(draft, q, target_logits, sampling, gen)[0]
        accepted[sampling.proposal] = hits / drafts
    assert accepted["argmax"] == pytest.approx(float(p[1]), abs=0.03)  # q one-hot: u < p(d)
    q1 = Sampling(temperature=0.7).probs(draft_logits[0])[1]
    assert accepted["sample"] == pytest.approx(min(1.0, float(p[1] / q1)), abs=0.03)


@pytest.mark.parametrize("settings", [dict(temperature=-0.5), dict(temperature=0.7, top_p=0.0),
                                      dict(temperature=0.7, top_p=1.5), dict(temperature=0.7, top_k=-1)])
def test_invalid_sampling_settings_are_refused(settings):
    with pytest.raises(ValueError, match="temperature >= 0, top_k >= 0 and 0 < top_p <= 1"):
        Sampling(**settings)


def test_greedy_acceptance_is_the_longest_matching_prefix():
    target_logits = torch.full((4, 5), -10.0)
    target_logits[[0, 1, 2, 3], [1, 2, 3, 4]] = 0.0  # the target wants 1, 2, 3 then 4
    n, nxt = accept_chain(torch.tensor([1, 2, 0]), None, target_logits, Sampling())
    assert (n, nxt) == (2, 3)
    n, nxt = accept_chain(torch.tensor([1, 2, 3]), None, target_logits, Sampling())
    assert (n, nxt) == (3, 4)


def test_top_k_and_top_p_processing():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert (Sampling(1.0, top_k=2).probs(logits)[2:] == 0).all()
    p = Sampling(1.0, top_p=0.7).probs(logits)  # softmax: 0.64, 0.24, ...: the first two cross 0.7
    assert (p[:2] > 0).all() and (p[2:] == 0).all()
    torch.testing.assert_close(Sampling(0.5).probs(logits), (logits / 0.5).softmax(-1))


class _FixedDrafter(StubDrafter):
    gamma = 2

    def __init__(self, vocab):
        self.logits = torch.randn(self.gamma, vocab, generator=torch.Generator().manual_seed(5)) * 2

    def draft_logits(self, hidden_state, last_token, features, tokens):
        return self.logits


@pytest.fixture(scope="module")
def small_vocab_model():
    """A random 1-layer Llama with 5 tokens, sharp enough that sampling differs visibly from uniform."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("proposal", list(Proposal))
def test_speculative_sampling_end_to_end_matches_the_target_joint_distribution(small_vocab_model, proposal):
    """First two generated tokens of a small-vocabulary random Llama: speculative vs the exact joint, with drafts
    proposed either way."""
    model, prompt, sampling = small_vocab_model, torch.tensor([1, 2, 3]), Sampling(temperature=0.8, proposal=proposal)
    joint = _exact_joint(model, prompt, sampling)
    gen = torch.Generator().manual_seed(3)
    drafter = _FixedDrafter(5)
    assert not chi2_rejects(_pair_counts(lambda: speculative_decode(model, drafter, prompt, 2, (), sampling, gen),
                                         2500, 5), joint)
    # the baseline samples the same distribution (sanity of the helper itself)
    assert not chi2_rejects(_pair_counts(lambda: plain_decode(model, prompt, 2, (), sampling, gen), 500, 5), joint)


@pytest.mark.parametrize("proposal", list(Proposal))
def test_verifying_fewer_drafts_is_lossless_too(small_vocab_model, proposal):
    """``verify`` (adaptive verification's hook: DSpark's ``dspark_adaptive``) choosing how many of the drafts the
    target checks, here at random from its own generator (0, 1 or 2 of 2): still the exact joint; the counts are
    recorded per step, and a count outside 0..g is refused."""
    model, prompt, sampling = small_vocab_model, torch.tensor([1, 2, 3]), Sampling(temperature=0.8, proposal=proposal)
    gen, own, verified = torch.Generator().manual_seed(3), torch.Generator().manual_seed(8), []
    drafter = _FixedDrafter(5)

    def decode():
        result = speculative_decode(model, drafter, prompt, 2, (), sampling, gen,
                                    verify=lambda g: int(torch.randint(0, g + 1, (1,), generator=own)))
        verified.extend(result.verified_per_step)
        return result

    assert not chi2_rejects(_pair_counts(decode, 2500, 5), _exact_joint(model, prompt, sampling))
    assert set(verified) == {0, 1, 2}
    with pytest.raises(ValueError, match="verify chose 3 of 2 drafts"):
        speculative_decode(model, drafter, prompt, 4, (), sampling, gen, verify=lambda g: g + 1)


def test_prompt_lookup_sampling_matches_the_target_joint_distribution(small_vocab_model):
    """The prompt-lookup peer at T > 0 (transformers' generate, drafts copied from a repetitive prompt) is
    lossless too, and a seeded generator reproduces it."""
    model, prompt, sampling = small_vocab_model, torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]), Sampling(0.8, top_k=4)
    gen = torch.Generator().manual_seed(4)
    counts = _pair_counts(lambda: prompt_lookup_decode(model, prompt, 2, (), 3, sampling, gen), 1500, 5)
    assert not chi2_rejects(counts, _exact_joint(model, prompt, sampling))
    runs = [prompt_lookup_decode(model, prompt, 12, (), 3, sampling, torch.Generator().manual_seed(9)).tokens
            for _ in range(2)]
    assert runs[0] == runs[1]
