import sys

from megatron_lev.cli import main

sys.exit(main())
