"""Subcommand modules of the `megatron-lev` command line (see megatron_lev/cli.py)."""
