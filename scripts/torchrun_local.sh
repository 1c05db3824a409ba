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
# through when no rank reported another failure, any other status every rank reported
# alike (3: stopped at the skip limit), else the status of a rank whose error a restart cannot
# cure (2: a config error on one rank, whose siblings torchrun then stopped). A rank that wrote no status was killed (out
# of memory, a crash): unless this script forwarded a preemption signal, that is a failure,
# even if torchrun then stopped the other ranks while they were starting up (they report 75).
#
# Restart after a failure: a run that failed for a reason a restart can cure (a rank killed or
# crashed, a peer lost) is started again, and resumes from its last checkpoint (pass train.save),
# after RESTART_DELAY seconds (10), at most MAX_FAILURES times (3; 0: never) within FAILURE_WINDOW
# seconds (3600). A config, data or checkpoint error, a stop by the run's own health checks, a
# preemption or a signal to this script ends it at once (the rules of slurm/pretrain.sbatch).
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

# shellcheck source=slurm/lib.sh
source "$root/slurm/lib.sh"  # mlev_fatal_status, mlev_failure_kind, mlev_count_failure: the Slurm script's rules
max_failures=${MAX_FAILURES:-3} failure_window=${FAILURE_WINDOW:-3600} restart_delay=${RESTART_DELAY:-10}
for value in "$max_failures" "$failure_window" "$restart_delay"; do
    [[ $value =~ ^[0-9]+$ ]] || { echo "[torchrun_local] error: MAX_FAILURES, FAILURE_WINDOW and RESTART_DELAY take whole numbers (got '$value')" >&2; exit 2; }
done
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
trap 'rm -rf "$exit_dir"; if [ "$status" = 0 ] && [ "$keep_logs" = 0 ]; then rm -rf "$log_dir"; else rmdir "$log_dir"/* "$log_dir" 2>/dev/null || true; fi' EXIT
# torchrun forwards these to the ranks (SIGUSR1 is not among its defaults)
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
# ranks get this long to finish the step and save after a signal before torchrun kills them
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-300}
signalled=0  # a signal came to this script: forwarded; a preemption is a reason to requeue, never to restart
stopped=0    # any signal at all (Ctrl-C included): no restart after it

# launch ATTEMPT: torchrun once (logs under $log_dir/attemptN), then `status`, the run's exit status
launch() {
    local attempt=$1 reports=$exit_dir/attempt$1 pid sig f code kind preempted=0 other=0 missing=0 reported fatal
    shift
    mkdir -p "$reports" "$log_dir/attempt$attempt"
    export MEGATRON_LEV_EXIT_DIR=$reports
    # torchrun itself, with a report naming each failed rank, its exit status or signal and the end of its log
    ( trap - INT QUIT; exec "$python" -m megatron_lev.parallel.torchrun --report-name torchrun_local \
        --standalone --nproc_per_node "$NPROC" --log-dir "$log_dir/attempt$attempt" --redirects 3 --tee 3 \
        "${entry[@]}" "$@" ) &
    pid=$!
    for sig in TERM USR1; do
        trap "signalled=1; stopped=1; kill -$sig $pid 2>/dev/null || true" "$sig"
    done
    for sig in INT HUP QUIT; do
        trap "stopped=1; kill -$sig $pid 2>/dev/null || true" "$sig"
    done
    while :; do
        status=0
        wait "$pid" || status=$?
        kill -0 "$pid" 2>/dev/null || break  # else a trapped signal interrupted the wait
    done
    status=0
    wait "$pid" || status=$?  # the child's own status, also when a signal interrupted the last wait
    [ "$status" -ne 0 ] || return 0

    for f in "$reports"/rank*; do
        [ -e "$f" ] || continue
        code=''
        read -r code kind <"$f" || true
        case $code in
            75) preempted=1 ;;
            0) ;;
            *) other=1 ;;
        esac
    done
    case $NPROC in
        '' | *[!0-9]*) ;;  # e.g. "auto": the number of ranks is torchrun's to know
        *) for ((r = 0; r < NPROC; r++)); do [ -e "$reports/rank$r" ] || missing=1; done ;;
    esac
    if [ "$signalled" = 0 ] && [ "$missing" = 1 ]; then
        other=1  # a rank died without a word and nobody asked the job to stop: a crash, not a preemption
    fi
    if [ "$signalled" = 1 ] && [ "$preempted" = 0 ] && [ "$other" = 0 ]; then
        preempted=1  # torchrun was stopped before any rank reported (still starting up)
    fi
    fatal=$(mlev_fatal_status "$reports" "")
    reported=$(for f in "$reports"/rank*; do [ -e "$f" ] && read -r code _ <"$f" && echo "$code"; done |
        sort -u | grep -vx 0 || true)
    if [ "$preempted" = 1 ] && [ "$other" = 0 ]; then
        echo "[torchrun_local] preempted: exiting with status 75 (requeue)" >&2
        status=75
    elif [ "$missing" = 0 ] && [ "$preempted" = 0 ] && [ -n "$reported" ] &&
        [ "$(printf '%s\n' "$reported" | wc -l)" = 1 ]; then
        # every rank reported, one and the same failure (3: the skip limit; 2: a config error):
        # that status, not torchrun's 1, so a wrapper or a scheduler can tell them apart
        echo "[torchrun_local] every rank exited with status $reported" >&2
        status=$reported
    elif [ -n "$fatal" ]; then
        # an error a restart cannot cure on one rank (a config error; the siblings torchrun then
        # stopped report 75): its status, not torchrun's 1, and never a requeue
        echo "[torchrun_local] a rank exited with status $fatal, an error a restart cannot cure" >&2
        status=$fatal
    fi
}

attempt=0
while :; do
    launch "$attempt" "$@"
    if [ "$status" = 0 ] || [ "$status" = 75 ] || [ "$stopped" = 1 ] || [ "$max_failures" = 0 ]; then
        break  # done, preempted, stopped by a signal, or restarts switched off (nothing more to say)
    fi
    kind=$(mlev_failure_kind "$exit_dir/attempt$attempt" "$status")
    if [ "$kind" = fatal ]; then
        echo "[torchrun_local] not restarting: status $status is an error a restart cannot cure" \
            "(a config, data or checkpoint error, or the run's own health checks)" >&2
        break
    fi
    count=$(mlev_count_failure "$exit_dir/failures" "$failure_window" "status $status")
    if [ "$count" -gt "$max_failures" ]; then
        echo "[torchrun_local] not restarting after status $status: failure $count within ${failure_window} s" \
            "(MAX_FAILURES=$max_failures, FAILURE_WINDOW=$failure_window)" >&2
        break
    fi
    attempt=$((attempt + 1))
    echo "[torchrun_local] restart after a failure ($count of $max_failures within ${failure_window} s):" \
        "status $status; starting attempt $attempt in $restart_delay s from the last checkpoint" >&2
    sleep "$restart_delay" &
    wait $! || true  # a signal interrupts the delay: its trap ran, and no attempt starts after it
    if [ "$stopped" = 1 ]; then
        [ "$signalled" = 0 ] || status=75  # preempted between attempts: requeue
        break
    fi
done
exit "$status"
