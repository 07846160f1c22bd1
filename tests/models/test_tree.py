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
        result = tree_decode(model, drafter, tree, ids, 40, tok.eos_token_id)
        assert result.tokens == plain_decode(model, ids, 40, tok.eos_token_id).tokens
        assert result.target_forwards <= len(result.tokens)


def test_an_oracle_tree_accepts_the_deepest_path(tiny):
    """A drafter whose rank-1 candidates are right (rank 0 wrong) must follow the (1, 1, 1, 1)-side path."""
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "hello"))
    truth = plain_decode(model, ids, 40, None).tokens

    class Oracle(StubDrafter):
        gamma, calls = 4, 0

        def draft_logits(self, hidden_state, last_token, features):
            start = 1 + 5 * self.calls
            self.calls += 1
            logits = torch.zeros(4, len(tok))
            right = torch.tensor(truth[start:start + 4])
            logits[torch.arange(4), right] = 2.0
            logits[torch.arange(4), (right + 1) % len(tok)] = 3.0  # a wrong top-1 everywhere
            return logits

    tree = Tree.from_choices([(0,), (1,), (1, 0), (1, 1), (1, 1, 1), (1, 1, 1, 1)], 4)
    result = tree_decode(model, Oracle(), tree, ids, 31, None)
    assert result.tokens == truth[:31] and result.accepted_per_step == [4] * 6


def test_typical_acceptance_thresholds(tiny):
    """Threshold 0 accepts every candidate (the deepest path each step); an impossible one accepts none."""
    model, tok = tiny
    drafter = _drafter(model, 0)
    tree = Tree.from_choices(CHOICES, 4)
    ids = torch.tensor(prompt_ids(tok, "tell me about your weekend"))
    everything = tree_decode(model, drafter, tree, ids, 40, None, TypicalAcceptance(epsilon=0.0, delta=0.0))
    assert everything.accepted_per_step[:-1] == [4] * (len(everything.accepted_per_step) - 1)
    nothing = tree_decode(model, drafter, tree, ids, 40, None, TypicalAcceptance(epsilon=1.0, delta=1e9))
    assert set(nothing.accepted_per_step) == {0} and len(nothing.tokens) == 40


def test_default_tree_follows_the_measured_accuracies():
    accs = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    choices = default_choices(accs, budget=5)
    # expected acceptance of each path: (0,) .6, (0, 0) .3, (1,) .2, (0, 0, 0) .12, (0, 1) .12 (ties: lower ranks)
    assert choices == [(0,), (0, 0), (1,), (0, 0, 0), (0, 1)]
    tree = Tree.from_choices(choices, 3)
    assert len(tree.paths) == 5 and max(tree.depth) <= 3
