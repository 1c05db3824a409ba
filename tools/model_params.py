"""Print every embedding variant's parameter count at every model size (same as `megatron-lev params`)."""

import sys

from megatron_lev.cli import main

if __name__ == "__main__":
    sys.exit(main(["params", *sys.argv[1:]]))
