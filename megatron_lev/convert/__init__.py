"""Checkpoints across layouts: merge/split tensor- and pipeline-parallel shards, export to and
import from Hugging Face Llama, reshard for a new layout, and offline lm-eval task files.

    source.open_checkpoint / iter_canonical   a checkpoint of any layout as full, canonically named tensors
    hf_export.export_to_hf                    -> validated LlamaForCausalLM directory (`megatron-lev convert`)
    hf_import.import_hf_llama                 HF Llama -> GPTModel (tied / untied)
    reshard.reshard                           -> checkpoint for another TP / PP / DP (`megatron-lev reshard`)
    lm_eval_tasks.write_lm_eval_tasks         offline task YAMLs (`megatron-lev lm-eval-tasks`)

Guide: docs/convert.md.
"""
