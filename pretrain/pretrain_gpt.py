"""Pretrain a GPT with the LEV input layer (same as `python -m megatron_lev train`).

    torchrun --nproc_per_node 2 pretrain/pretrain_gpt.py --config pretrain/configs/tiny.yaml \
        data.data_path=[data/minipile_text_document] data.tokenizer_path=gpt-neox-20b.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_lev.cli import entry  # noqa: E402

if __name__ == "__main__":
    entry(["train", *sys.argv[1:]])  # the clean multi-rank exit of `megatron-lev train`
