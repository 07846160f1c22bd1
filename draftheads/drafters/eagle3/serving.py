"""EAGLE-3's rows of the serving matrix (``docs/serving.md``): which server loads ``export/eagle3``, plain and
with EAGLE-3.1's flags, each cell with the line of that server's source read at the versions
:data:`~draftheads.serving.matrix.SERVERS` names."""

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

FLAGS = "EAGLE-3.1 flags"
"""The variant of an export with ``eagle3.fc_norm`` or ``eagle3.norm_output`` on (``norm_before_fc``, on by default
and read by every server, is the plain export's row)."""
RESIDUAL = "norm_before_residual"
"""The variant of an export with ``eagle3.norm_before_residual`` on (with or without EAGLE-3.1's flags)."""
SPEC = "'{\"method\": \"eagle3\", \"model\": \"$export\", \"num_speculative_tokens\": $n}'"
VLLM_CPU = f"python -m vllm.entrypoints.openai.api_server --model $target --speculative-config {SPEC}"
VLLM_GPU = f"vllm serve $target --speculative-config {SPEC}"
SGLANG = ("python -m sglang.launch_server --model-path $target --speculative-algorithm EAGLE3 "
          "--speculative-draft-model-path $export --speculative-num-steps $n --speculative-eagle-topk 1 "
          "--speculative-num-draft-tokens $n1")
NO_GEMMA3 = "not for a Gemma 3 target (docs/eagle3.md)"
GEMMA3_TRANSFORMERS = ("a Gemma 3 target only through vLLM's Transformers backend (`--model-impl transformers`: "
                       "its own class lacks `SupportsEagle3`; parity verified here: docs/eagle3.md)")
LAYERS = ("reads `eagle_aux_hidden_state_layer_ids` one layer later than vLLM (`srt/models/llama.py:939-941`): an "
          "export of other than the default layers is served on other features")
LLAMACPP_UNREAD = {
    "fc_norm": ("fc_norm: llama.cpp has no per-feature norm (`src/models/eagle3.cpp:131-137`: the features enter `fc` "
                "after `norm_before_fc`'s norm alone; `conversion/llama.py:233-253` maps no `fc_norm` tensor)"),
    "norm_output": ("norm_output: llama.cpp feeds each draft step the state before the final norm "
                    "(`src/models/eagle3.cpp:279-288`: `t_h_nextn` is set before `output_norm`)"),
}
"""EAGLE-3's settings that llama.cpp b11434 does not read, with the lines that show it (``norm_before_fc`` and
``norm_before_residual`` it reads: ``src/models/eagle3.cpp:26``, :33)."""
LLAMACPP_READS = ("`conversion/llama.py:49-105` (the draft found by `draft_vocab_size` and one layer; "
                  "`eagle_aux_hidden_state_layer_ids` or the default `[2, L/2, L-3]`, the input of decoder layer i as "
                  "vLLM reads it: `common/speculative.cpp:600-606`), `src/models/eagle3.cpp:3-35`")

NO_TGI = Cell(False, "`server/text_generation_server/models/__init__.py:521-575` (speculators: Medusa and "
                     "MLPSpeculator only; no EAGLE anywhere in `server/`)")

EXPORT = Served("export/eagle3", "eagle3", {
    VLLM_032.key: Cell(True, "`vllm/config/speculative.py:70-71` (\"eagle3\" in `EagleModelTypes`), "
                             "`model_executor/models/registry.py:662` (`LlamaForCausalLMEagle3` -> `llama_eagle3`), "
                             "`model_executor/models/llama_eagle3.py:184-188` (`norm_before_fc`)",
                       VLLM_CPU, f"parity with draftheads verified here: docs/serving.md; {GEMMA3_TRANSFORMERS}"),
    VLLM_033.key: Cell(True, "`vllm/config/speculative.py:71-72`, `model_executor/models/registry.py:702` "
                             "(`LlamaForCausalLMEagle3`); `llama_eagle3.py` identical to 0.32's (diffed)",
                       VLLM_GPU, NO_GEMMA3),
    SGLANG_0523.key: Cell(True, "`srt/speculative/spec_info.py:43` (`EAGLE3`), `srt/models/llama_eagle3.py:272` "
                                "(`LlamaForCausalLMEagle3`, `EntryClass` :387), :173-174 (`norm_before_fc`)", SGLANG,
                          LAYERS),
    TGI_337.key: NO_TGI,
    LLAMACPP.key: Cell(True, LLAMACPP_READS + ", :33 and :131 (`norm_before_fc`)", llamacpp_command("draft-eagle3"),
                       "parity with draftheads verified here: docs/serving.md; an export of other than the default "
                       "layers is refused for it: its converter reads `eagle_aux_hidden_state_layer_ids` at the top "
                       "of `config.json` (`conversion/llama.py:77`), where the export writes them as vLLM reads them"),
})

EAGLE31 = Served("export/eagle3", "eagle3", {
    VLLM_032.key: Cell(True, "`model_executor/models/llama_eagle3.py:184-188` (`norm_before_fc`), :231 (`fc_norm`), "
                             ":252 (`norm_output`), applied at :405-418 (`input_norm.` weights dropped without "
                             "the flag, :464)",
                       VLLM_CPU, "parity with draftheads verified here with all three flags: "
                                 "tests/serving/test_vllm_parity.py"),
    VLLM_033.key: Cell(True, "`model_executor/models/llama_eagle3.py:184-188`, :231, :252 (identical to 0.32's, "
                             "diffed)", VLLM_GPU, NO_GEMMA3),
    SGLANG_0523.key: Cell(True, "`srt/models/llama_eagle3.py:173-174` (`norm_before_fc`, from `eagle_config` first), "
                                ":185 (`fc_norm`), :207 (`norm_output`), applied at :239-246 and :268, weights loaded "
                                "as `model.<name>` (:372)", SGLANG,
                          "read, not run; " + LAYERS),
    TGI_337.key: NO_TGI,
    LLAMACPP.key: Cell(False, "; ".join(LLAMACPP_UNREAD.values()),
                       note="`train/export.py RUN llamacpp=DIR` refuses such an export, naming the setting"),
}, variant=FLAGS)

NORM_BEFORE_RESIDUAL = Served("export/eagle3", "eagle3", {
    VLLM_032.key: Cell(True, "`model_executor/models/llama_eagle3.py:101-122` (`norm_before_residual`: the residual "
                             "taken after `hidden_norm`)", VLLM_CPU,
                       "its engine reports the key read as written (tests/serving/test_preflight.py) and parity "
                       "with draftheads holds with it on (tests/serving/test_vllm_parity.py)"),
    VLLM_033.key: Cell(True, "`model_executor/models/llama_eagle3.py:101-122` (identical to 0.32's, diffed)",
                       VLLM_GPU, NO_GEMMA3),
    SGLANG_0523.key: Cell(False, "`srt/models/llama_eagle3.py:98-100` takes the residual before `hidden_norm` "
                                 "always and reads no `norm_before_residual`: it would load the export and serve "
                                 "another drafter"),
    TGI_337.key: NO_TGI,
    LLAMACPP.key: Cell(True, "`src/models/eagle3.cpp:26` (`norm_before_residual`), :217 (the residual taken after "
                             "`hidden_norm`); " + LLAMACPP_READS, llamacpp_command("draft-eagle3"),
                       "not with `fc_norm` or `norm_output` also on (the EAGLE-3.1 row)"),
}, variant=RESIDUAL)

SERVING = (EXPORT, EAGLE31, NORM_BEFORE_RESIDUAL)
