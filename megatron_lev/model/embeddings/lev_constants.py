"""The numerics of LEV's separable product, shared by the reference path (lev.py) and the fused
kernels (cpu_kernel.py, triton_kernel.py; csrc/lev_cpu.c repeats them as #defines and cpu_kernel
checks GROUP against the built library). A leaf module: it imports nothing, so the kernels do not
import lev.py, which imports them."""

LOG_EPS = 1e-9  # log(|phi| + eps): keeps a zero factor finite
GROUP = 16  # factors multiplied directly before one log is taken
SAFE_FACTOR = 1e-3  # below this |phi|, log|phi| and log(|phi| + 1e-9) differ by > 1e-6: per-factor path
SAFE_RANGE = (1e-30, 1e30)  # a group product outside this (or not finite) is recomputed per factor
