"""Medusa tree verification (Medusa paper, arXiv 2401.10774, section 2.1.2 "Tree Attention" and 2.3.1
"Typical Acceptance"): candidates from the top-k of each draft position are arranged in a sparse tree and
the target verifies the whole tree in one forward pass with a tree attention mask; the KV cache then keeps
only the accepted path.

A tree is given by ``medusa_choices``: a list of paths of top-k indices, e.g. ``(0,)`` = head 1's top-1,
``(0, 2)`` = head 2's top-3 following head 1's top-1 (the same format as Medusa's ``medusa_choices.py``).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from draftheads.models.decoding import cut_at_stop
from draftheads.models.speculative import ChainDrafter, DecodeResult, new_cache, target_step, with_cache


@dataclass(frozen=True)
class Tree:
    """A candidate tree: node 0 is the root (the last emitted token), nodes 1..N the ``paths`` in order.

    Attributes:
        paths: the node paths, sorted by depth then index (parents always precede children).
        parent: ``[N + 1]`` index of each node's parent (-1 for the root).
        depth: ``[N + 1]`` depth (root 0); node i proposes a token for draft position ``depth - 1``.
        rank: ``[N + 1]`` which top-k candidate of its position node i takes (root -1).
    """
    paths: tuple[tuple[int, ...], ...]
    parent: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices, num_positions: int) -> "Tree":
        """Build a tree from ``medusa_choices``.

        Raises ``ValueError`` when a path is deeper than the drafter has positions (heads), when a path's
        prefix is missing, or for an empty or negative path.
        """
        paths = sorted({tuple(int(i) for i in c) for c in choices}, key=lambda p: (len(p), p))
        index = {(): 0}
        parent, depth, rank = [-1], [0], [-1]
        for p in paths:
            if not p or min(p) < 0:
                raise ValueError(f"medusa_choices: path {list(p)} must be non-empty with indices >= 0")
            if len(p) > num_positions:
                raise ValueError(f"medusa_choices: path {list(p)} has depth {len(p)} but the drafter proposes only "
                                 f"{num_positions} positions (heads); use paths of at most {num_positions} steps")
            if p[:-1] not in index:
                raise ValueError(f"medusa_choices: path {list(p)} has no parent {list(p[:-1])} in the tree")
            index[p] = len(parent)
            parent.append(index[p[:-1]])
            depth.append(len(p))
            rank.append(p[-1])
        return cls(tuple(paths), tuple(parent), tuple(depth), tuple(rank))

    @property
    def max_rank(self) -> int:
        return max(self.rank) + 1 if len(self.rank) > 1 else 1

    @property
    def internal(self) -> tuple[int, ...]:
        """The nodes that some node follows (root included), in order: only their target logits decide which
        candidates are accepted."""
        return tuple(sorted(set(self.parent[1:]))) or (0,)

    def attention(self) -> torch.Tensor:
        """``[N + 1, N + 1]`` bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self.parent)
        allow = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                allow[i, j] = True
                j = self.parent[j]
        return allow


def default_choices(topk_accuracy: list[list[float]], budget: int = 64) -> list[tuple[int, ...]]:
    """A tree grown greedily for the largest expected acceptance length (as Medusa's tree search does).

    Args:
        topk_accuracy: ``[K][k]``: the measured probability that draft position k's rank-r candidate is the
            target's token (given the earlier positions accepted).
        budget: number of nodes.
    The expected number of accepted tokens is the sum over nodes of the product of accuracies along their
    path; each step adds the child with the largest such product.
    """
    chosen: list[tuple[int, ...]] = []
    value = {(): 1.0}
    frontier = {(r,): topk_accuracy[0][r] for r in range(len(topk_accuracy[0]))}
    while frontier and len(chosen) < budget:
        best = max(frontier, key=lambda p: (frontier[p], [-i for i in p]))
        value[best] = frontier.pop(best)
        chosen.append(best)
        if len(best) < len(topk_accuracy):
            accs = topk_accuracy[len(best)]
            frontier.update({best + (r,): value[best] * accs[r] for r in range(len(accs))})
    return chosen


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance (paper eq. 3) as its reference implements it (FasterDecoding/Medusa,
    ``medusa/model/utils.py: evaluate_posterior``): accept x if p(x) > min(epsilon, delta * exp(-H(p))), p at
    ``temperature``, the entropy smoothed as ``-sum p log(p + 1e-5)``; among the longest accepted paths, the one of
    highest likelihood (sum of log p of its tokens). Faster, not lossless: reports mark it so."""
    epsilon: float = 0.09
    delta: float = 0.3
    temperature: float = 0.7


def tree_attention_mask(config, allow: torch.Tensor, past: int, depth: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive attention mask of one tree forward: ``[1, 1, N + 1, past + N + 1]``, 0 where node i sees a
    key and ``-inf`` elsewhere; node i sees every cached token and its own ancestors (``allow``).

    A sliding-window target (``config.sliding_window``) sees keys at most ``window - 1`` positions back (position
    of node i = ``past + depth[i]``), as transformers' ``sliding_window_overlay`` has it: a custom mask replaces
    the model's own, so the window must be in it. Targets that mix layer types (``config.layer_types``: Gemma 2/3,
    Qwen2/3, gpt-oss) get a dict by layer type, which their forward takes as is; the others (Mistral, Phi-3) apply
    one mask to every layer.
    """
    config = config.get_text_config(decoder=True)
    device = allow.device
    visible = torch.cat([torch.ones(len(allow), past, dtype=torch.bool, device=device), allow], dim=1)

    def additive(keep: torch.Tensor) -> torch.Tensor:
        return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))[None, None]
    window = getattr(config, "sliding_window", None)
    windowed = visible
    if window:
        key_positions = torch.cat([torch.arange(past, device=device), past + depth])
        windowed = visible & ((past + depth)[:, None] - key_positions[None, :] < window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return {kind: additive(windowed if kind == "sliding_attention" else visible) for kind in set(layer_types)}
    return additive(windowed)


def tree_states(target: PreTrainedModel, tokens: torch.Tensor, cache: DynamicCache, allow: torch.Tensor,
                depth: torch.Tensor) -> torch.Tensor:
    """One tree verification: ``[N + 1]`` node tokens through ``target`` after the ``cache``'s tokens, each node at
    position ``past + depth`` seeing the cache and its ancestors (``allow``, :meth:`Tree.attention`) -> ``[N + 1, D]``
    last hidden states; every node enters the cache (:func:`_keep_path` keeps the accepted ones)."""
    past = cache.get_seq_length()
    mask = tree_attention_mask(target.config, allow, past, depth, target.dtype)
    return target.base_model(input_ids=tokens[None], attention_mask=mask, position_ids=(past + depth)[None],
                             use_cache=True, **with_cache(target, cache)).last_hidden_state[0]


def _keep_path(cache: DynamicCache, past: int, nodes: list[int]) -> None:
    """Drop every tree node from the cache but ``nodes`` (root and accepted path, in order)."""
    index = torch.tensor(nodes) + past
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :past, :],
                                layer.keys.index_select(-2, index.to(layer.keys.device))], -2)
        layer.values = torch.cat([layer.values[..., :past, :],
                                  layer.values.index_select(-2, index.to(layer.values.device))], -2)


def _accepted(tree: Tree, tokens: torch.Tensor, parent_logits: torch.Tensor,
              typical: TypicalAcceptance | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N + 1]`` bool: node i's token accepted given its parent's target distribution (``parent_logits``:
    ``[N, V]``, row i - 1 the target's logits at node i's parent; root: True), and ``[N + 1]`` float: each node's
    path log-likelihood under that acceptance's distribution (greedy: zeros)."""
    loglik = torch.zeros(len(tree.parent))
    if typical is None:
        ok = tokens[1:] == parent_logits.argmax(-1)
    else:
        p = (parent_logits.float() / typical.temperature).softmax(-1)
        entropy = -(p * (p + 1e-5).log()).sum(-1)
        threshold = torch.minimum(torch.full_like(entropy, typical.epsilon), typical.delta * (-entropy).exp())
        chosen = p.gather(-1, tokens[1:, None])[:, 0]
        ok = chosen > threshold
        loglik[1:] = chosen.log()
    accepted = torch.ones(len(tree.parent), dtype=torch.bool)
    for i in range(1, len(tree.parent)):  # a node counts only when its whole path does (parents come first)
        accepted[i] = ok[i - 1] and accepted[tree.parent[i]]
        loglik[i] += loglik[tree.parent[i]]
    return accepted, loglik


def _best(tree: Tree, accepted: torch.Tensor, loglik: torch.Tensor) -> int:
    """The node decoding continues from: the deepest accepted one; among equally deep ones the likeliest path
    (Medusa's ``evaluate_posterior``), then the first."""
    return max(range(len(tree.parent)), key=lambda i: (tree.depth[i] * bool(accepted[i]), float(loglik[i]), -i))


@torch.inference_mode()
def tree_decode(target: PreTrainedModel, drafter: ChainDrafter, tree: Tree, prompt_ids: torch.Tensor,
                max_new_tokens: int, stop: Collection[int], typical: TypicalAcceptance | None = None) -> DecodeResult:
    """Greedy (default) or typical-acceptance decoding with tree verification.

    Args:
        drafter: proposes ``[gamma, V]`` logits; gamma must be >= the tree depth.
        prompt_ids: ``[P]`` int64 on the target's device.
        stop: the target's stop set, as for :func:`~draftheads.models.speculative.plain_decode`.
    Returns:
        a :class:`DecodeResult`; with greedy acceptance ``tokens`` equal plain greedy decoding up to
        floating-point ties. ``accepted_per_step`` counts accepted tree nodes on the chosen path.
    Raises:
        ValueError: the tree is deeper than the drafter's gamma.
    """
    if drafter.target_layer_ids:
        raise ValueError(f"tree verification takes drafters of the last hidden state only (Medusa), not {drafter.name}")
    if max(tree.depth) > drafter.gamma:
        raise ValueError(f"the tree has depth {max(tree.depth)} but the drafter proposes {drafter.gamma} positions")
    lm_head = target.get_output_embeddings()
    device = prompt_ids.device
    depth = torch.tensor(tree.depth, device=device)
    allow = tree.attention().to(device)
    rows = torch.tensor(tree.depth[1:]) - 1
    ranks = torch.tensor(tree.rank[1:])
    # The LM head runs on the internal nodes only (16 of the default 65 with 4 heads): a leaf's logits matter only
    # when it ends the accepted path, for the bonus token
    internal = torch.tensor(tree.internal, device=device)
    row_of = {node: i for i, node in enumerate(tree.internal)}
    parent_rows = torch.tensor([row_of[p] for p in tree.parent[1:]], dtype=torch.long)
    start = time.perf_counter()
    cache = new_cache()
    hidden = target_step(target, prompt_ids, cache)[0][-1]
    x0 = int(lm_head(hidden).argmax())
    result = DecodeResult(tokens=[], target_forwards=1, gamma=max(tree.depth),
                          prefill_seconds=time.perf_counter() - start)
    result.tokens, done = cut_at_stop([x0], max_new_tokens, stop)
    while not done:
        t = time.perf_counter()
        top = (drafter.draft_logits(hidden, x0, None, None).float()
               .topk(tree.max_rank, dim=-1).indices.cpu())  # [gamma, k]
        tokens = torch.cat([torch.tensor([x0]), top[rows, ranks]])
        t_verify = time.perf_counter()
        result.draft_seconds += t_verify - t
        past = cache.get_seq_length()
        states = tree_states(target, tokens.to(device), cache, allow, depth)
        logits = lm_head(states[internal]).cpu()
        result.target_forwards += 1
        best = _best(tree, *_accepted(tree, tokens, logits[parent_rows], typical))
        path = []
        node = best
        while node > 0:
            path.append(node)
            node = tree.parent[node]
        path.reverse()
        _keep_path(cache, past, [0] + path)
        result.verify_seconds += time.perf_counter() - t_verify
        bonus = int((logits[row_of[best]] if best in row_of else lm_head(states[best]).cpu()).argmax())
        emitted = [int(tokens[i]) for i in path] + [bonus]
        before = len(result.tokens)
        result.tokens, done = cut_at_stop(result.tokens + emitted, max_new_tokens, stop)
        result.accepted_per_step.append(len(path))
        result.emitted_per_step.append(len(result.tokens) - before)
        result.context_per_step.append(len(prompt_ids) + before)
        hidden, x0 = states[best], bonus
    result.seconds = time.perf_counter() - start
    return result
