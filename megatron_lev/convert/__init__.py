"""Checkpoints across layouts: merge/split tensor- and pipeline-parallel shards, export to and
import from Hugging Face Llama, and reshard for a new layout.

    source.open_checkpoint / iter_canonical   a checkpoint of any layout as full, canonically named tensors
    hf_export.export_to_hf                    -> validated LlamaForCausalLM directory (`megatron-lev convert`)
    hf_import.import_hf_llama                 HF Llama -> GPTModel (tied / untied)
    reshard.reshard                           -> checkpoint for another TP / PP / DP (`megatron-lev reshard`)

Guide: docs/convert.md. The offline lm-eval task files are written by `megatron_lev.data.lm_eval_tasks`.
"""
