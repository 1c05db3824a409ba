#!/usr/bin/env bash
# System packages the test suite needs beyond the Python environment: a real Slurm
# (controller, node daemon and client commands) for tests/slurm, and a C compiler for
# LEV's fused CPU kernel (tests/model). No munge: the test cluster uses
# AuthType=auth/none. Runs as root (CI); idempotent and quiet; a machine that already
# has the commands is left untouched.
set -euo pipefail
PACKAGES=()
missing=()
for cmd in slurmctld slurmd sbatch squeue scontrol scancel srun; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
[ ${#missing[@]} -eq 0 ] || PACKAGES+=(slurmctld slurmd slurm-client)
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    missing+=(cc)
    PACKAGES+=(gcc libc6-dev)
fi
if [ ${#missing[@]} -eq 0 ]; then
    echo "[system] slurm already installed ($(dpkg-query -W -f='${Version}' slurm-client 2>/dev/null || echo 'not from apt')), C compiler present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "[system] missing ${missing[*]}: run 'sudo .ci/install_system_packages.sh' to install ${PACKAGES[*]}; until then the tests that need them are reported as skipped" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
echo "[system] installing ${PACKAGES[*]} (missing: ${missing[*]})"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "[system] installing ${PACKAGES[*]} failed (apt output above)" >&2
    exit 1
fi
echo "[system] installed ${PACKAGES[*]}"
