"""Acceptance as the servers count it, and tests that see acceptance bugs without vLLM.

- Oracle drafters whose exact tau and per-position acceptance are known: tau = 1 + accepted drafts per
  verification step, counted before the token budget cuts the output (vLLM, EAGLE), and it equals 1 + the sum
  of the cumulative per-position acceptances.
- Teacher forcing: every draft the decoder asked for equals the draft the same drafter makes from the target's
  states over the whole greedy output (one forward), and so does every acceptance count. A drafter fed a stale
  hidden state, or a DFlash context that keeps rejected drafts' features, fails here.
"""

import pytest
import torch

from draftheads.data.hidden_states import layer_features
from draftheads.data.regenerate import prompt_ids
from draftheads.drafters.dflash.model import DFlashDraftModel, DFlashDrafter, choose_mask_token
from draftheads.drafters.medusa.heads import MedusaDrafter, MedusaHeads
from draftheads.evaluation.evaluator import summarize
from draftheads.models.speculative import plain_decode, speculative_decode
from tests.helpers import StubDrafter

GAMMA = 4


@pytest.fixture(scope="module")
def greedy(tiny):
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "Tell me about your weekend plans please"))
    return model, tok, ids, plain_decode(model, ids, 80, ()).tokens


def _known(truth: list[int], vocab: int, right: int):
    """A drafter that knows the target's greedy continuation ``truth`` and drafts it right for ``right``
    positions, then wrong ones: every step accepts exactly ``right``."""

    class Known(StubDrafter):
        gamma = GAMMA

        def __init__(self):
            self.pos = 0

        def start(self):
            self.pos = 0

        def draft_logits(self, hidden_state, last_token, features, tokens):
            drafts = list(truth[self.pos + 1:self.pos + 1 + GAMMA])
            drafts[right:] = [(t + 1) % vocab for t in drafts[right:]]
            self.pos += min(right, GAMMA) + 1  # the decoder accepts exactly `right`, then emits the bonus
            return torch.nn.functional.one_hot(torch.tensor(drafts), vocab).float()

    return Known()


@pytest.mark.parametrize("right", [0, 2, 4])
def test_an_oracle_drafter_gets_its_exact_tau_and_per_position_acceptance(greedy, right):
    model, tok, ids, truth = greedy
    spec = speculative_decode(model, _known(truth, len(tok), right), ids, 31, ())
    assert spec.tokens == truth[:31] and set(spec.accepted_per_step) == {right}
    m = summarize([plain_decode(model, ids, 31, ())], [spec], GAMMA, 31, [])
    assert m["acceptance_length"] == 1 + right
    assert m["acceptance_rate_per_position"] == [1.0] * right + [0.0] * (GAMMA - right)
    assert m["cumulative_acceptance_per_position"] == [1.0] * right + [0.0] * (GAMMA - right)
    assert m["acceptance_length"] == pytest.approx(1 + sum(m["cumulative_acceptance_per_position"]))


def test_tau_is_counted_before_the_budget_cuts_the_last_step(greedy):
    """A perfect drafter at a budget that cuts its last block: tau stays 1 + gamma (as vLLM counts), while
    tokens per step, what the speedup follows, drops."""
    model, tok, ids, truth = greedy
    spec = speculative_decode(model, _known(truth, len(tok), GAMMA), ids, 33, ())  # 1 + 5 * 6 = 31, then 2
    assert spec.tokens == truth[:33] and spec.accepted_per_step == [GAMMA] * 7
    m = summarize([plain_decode(model, ids, 33, ())], [spec], GAMMA, 33, [])
    assert m["acceptance_length"] == 1 + GAMMA
    assert m["tokens_per_step"] == pytest.approx(32 / 7)
    assert m["acceptance_length"] == pytest.approx(1 + sum(m["cumulative_acceptance_per_position"]))


class _Recorder:
    """Wraps a chain drafter and keeps every proposal it returned."""

    def __init__(self, inner):
        self.inner, self.proposals = inner, []
        self.name, self.gamma, self.target_layer_ids = inner.name, inner.gamma, inner.target_layer_ids

    def start(self):
        self.inner.start()

    def draft_logits(self, hidden_state, last_token, features, tokens):
        out = self.inner.draft_logits(hidden_state, last_token, features, tokens)
        self.proposals.append(out.float().clone())
        return out


def _starts(accepted_per_step: list[int]) -> list[int]:
    """Where each verification step starts in the output: the index of its x0 (the newest token)."""
    starts, position = [], 0
    for n in accepted_per_step:
        starts.append(position)
        position += n + 1
    return starts


def _check_teacher_forced(spec, recorder, teacher, truth):
    """Each step's recorded proposal equals the teacher-forced one, and so does its acceptance count."""
    for step, (start, n) in enumerate(zip(_starts(spec.accepted_per_step), spec.accepted_per_step)):
        forced = teacher(start)
        torch.testing.assert_close(recorder.proposals[step], forced, atol=2e-4, rtol=1e-3)
        drafts, following = forced.argmax(-1).tolist(), truth[start + 1:start + 1 + len(forced)]
        matched = next((i for i, (d, t) in enumerate(zip(drafts, following)) if d != t), len(drafts))
        assert matched == n, f"step {step}: decoding accepted {n}, teacher forcing says {matched}"


def test_medusa_drafts_from_the_hidden_state_that_predicted_the_newest_token(greedy):
    model, tok, ids, truth = greedy
    torch.manual_seed(0)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, num_heads=GAMMA)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    lm_head = model.get_output_embeddings()
    recorder = _Recorder(MedusaDrafter(heads, lm_head))
    spec = speculative_decode(model, recorder, ids, 40, ())
    assert spec.tokens == truth[:40]
    with torch.no_grad():
        states = model.base_model(input_ids=torch.tensor(ids.tolist() + truth)[None]).last_hidden_state[0]
        # the output's token at index s was predicted from the state at prompt position len(ids) - 1 + s
        _check_teacher_forced(spec, recorder, lambda s: heads(states[len(ids) - 1 + s], lm_head=lm_head).float(), truth)


def test_dflash_drafts_from_the_features_of_verified_tokens_only(greedy):
    """DFlash's context is every committed token before the block's anchor, never a rejected draft."""
    model, tok, ids, truth = greedy
    torch.manual_seed(0)
    drafter = DFlashDraftModel.for_target(model, 1, GAMMA + 1, [0, 2, 3], choose_mask_token(tok, len(tok)))
    recorder = _Recorder(DFlashDrafter(drafter))
    spec = speculative_decode(model, recorder, ids, 40, ())
    assert spec.tokens == truth[:40]
    row = torch.tensor(ids.tolist() + truth)[None]
    with torch.no_grad():
        features = layer_features(model, row, torch.ones_like(row), drafter.target_layer_ids)
        anchors = torch.tensor([[len(ids) + s for s in _starts(spec.accepted_per_step)]])
        blocks = drafter.logits(drafter(features, row, torch.ones_like(row), anchors))[0, :, 1:].float()
    starts = _starts(spec.accepted_per_step)
    _check_teacher_forced(spec, recorder, lambda s: blocks[starts.index(s)], truth)


def test_prompt_lookup_counts_every_forward_as_a_verification_step():
    """transformers' generate verifies drafts in its first forward too (the prompt's n-grams are drafted before
    it): tau = tokens per target forward, the prefill's included; decode time is not separated there."""
    from draftheads.data.sources import Prompt
    from draftheads.evaluation.evaluator import _peer_summary
    from draftheads.models.speculative import DecodeResult
    plain = DecodeResult(tokens=[1] * 11, target_forwards=11, seconds=1.1, prefill_seconds=0.2)
    lookup = DecodeResult(tokens=[1] * 11, target_forwards=2, seconds=0.4)  # 6 tokens from the prefill, then 5
    m = _peer_summary([plain], [lookup], [Prompt("test", 0, "hi")], 1e-4, True)
    assert m["acceptance_length"] == m["tokens_per_step"] == 5.5
    assert m["decode_ms_per_token"] is None and m["speedup"] == pytest.approx((11 / 0.4) / (11 / 1.1))


def test_every_method_is_warmed_up_before_timing_and_decode_time_leaves_the_prefill_out(greedy):
    from draftheads.evaluation.evaluator import evaluate_set
    from draftheads.data.sources import Prompt
    model, tok, ids, truth = greedy
    calls = []

    def peer(prompt, generator):
        calls.append(len(prompt))
        return plain_decode(model, prompt, 8, ())

    m = evaluate_set(model, tok, _known(truth, len(tok), 2), [Prompt("test", 0, "Tell me about your weekend")], 8,
                     1e-4, peers={"plain_again": peer})
    assert len(calls) == 2 and calls[0] != calls[1]  # a warm-up on its own short prompt, then the measured one
    for ms in (*m["decode_ms_per_token"].values(), m["peers"]["plain_again"]["decode_ms_per_token"]):
        assert ms > 0


def test_plain_decoding_records_the_logits_resolution_in_their_dtype(tiny):
    import copy
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "hello"))
    f32 = plain_decode(model, ids, 3, ())
    bf16 = plain_decode(copy.deepcopy(model).to(torch.bfloat16), ids, 3, ())
    ratio = torch.finfo(torch.bfloat16).eps / torch.finfo(torch.float32).eps
    assert bf16.logit_steps[0] / f32.logit_steps[0] == pytest.approx(ratio, rel=0.05)


@pytest.mark.parametrize("dtype, tie", [(torch.bfloat16, True), (torch.float32, False)])
def test_a_one_step_logit_gap_is_a_tie_in_bf16_only(dtype, tie):
    """greedy_match's tie tolerance follows the logits' dtype: one bf16 step (0.125 at a logit of 20) is a
    rounding tie, the same gap in float32 a real mismatch."""
    from draftheads.data.sources import Prompt
    from draftheads.evaluation.evaluator import _mismatch
    from draftheads.models.speculative import DecodeResult
    plain = DecodeResult(tokens=[5, 6], top2_gaps=[0.125, 3.0], logit_steps=[torch.finfo(dtype).eps * 20, 0.0])
    mismatch = _mismatch(Prompt("test", 0, "hi"), plain, DecodeResult(tokens=[7, 6]), tie_tolerance=1e-4)
    assert mismatch["first_difference"] == 0 and mismatch["tie"] is tie


def test_a_peer_that_differs_from_plain_greedy_reports_where_and_whether_at_a_tie(greedy):
    """Peers report their first differences as the chain does: one that breaks a near-tie of the target's top-2
    logits differently is a tie (two code paths may), one that changes a decided step is not."""
    from draftheads.data.sources import Prompt
    from draftheads.evaluation.evaluator import evaluate_set
    model, tok, _, _ = greedy
    prompt = Prompt("test", 0, "Tell me about your weekend")
    ids = torch.tensor(prompt_ids(tok, prompt.text))
    plain = plain_decode(model, ids, 8, ())
    decided = max(range(8), key=lambda i: plain.top2_gaps[i])

    def differs_at(step: int):
        def decode(prompt_ids, generator):
            result = plain_decode(model, prompt_ids, 8, ())
            result.tokens[step] = (result.tokens[step] + 1) % len(tok)
            return result
        return decode

    m = evaluate_set(model, tok, _known(plain.tokens, len(tok), 2), [prompt], 8, 1e-4,
                     peers={"tie": differs_at(0), "broken": differs_at(decided)})
    tied = plain.top2_gaps[0] + 1e-6  # the tolerance that makes step 0's gap a tie
    tie = evaluate_set(model, tok, _known(plain.tokens, len(tok), 2), [prompt], 8, tied,
                       peers={"tie": differs_at(0)})["peers"]["tie"]
    broken = m["peers"]["broken"]
    assert broken["greedy_match"] == 0.0 and broken["mismatches"][0]["first_difference"] == decided
    assert not broken["mismatches"][0]["tie"] and broken["greedy_ties"] == 0
    assert tie["mismatches"][0]["tie"] and tie["greedy_ties"] == 1 and tie["greedy_match"] == 0.0


def test_an_eval_prompt_is_decoded_with_its_system_turn(tiny, tmp_path):
    """An eval row with a system message is measured on the conversation up to its first answer, system turn
    included, as training renders it: not on its user turn alone."""
    import json
    from draftheads.data.conversations import first_user_prompts
    from draftheads.data.sources import PromptSource
    from draftheads.evaluation.evaluator import evaluate_set
    model, tok = tiny
    path = tmp_path / "eval.jsonl"
    chat = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Bonjour"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    prompts = first_user_prompts(PromptSource("jsonl", str(path)), "eval", 1)
    seen = []

    def recording(prompt_ids_, generator):
        seen.append(prompt_ids_.tolist())
        return plain_decode(model, prompt_ids_, 4, ())

    evaluate_set(model, tok, _known([0] * 64, len(tok), 0), prompts, 4, 1e-4, peers={"recording": recording})
    assert seen[-1] == prompt_ids(tok, chat[:2]) and "You answer in French." in tok.decode(seen[-1])
