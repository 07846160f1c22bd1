import pytest
import torch

from draftheads.data.regenerate import prompt_ids
from draftheads.drafters.medusa.heads import MedusaHeads
from draftheads.drafters.medusa.heads import MedusaDrafter
from draftheads.models.speculative import plain_decode
from draftheads.models.tree import Tree, TypicalAcceptance, default_choices, tree_decode
from tests.helpers import StubDrafter

CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


def _drafter(model, seed):
    torch.manual_seed(seed)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, num_heads=4)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    return MedusaDrafter(heads, model.get_output_embeddings())


def test_tree_structure_and_mask():
    tree = Tree.from_choices([(1,), (0,), (0, 0)], num_positions=2)
    assert tree.paths == ((0,), (1,), (0, 0)) and tree.parent == (-1, 0, 0, 1) and tree.depth == (0, 1, 1, 2)
    assert tree.attention().int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def test_a_tree_deeper_than_the_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="depth 3 but the drafter proposes only 2"):
        Tree.from_choices([(0,), (0, 0), (0, 0, 0)], num_positions=2)
    with pytest.raises(ValueError, match="no parent"):
        Tree.from_choices([(0, 0)], num_positions=2)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_tree_decoding_equals_plain_greedy(tiny, seed):
    model, tok = tiny
    drafter = _drafter(model, seed)
    tree = Tree.from_choices(CHOICES, drafter.gamma)
    for text in ("tell me about your weekend", "def add(a, b):"):
        ids = torch.tensor(prompt_ids(tok, text))
        result = tree_decode(model, drafter, tree, ids, 40, {tok.eos_token_id})
        assert result.tokens == plain_decode(model, ids, 40, {tok.eos_token_id}).tokens
        assert result.target_forwards <= len(result.tokens)


def test_an_oracle_tree_accepts_the_deepest_path(tiny):
    """A drafter whose rank-1 candidates are right (rank 0 wrong) must follow the (1, 1, 1, 1)-side path."""
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "hello"))
    truth = plain_decode(model, ids, 40, ()).tokens

    class Oracle(StubDrafter):
        gamma, calls = 4, 0

        def draft_logits(self, hidden_state, last_token, features, tokens):
            start = 1 + 5 * self.calls
            self.calls += 1
            logits = torch.zeros(4, len(tok))
            right = torch.tensor(truth[start:start + 4])
            logits[torch.arange(4), right] = 2.0
            logits[torch.arange(4), (right + 1) % len(tok)] = 3.0  # a wrong top-1 everywhere
            return logits

    tree = Tree.from_choices([(0,), (1,), (1, 0), (1, 1), (1, 1, 1), (1, 1, 1, 1)], 4)
    result = tree_decode(model, Oracle(), tree, ids, 31, ())
    assert result.tokens == truth[:31] and result.accepted_per_step == [4] * 6


def test_typical_acceptance_thresholds(tiny):
    """Threshold 0 accepts every candidate (the deepest path each step); an impossible one accepts none."""
    model, tok = tiny
    drafter = _drafter(model, 0)
    tree = Tree.from_choices(CHOICES, 4)
    ids = torch.tensor(prompt_ids(tok, "tell me about your weekend"))
    everything = tree_decode(model, drafter, tree, ids, 40, (), TypicalAcceptance(epsilon=0.0, delta=0.0))
    assert everything.accepted_per_step[:-1] == [4] * (len(everything.accepted_per_step) - 1)
    nothing = tree_decode(model, drafter, tree, ids, 40, (), TypicalAcceptance(epsilon=1.0, delta=1e9))
    assert set(nothing.accepted_per_step) == {0} and len(nothing.tokens) == 40


def test_default_tree_follows_the_measured_accuracies():
    accs = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    choices = default_choices(accs, budget=5)
    # expected acceptance of each path: (0,) .6, (0, 0) .3, (1,) .2, (0, 0, 0) .12, (0, 1) .12 (ties: lower ranks)
    assert choices == [(0,), (0, 0), (1,), (0, 0, 0), (0, 1)]
    tree = Tree.from_choices(choices, 3)
    assert len(tree.paths) == 5 and max(tree.depth) <= 3


def test_typical_acceptance_matches_medusa_and_reads_the_temperature():
    """FasterDecoding/Medusa's evaluate_posterior: among equally long accepted paths the likeliest wins (not the
    first); the threshold is min(epsilon, delta * exp(-H)) with H = -sum p log(p + 1e-5) at the temperature."""
    from draftheads.models.tree import _accepted, _best
    tree = Tree.from_choices([(0,), (1,)], 1)  # the root and two depth-1 candidates
    logits = torch.zeros(3, 5)
    logits[0] = torch.tensor([0.0, 2.0, 2.5, -1.0, -1.0])  # the root's distribution: token 2 likelier than 1
    tokens = torch.tensor([0, 1, 2])  # candidate rank 0 drafts token 1, rank 1 token 2
    typical = TypicalAcceptance(epsilon=0.09, delta=0.3, temperature=0.7)
    at_parents = logits[list(tree.parent[1:])]  # row i - 1: the logits node i is judged by (its parent's)
    accepted, loglik = _accepted(tree, tokens, at_parents, typical)
    assert accepted.tolist() == [True, True, True] and loglik[2] > loglik[1]
    assert _best(tree, accepted, loglik) == 2  # the likelier of the two accepted candidates, not the first
    p = (logits[0] / 0.7).softmax(-1)
    entropy = -(p * (p + 1e-5).log()).sum()
    threshold = min(0.09, 0.3 * float((-entropy).exp()))
    assert bool(accepted[1]) == bool(p[1] > threshold)
    # the temperature changes the decision: very hot, token 1 is no longer above the threshold
    hot, _ = _accepted(tree, tokens, at_parents, TypicalAcceptance(epsilon=0.5, delta=1.0, temperature=50.0))
    cold, _ = _accepted(tree, tokens, at_parents, TypicalAcceptance(epsilon=0.5, delta=1.0, temperature=0.7))
    assert hot.tolist() != cold.tolist()


def test_typical_entropy_is_smoothed_as_medusa_smooths_it():
    """H = -sum p log(p + 1e-5), not the exact entropy: a candidate placed between the two thresholds is rejected."""
    from draftheads.models.tree import _accepted
    logits = torch.zeros(2, 2000)
    logits[0, 0] = 5.0  # the root's distribution: one likely token and many tiny ones
    tree, tokens = Tree.from_choices([(0,)], 1), torch.tensor([0, 1])  # the candidate: a tiny-probability token
    p = logits[0].softmax(-1)
    smoothed, exact = (p * (p + 1e-5).log()).sum().exp(), (p * p.log()).sum().exp()  # exp(-H) both ways
    delta = float(p[1] / ((smoothed + exact) / 2))
    accepted, _ = _accepted(tree, tokens, logits[:1], TypicalAcceptance(epsilon=1.0, delta=delta, temperature=1.0))
    assert not accepted[1] and bool(p[1] > delta * exact)
