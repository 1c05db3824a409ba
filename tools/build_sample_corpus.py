"""Thin entry point: same as `megatron-lev sample-corpus` (see megatron_lev/commands/sample_corpus.py)."""

import argparse
import sys

from megatron_lev.commands.sample_corpus import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
