import pytest
import torch

from draftheads.drafters.medusa.heads import MedusaHeads
from draftheads.drafters.medusa.heads import MedusaDrafter
from draftheads.models.speculative import plain_decode, speculative_decode
from draftheads.evaluation.evaluator import summarize
from tests.helpers import StubDrafter


class RandomDrafter(StubDrafter):
    gamma = 4

    def __init__(self, vocab):
        self.vocab = vocab

    def draft_logits(self, hidden_state, last_token, features, tokens):
        return torch.randn(self.gamma, self.vocab) * 3


def _prompt(tokenizer, text="Tell me about your weekend plans please"):
    from draftheads.data.regenerate import prompt_ids
    return torch.tensor(prompt_ids(tokenizer, text))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_greedy_equals_plain_greedy_with_a_random_drafter(tiny, seed):
    model, tok = tiny
    torch.manual_seed(seed)
    ids = _prompt(tok)
    plain = plain_decode(model, ids, 40, stop=())
    spec = speculative_decode(model, RandomDrafter(len(tok)), ids, 40, stop=())
    assert spec.tokens == plain.tokens
    assert len(plain.tokens) == 40 and plain.target_forwards == 40


def test_speculative_greedy_equals_plain_greedy_with_trained_like_heads(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, num_heads=4)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    drafter = MedusaDrafter(heads, model.get_output_embeddings())
    for text in ("hello there", "def add(a, b):", "what is the weather like today where you live?"):
        ids = _prompt(tok, text)
        assert speculative_decode(model, drafter, ids, 32, {tok.eos_token_id}).tokens == \
            plain_decode(model, ids, 32, {tok.eos_token_id}).tokens


def test_a_drafter_that_knows_the_answer_gets_everything_accepted(tiny):
    model, tok = tiny
    ids = _prompt(tok)
    truth = plain_decode(model, ids, 40, stop=()).tokens

    class Oracle(StubDrafter):
        """Knows the target's greedy continuation; if all is accepted, step s starts at token 1 + 5 s."""
        gamma, calls = 4, 0

        def draft_logits(self, hidden_state, last_token, features, tokens):
            start = 1 + 5 * self.calls
            self.calls += 1
            return torch.nn.functional.one_hot(torch.tensor(truth[start:start + 4]), len(tok)).float()

    spec = speculative_decode(model, Oracle(), ids, 31, stop=())
    assert spec.tokens == truth[:31]
    assert spec.accepted_per_step == [4] * 6 and spec.target_forwards == 7
    m = summarize([plain_decode(model, ids, 31, ())], [spec], 4, 31, [])
    assert m["acceptance_rate_per_position"] == [1.0] * 4
    assert m["acceptance_length"] == 5.0 and m["greedy_match"] == 1.0


def test_eos_stops_both_decoders_at_the_same_token(tiny):
    model, tok = tiny
    ids = _prompt(tok)
    plain = plain_decode(model, ids, 30, stop=()).tokens
    eos = plain[5]  # pretend the 6th greedy token is the end of turn
    torch.manual_seed(0)
    spec = speculative_decode(model, RandomDrafter(len(tok)), ids, 30, stop={eos})
    assert spec.tokens == plain_decode(model, ids, 30, stop={eos}).tokens == plain[:plain.index(eos) + 1]


def test_summary_counts_conditional_and_cumulative_acceptance():
    from draftheads.models.speculative import DecodeResult
    spec = DecodeResult(tokens=[1] * 9, target_forwards=4, seconds=1.0, accepted_per_step=[2, 0, 1],
                        emitted_per_step=[3, 1, 2])
    plain = DecodeResult(tokens=[1] * 9, target_forwards=9, seconds=2.0)
    m = summarize([plain], [spec], gamma=3, max_new_tokens=9, mismatches=[])
    assert m["acceptance_length"] == pytest.approx(2.0)
    # position 1 attempted 3x accepted 2x; position 2 attempted 2x accepted 1x; position 3 attempted 1x, 0x
    assert m["acceptance_rate_per_position"] == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert m["cumulative_acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert m["speedup"] == pytest.approx(2.0)
