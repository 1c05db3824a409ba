"""Convert a training checkpoint to a Hugging Face model directory (same as `megatron-lev convert`)."""

import sys

from megatron_lev.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
