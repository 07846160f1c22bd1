"""DSpark's adaptive verification, as vLLM 0.32 runs it (``speculative_config: {"enable_adaptive_verification":
true}``, ``config/speculative.py:551-553``, off by default; ``v1/worker/gpu/spec_decode/adaptive_verification.py``).

vLLM's rule, read from its source:
- The confidence head's sigmoid ``c_k`` at each block position (``qwen3_dspark.py:305-310``, computed only with
  ``enable_adaptive_verification`` on: ``spec_decode/dspark/speculator.py:106-109``, :192-199) is the probability
  that draft k is accepted given the drafts before it were; its running product is the draft's survival
  probability ``s_k = c_1 * .. * c_k`` (``adaptive_verification.py:64``, :310).
- Each step it chooses a draft budget b, the number of drafts the target verifies over the batch, maximising the
  expected tokens per unit of step cost (:282-350): ``(R + sum of the b highest s) / (draft_cost(requests) +
  verify_cost(non-draft tokens + b))`` (:325-344; R requests that sample, the first b maximising it, ``np.argmax``),
  the costs from tables it times on its GPU at startup (:188-253), and admits the b slots of highest survival, a
  prefix of each request's drafts since survival falls along a block (:46-72, :411-426).
- The budget is read from the confidences a step behind (copied to the CPU asynchronously: :167-181, :262-270,
  :309), all ones at a request's first block (:183-186); which slots are kept, from the current ones (:420-426).

For one request (batch size 1, as draftheads' evaluator decodes) the slots admitted are the first b drafts and the
rule is: ``b = argmax over 0..gamma of (1 + s_1 + .. + s_b) / cost(b)``. The cost tables are the one thing not
copied: vLLM measures its own GPU at its batch, so here the step's cost is a linear model, ``cost(b) = 1 +
verify_token_cost * b`` (``dspark.verify_token_cost``; 0: flat, every draft verified). Verifying a prefix chosen
from the drafter's own confidences (never from the target's verdicts) keeps decoding lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftheads.drafters.dspark.model import DSparkDraftModel, DSparkDrafter


def verify_budget(survival: Sequence[float] | torch.Tensor, verify_token_cost: float) -> int:
    """vLLM's draft budget for one decoding request (``adaptive_verification.py:309-344`` at one request): the
    b in 0..len(survival) that maximises ``(1 + survival[0] + .. + survival[b-1]) / (1 + verify_token_cost * b)``,
    the smallest such b on a tie (``np.argmax``).

    Args:
        survival: ``[g]`` the drafts' survival probabilities (running products of the confidences, non-increasing).
        verify_token_cost: the cost of verifying one more draft, the step with none costing 1 (>= 0).
    Raises ``ValueError`` for a negative cost.
    """
    if verify_token_cost < 0:
        raise ValueError(f"verify_token_cost={verify_token_cost} must be >= 0")
    expected, best, best_ratio = 1.0, 0, 1.0
    for b, s in enumerate([float(x) for x in survival], start=1):
        expected += s
        ratio = expected / (1.0 + verify_token_cost * b)
        if ratio > best_ratio:
            best, best_ratio = b, ratio
    return best


class AdaptiveDSparkDrafter(DSparkDrafter):
    """The DSpark drafter with adaptive verification (the evaluator's ``dspark_adaptive`` method): it drafts as
    :class:`~draftheads.drafters.dspark.model.DSparkDrafter` does, then :meth:`verify` says how many of the
    block's drafts the target verifies (:func:`verify_budget` on the survival probabilities of the previous
    block's confidences, as vLLM, or the current block's).

    Raises ``ValueError`` for a drafter without a confidence head (nothing to rank by) or a negative cost.
    """

    def __init__(self, model: DSparkDraftModel, verify_token_cost: float, budget_from: str = "previous"):
        if model.confidence_head is None:
            raise ValueError("adaptive verification ranks drafts by the confidence head, and this DSpark drafter "
                             "has none (dspark.confidence_weight=0): set dspark.adaptive_verification=false")
        if verify_token_cost < 0:
            raise ValueError(f"dspark.verify_token_cost={verify_token_cost} must be >= 0")
        super().__init__(model)
        self.name = "dspark_adaptive"
        self.verify_token_cost, self.budget_from = verify_token_cost, str(budget_from)
        self._budget_confidences: torch.Tensor | None = None

    def start(self) -> None:
        """A new request: the previous block's confidences are all ones (vLLM's ``add_request``)."""
        super().start()
        self._budget_confidences = None

    def verify(self, g: int) -> int:
        """How many of the block's ``g`` drafts (a prefix) the target verifies: :func:`verify_budget` on the
        survival probabilities of the confidences ``budget_from`` names (the previous block's: all ones at the
        first); then the current block's are kept for the next step."""
        current = self.acceptance[:g].double().cpu()
        if self.budget_from == "current":
            confidences = current
        else:
            confidences = torch.ones(g, dtype=torch.float64) if self._budget_confidences is None \
                else self._budget_confidences[:g]
        self._budget_confidences = current
        return verify_budget(confidences.cumprod(0), self.verify_token_cost)
