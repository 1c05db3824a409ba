#!/usr/bin/env bash
# The training entry point on one machine without Slurm: torchrun, one process per GPU.
#
#   scripts/torchrun_local.sh --config pretrain/configs/tiny.yaml data.data_path=[data/x_text_document] \
#       data.tokenizer_path=tok.json train.save=ckpt/tiny
#   NPROC=2 scripts/torchrun_local.sh --config ...      # two CPU processes (gloo) on a machine without GPUs
#
# NPROC defaults to the number of visible GPUs (1 without GPUs). torchrun picks a free
# rendezvous port (--standalone), so several runs can share a machine. Like the Slurm
# script it uses MEGATRON_LEV_PYTHON, else .venv/bin/python, else python; ENTRY replaces
# "-m megatron_lev train". Started again with the same train.save, a run resumes from
# its latest checkpoint.
#
# Exit status: the trainer's. A preempted run (SIGTERM or SIGUSR1, to this script or to the
# ranks) exits 75 so a scheduler can requeue it; torchrun itself reports any failed rank as
# 1, so each rank writes its status into $MEGATRON_LEV_EXIT_DIR and this script passes a 75
# through when no rank reported another failure, and any other status every rank reported
# alike (3: stopped at the skip limit). A rank that wrote no status was killed (out
# of memory, a crash): unless this script forwarded a preemption signal, that is a failure,
# even if torchrun then stopped the other ranks while they were starting up (they report 75).
#
# Logs: each rank's stdout and stderr go to its own file under LOG_DIR (default: a temporary
# directory, deleted when the run succeeds) and to the console, each line prefixed with its
# rank ("[default1]:"). When a rank fails, the last lines printed name it, its exit status or
# signal, and quote the end of its log ("[torchrun_local] rank 1 (pid 4242) was killed by SIGKILL").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${MEGATRON_LEV_PYTHON:-}" ]; then
    python=$MEGATRON_LEV_PYTHON
elif [ -x "$root/.venv/bin/python" ]; then
    python=$root/.venv/bin/python
else
    python=python
fi
trap 'exit 75' TERM USR1  # preempted before anything started: requeue
[ $# -gt 0 ] || { echo "usage: $0 --config FILE [section.key=value ...]" >&2; exit 2; }
if [ -z "${NPROC:-}" ]; then
    NPROC=$("$python" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
read -ra entry <<<"${ENTRY:--m megatron_lev train}"
echo "[torchrun_local] $NPROC process(es), python $python"

exit_dir=$(mktemp -d "${TMPDIR:-/tmp}/torchrun_local.XXXXXX")
if [ -n "${LOG_DIR:-}" ]; then
    mkdir -p "$LOG_DIR"
    log_dir=$(mktemp -d "$LOG_DIR/torchrun_local.XXXXXX")
    keep_logs=1
else
    log_dir=$(mktemp -d "${TMPDIR:-/tmp}/torchrun_local-logs.XXXXXX")
    keep_logs=0
fi
status=1
# the ranks' exit statuses always go; their logs stay when the run failed or LOG_DIR asked for them
trap 'rm -rf "$exit_dir"; if [ "$status" = 0 ] && [ "$keep_logs" = 0 ]; then rm -rf "$log_dir"; else rmdir "$log_dir" 2>/dev/null || true; fi' EXIT
export MEGATRON_LEV_EXIT_DIR=$exit_dir
# torchrun forwards these to the ranks (SIGUSR1 is not among its defaults)
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
# ranks get this long to finish the step and save after a signal before torchrun kills them
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-300}
# torchrun itself, with a report naming each failed rank, its exit status or signal and the end of its log
( trap - INT QUIT; exec "$python" -m megatron_lev.parallel.torchrun --report-name torchrun_local \
    --standalone --nproc_per_node "$NPROC" --log-dir "$log_dir" --redirects 3 --tee 3 \
    "${entry[@]}" "$@" ) &
pid=$!
signalled=0  # a preemption signal came to this script: forwarded, and a reason to requeue
for sig in TERM USR1; do
    trap "signalled=1; kill -$sig $pid 2>/dev/null || true" "$sig"
done
for sig in INT HUP QUIT; do
    trap "kill -$sig $pid 2>/dev/null || true" "$sig"
done
status=0
while :; do
    status=0
    wait "$pid" || status=$?
    kill -0 "$pid" 2>/dev/null || break  # else a trapped signal interrupted the wait
done
status=0
wait "$pid" || status=$?  # the child's own status, also when a signal interrupted the last wait

if [ "$status" -ne 0 ]; then
    preempted=0 other=0 missing=0
    for f in "$exit_dir"/rank*; do
        [ -e "$f" ] || continue
        case $(cat "$f") in
            75) preempted=1 ;;
            0) ;;
            *) other=1 ;;
        esac
    done
    case $NPROC in
        '' | *[!0-9]*) ;;  # e.g. "auto": the number of ranks is torchrun's to know
        *) for ((r = 0; r < NPROC; r++)); do [ -e "$exit_dir/rank$r" ] || missing=1; done ;;
    esac
    if [ "$signalled" = 0 ] && [ "$missing" = 1 ]; then
        other=1  # a rank died without a word and nobody asked the job to stop: a crash, not a preemption
    fi
    if [ "$signalled" = 1 ] && [ "$preempted" = 0 ] && [ "$other" = 0 ]; then
        preempted=1  # torchrun was stopped before any rank reported (still starting up)
    fi
    if [ "$preempted" = 1 ] && [ "$other" = 0 ]; then
        echo "[torchrun_local] preempted: exiting with status 75 (requeue)" >&2
        status=75
    elif [ "$missing" = 0 ] && [ "$preempted" = 0 ]; then
        # every rank reported, one and the same failure (3: the skip limit; 2: a config error):
        # that status, not torchrun's 1, so a wrapper or a scheduler can tell them apart
        reported=$(cat "$exit_dir"/rank* 2>/dev/null | sort -u | grep -vx 0 || true)
        if [ -n "$reported" ] && [ "$(printf '%s\n' "$reported" | wc -l)" = 1 ]; then
            echo "[torchrun_local] every rank exited with status $reported" >&2
            status=$reported
        fi
    fi
fi
exit "$status"
