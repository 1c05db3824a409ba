"""The paper's experiment grid (six embedding variants x three sizes, for Slurm) and its CPU-scale version."""
