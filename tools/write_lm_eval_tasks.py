"""Write offline lm-eval task YAMLs (same as `megatron-lev lm-eval-tasks`)."""

import sys

from megatron_lev.cli import main

if __name__ == "__main__":
    sys.exit(main(["lm-eval-tasks", *sys.argv[1:]]))
