"""The DFlash drafter: the five public re-implementation bugs (leakage, label shift, layer ids, training vs
inference, causal blocks) each pinned by a test, plus anchors, losslessness and the export round trip."""

import copy
import json
import math

import pytest
import torch

from draftheads.data.hidden_states import layer_features
from draftheads.drafters.dflash.model import (DFlashDraftModel, DFlashDrafter, block_labels, choose_mask_token,
                                              default_target_layer_ids, dflash_loss, paper_decay, sample_anchors)
from draftheads.drafters.dflash.export import expected_shapes, export_dflash, load_dflash
from draftheads.drafters.dflash.training import DFlashTraining
from draftheads.models.speculative import Sampling, plain_decode, speculative_decode
from draftheads.models.target import record_layer_outputs
from draftheads.training.objectives import Objective
from tests.helpers import assert_packed_trains_as_padded, feature_rows

LAYERS = [0, 2, 3]
B8 = Objective(position_decay=math.exp(-1 / 4))
"""The paper's objective for blocks of 8: cross-entropy, position k weighing exp(-(k-1)/4)."""


@pytest.fixture(scope="module")
def drafter(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    return DFlashDraftModel.for_target(model, 2, 6, LAYERS, choose_mask_token(tok, model.config.vocab_size))


def _batch(model, T=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (2, T), generator=g)
    attention = torch.ones(2, T, dtype=torch.long)
    attention[1, T - 5:] = 0
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[:, 8:] = True
    loss_mask[1, T - 5:] = False
    return ids, attention, loss_mask, layer_features(model, ids, attention, LAYERS)


def test_default_layer_ids_follow_the_paper():
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-4B, as z-lab's DFlash-b16 drafts
    assert default_target_layer_ids(32) == [1, 8, 15, 22, 29]  # Llama-3.1-8B
    assert default_target_layer_ids(28, 1) == [14]
    assert default_target_layer_ids(4) == [0, 1, 2, 3]  # a tiny target: every layer once


def test_layer_id_i_reads_the_output_of_decoder_layer_i(tiny):
    """Against an independent computation: the model cut after layer i, without its final norm."""
    model, _ = tiny
    ids = torch.randint(4, 500, (1, 12))
    with record_layer_outputs(model, [0, 1, 2, 3]) as recorded:
        hf = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    for i in range(4):
        cut = copy.deepcopy(model)
        cut.model.layers = cut.model.layers[:i + 1]
        cut.config.num_hidden_layers = i + 1
        cut.model.norm = torch.nn.Identity()
        torch.testing.assert_close(recorded[i], cut.model(input_ids=ids).last_hidden_state)
        if i < 3:  # transformers' tuple: index i+1 is layer i's output (its last entry is after the final norm)
            torch.testing.assert_close(recorded[i], hf[i + 1])
    assert not torch.allclose(recorded[3], hf[4])
    with pytest.raises(ValueError, match="outside 0..3"):
        with record_layer_outputs(model, [4]):
            pass


def test_a_block_never_sees_context_at_or_after_its_anchor(tiny, drafter):
    model, _ = tiny
    ids, attention, loss_mask, features = _batch(model)
    anchors = torch.tensor([[10, 15, 20], [9, 12, 18]])
    with torch.no_grad():
        before = drafter(features, ids, attention, anchors)
        changed = features.clone()
        changed[0, 15:] += torch.randn_like(changed[0, 15:])  # at and after block (0, 1)'s anchor
        after = drafter(features=changed, input_ids=ids, attention_mask=attention, anchors=anchors)
        torch.testing.assert_close(after[0, :2], before[0, :2])  # anchors 10 and 15 see only < 15
        assert not torch.allclose(after[0, 2], before[0, 2])  # anchor 20 sees 15..19: the test can fail
        earlier = features.clone()
        earlier[0, 14] += 1.0  # just before the anchor: must matter
        assert not torch.allclose(drafter(earlier, ids, attention, anchors)[0, 1], before[0, 1])


def test_attention_inside_a_block_is_bidirectional_and_blocks_are_isolated(tiny, drafter):
    model, _ = tiny
    ids, attention, loss_mask, features = _batch(model)
    context = drafter.context_kv(drafter.fuse(features[:1, :10]), torch.arange(10)[None])
    block = torch.full((1, drafter.block_size), drafter.mask_token_id)
    block[0, 0] = 42
    positions = torch.arange(10, 10 + drafter.block_size)[None]
    with torch.no_grad():
        base = drafter.blocks(block, positions, context, None)
        later = block.clone()
        later[0, -1] = 7  # the last position's token changes...
        other = drafter.blocks(later, positions, context, None)
    assert not torch.allclose(other[0, 1], base[0, 1])  # ...and position 1 sees it: not causal
    # in the packed pass, another block's tokens never reach this one
    anchors = torch.tensor([[10, 16], [9, 12]])
    ids2 = ids.clone()
    ids2[0, 16] = (ids[0, 16] + 1) % 500  # block 2's anchor token
    with torch.no_grad():
        a, b = drafter(features, ids, attention, anchors), drafter(features, ids2, attention, anchors)
    torch.testing.assert_close(a[0, 0], b[0, 0])
    assert not torch.allclose(a[0, 1], b[0, 1])


def test_training_pass_and_cached_drafting_give_the_same_block_logits(tiny, drafter):
    """One block inside the packed training pass == the drafting path, its context K/V cached in chunks."""
    model, _ = tiny
    ids, attention, loss_mask, features = _batch(model)
    anchors = torch.tensor([[11, 19, 23], [8, 14, -1]])
    with torch.no_grad():
        packed = drafter.logits(drafter(features, ids, attention, anchors))
    for row, j in ((0, 1), (0, 2), (1, 1)):
        a = int(anchors[row, j])
        cached = DFlashDrafter(drafter)
        cached.draft_logits(None, int(ids[row, 5]), features[row, :5], None)  # prompt, then verified chunks
        cached.draft_logits(None, int(ids[row, a - 2]), features[row, 5:a - 2], None)
        out = cached.draft_logits(None, int(ids[row, a]), features[row, a - 2:a], None)
        torch.testing.assert_close(out, packed[row, j, 1:], atol=1e-5, rtol=1e-4)


def test_anchors_and_labels_line_up(tiny):
    model, _ = tiny
    ids, _, loss_mask, _ = _batch(model)
    anchors = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 4)
    for row in range(2):
        for a in anchors[row].tolist():
            assert a == -1 or (loss_mask[row, a] and loss_mask[row, a + 1])
    labels, valid = block_labels(ids, loss_mask, anchors, 6)
    for row in range(2):
        for j, a in enumerate(anchors[row].tolist()):
            for k in range(1, 6):
                ok = a >= 0 and a + k < ids.shape[1] and bool(loss_mask[row, a + k])
                assert bool(valid[row, j, k - 1]) == ok
                if ok:
                    assert labels[row, j, k - 1] == ids[row, a + k]  # position k predicts token[anchor + k]
    many = sample_anchors(loss_mask, 512)
    assert (many >= 0).sum(1).tolist() == [19, 14]  # every response position with a response successor
    assert [paper_decay(b) for b in (16, 10, 8)] == [math.exp(-1 / 7), math.exp(-1 / 5), math.exp(-1 / 4)]


def _train(drafter, features, ids, loss_mask, max_anchors, steps) -> dict:
    """AdamW at 1e-2 on fresh random blocks every step; the last step's metrics."""
    attention = torch.ones_like(ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        anchors = sample_anchors(loss_mask, max_anchors)
        labels, valid = block_labels(ids, loss_mask, anchors, drafter.block_size)
        loss, metrics = dflash_loss(drafter, drafter(features, ids, attention, anchors), labels, valid, B8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return metrics


def test_labels_are_not_shifted_a_drafter_learns_a_deterministic_sequence(tiny):
    """Rows cycle through 5 tokens; a drafter with correctly aligned labels predicts every block position
    (a label shifted by one would predict the token one step behind: accuracy ~0)."""
    model, tok = tiny
    torch.manual_seed(0)
    drafter = DFlashDraftModel.for_target(model, 1, 6, [1, 3], choose_mask_token(tok, model.config.vocab_size))
    cycle = torch.tensor([40, 41, 42, 43, 44])
    phases = torch.arange(8)
    ids = cycle[(phases[:, None] + torch.arange(30)[None]) % 5]
    attention = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :4] = False
    metrics = _train(drafter, layer_features(model, ids, attention, [1, 3]), ids, loss_mask, 8, 120)
    assert all(metrics[f"acc_pos{k}"] > 0.95 for k in range(1, 6)), metrics
    assert metrics["tau_estimate"] > 5.5


def test_greedy_dflash_decoding_equals_plain_greedy(tiny, drafter):
    """With one pass and with iterative denoising, an untrained drafter still gives plain greedy's tokens."""
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "Tell me something about the weather today"))
    plain = plain_decode(model, ids, 40, ())
    for steps in (1, 3):
        spec = speculative_decode(model, DFlashDrafter(drafter, steps), ids, 40, ())
        assert spec.tokens == plain.tokens
        assert spec.target_forwards == len(spec.accepted_per_step) + 1
        assert all(0 <= n <= drafter.block_size - 1 for n in spec.accepted_per_step)


def test_a_drafter_that_knows_the_features_gets_whole_blocks_accepted(tiny):
    """Block positions copy the target's greedy continuation when the drafter is trained on it: high tau."""
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "hello there"))
    truth = plain_decode(model, ids, 30, ()).tokens
    row = torch.tensor(ids.tolist() + truth)[None]
    attention = torch.ones_like(row)
    loss_mask = torch.zeros_like(row, dtype=torch.bool)
    loss_mask[0, len(ids):] = True
    torch.manual_seed(0)
    drafter = DFlashDraftModel.for_target(model, 1, 4, LAYERS, choose_mask_token(tok, model.config.vocab_size))
    _train(drafter, layer_features(model, row, attention, LAYERS), row, loss_mask, 64, 150)  # overfit one row
    spec = speculative_decode(model, DFlashDrafter(drafter), ids, 30, ())
    assert spec.tokens == truth[:30]
    assert len(spec.tokens) / len(spec.accepted_per_step) > 3.0  # close to the block size of 4


def test_sampled_dflash_decoding_is_reproducible(tiny, drafter):
    from draftheads.data.regenerate import prompt_ids
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "hi"))
    runs = [speculative_decode(model, DFlashDrafter(drafter), ids, 20, (), Sampling(0.8),
                               torch.Generator().manual_seed(3)).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20


def test_mask_token_choice(tiny):
    model, tok = tiny
    assert choose_mask_token(tok, 512) == tok.convert_tokens_to_ids("<|mask|>")
    assert choose_mask_token(tok, 512, configured=77) == 77
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        choose_mask_token(tok, 512, configured=512)

    class Bare:  # ChatML specials only, all in use: no spare token
        mask_token_id, chat_template = None, "<|im_start|>{{ m }}<|im_end|>"
        bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 0, None
        added_tokens_decoder = {0: type("T", (), {"content": "<|endoftext|>"}),
                                1: type("T", (), {"content": "<|im_start|>"}),
                                2: type("T", (), {"content": "<|im_end|>"})}
    with pytest.raises(ValueError, match="set dflash.mask_token_id"):
        choose_mask_token(Bare(), 512)
    Bare.added_tokens_decoder = {**Bare.added_tokens_decoder, 7: type("T", (), {"content": "<repo_name>"}),
                                 9: type("T", (), {"content": "<filename>"})}
    assert choose_mask_token(Bare(), 512) == 9  # SmolLM2's rule: the highest spare special token


def test_export_round_trip_and_server_fields(tiny, drafter, tmp_path):
    model, _ = tiny
    out = export_dflash(drafter, tmp_path / "dflash")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 6 and config["num_target_layers"] == 4 and config["num_hidden_layers"] == 2
    assert config["dflash_config"] == {"mask_token_id": drafter.mask_token_id, "target_layer_ids": LAYERS}
    assert config["vocab_size"] == 512 and config["head_dim"] == 16 and config["rope_theta"] > 0
    from safetensors.torch import load_file
    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(expected_shapes(drafter.config))
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    loaded = load_dflash(out, model)
    ids, attention, _, features = _batch(model)
    anchors = torch.tensor([[10, 20], [9, 12]])
    with torch.no_grad():
        expected = drafter(features, ids, attention, anchors)
        torch.testing.assert_close(loaded(features, ids, attention, anchors), expected)


def test_export_loader_refuses_bad_files_and_other_targets(tiny, drafter, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    model, _ = tiny
    out = export_dflash(drafter, tmp_path / "dflash")
    tensors = load_file(str(out / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((out / "config.json").read_text())
    save_file({**tensors, "fc.weight": tensors["fc.weight"][:, :-1].contiguous()}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight.*shape"):
        load_dflash(bad, model)
    save_file({("model." + k): v for k, v in tensors.items()}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors"):
        load_dflash(bad, model)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="another target.*num_hidden_layers"):
        load_dflash(out, other)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_dflash(tmp_path / "nowhere", model)


@pytest.mark.filterwarnings("ignore::UserWarning")  # flex_attention warns when it runs uncompiled
def test_flex_attention_mask_trains_the_same_blocks_as_the_dense_mask(tiny, drafter):
    """GPUs train with a block-sparse flex_attention mask; here flex runs eagerly and must match SDPA."""
    model, _ = tiny
    ids, attention, _, features = _batch(model)
    anchors = torch.tensor([[11, 19, 23], [-1, 8, 14]])
    flex = copy.deepcopy(drafter)
    flex.attention = "flex"
    drafter.attention = "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(flex(features, ids, attention, anchors), drafter(features, ids, attention, anchors),
                                   atol=1e-5, rtol=1e-4)


def test_the_drafter_is_built_as_vllm_builds_it_for_any_target(cache_dir):
    """Qwen3 layers (q_norm/k_norm) whatever the target's family, and the target's raw embedding table: vLLM
    shares the target's embed_tokens module, and Gemma scales its embeddings outside it (vLLM gemma3.py)."""
    from draftheads.models.target import TargetSpec, load_target
    model, tok, _ = load_target(TargetSpec(name_or_path="tiny://gemma3"), cache_dir)
    drafter = DFlashDraftModel.for_target(model, 1, 4, [1, 3], tok.mask_token_id)
    assert type(drafter.layers[0]).__name__ == "Qwen3DecoderLayer" and drafter.config.model_type == "qwen3"
    ids = torch.tensor([[5, 6, 7]])
    table = model.get_input_embeddings().weight
    assert drafter.frozen[0] is table
    torch.testing.assert_close(model.get_input_embeddings()(ids), table[ids] * model.config.hidden_size ** 0.5)


@pytest.mark.parametrize("online", [False, True])
def test_a_packed_batch_trains_what_its_rows_padded_train(tiny, drafter, online):
    """Rows packed back to back: the target's features from the packed sequence (online) equal the padded rows',
    and the drafter reads the rows one per line, so its anchors, loss, metrics and gradients are the padded
    batch's."""
    model, _ = tiny
    rows = feature_rows(model, (28, 19, 23), None if online else LAYERS)
    assert_packed_trains_as_padded(DFlashTraining(drafter, model, 4, B8, online), rows)


def test_online_features_train_like_computed_ones(tiny):
    """The online mode (target forward per batch) computes the same loss as cached features."""
    from draftheads.data.batching import collate
    from draftheads.data.hidden_states import attach_hidden_states
    model, tok = tiny
    rows = [{"input_ids": torch.randint(4, 500, (n,)), "loss_mask": torch.arange(n) >= 5} for n in (20, 26)]
    torch.manual_seed(0)
    drafter = DFlashDraftModel.for_target(model, 1, 6, [1, 3], 3)
    computed, online = (DFlashTraining(drafter, model, 8, B8, online=o) for o in (False, True))
    attach_hidden_states(model, rows, 2, tok.pad_token_id, False, layer_ids=[1, 3])
    batch = collate(rows, tok.pad_token_id)
    losses = []
    for strategy, b in ((computed, batch), (online, {k: v for k, v in batch.items() if k != "target_features"})):
        torch.manual_seed(1)  # the same anchors
        losses.append(strategy.forward_loss(strategy.module, b)[0])
    torch.testing.assert_close(losses[0], losses[1])
    assert "target_features" in computed.required_fields and "target_features" not in online.required_fields
