# shellcheck shell=bash
# Shared by the slurm/*.sbatch scripts (sourced, not run). Finds the repository and
# its Python, sets the process environment, derives the rendezvous address from the
# allocation, and runs a job step in the background so that signals reach it.
#
# Environment it reads (all optional):
#   MEGATRON_LEV_PYTHON   interpreter to use (default: <repo>/.venv/bin/python if present, else python)
#   LOG_DIR               per-run logs (default: logs, relative to the submit directory)
#   MASTER_PORT           rendezvous port (default: derived from the job id, see mlev_rendezvous)
#   OMP_NUM_THREADS, NCCL_*, TORCH_NCCL_*   respected when set; defaults below otherwise

# Exit status of a trainer that saved a checkpoint after SIGUSR1/SIGTERM and wants
# to be requeued (PREEMPTED_EXIT_CODE in megatron_lev/training/signals.py).
export MLEV_PREEMPTED_EXIT_CODE=75

mlev_log() { echo "[$(date -u +%H:%M:%S) ${SLURM_JOB_ID:-local}] $*"; }
mlev_die() { echo "[${SLURM_JOB_ID:-local}] error: $*" >&2; exit 1; }

# mlev_input_name PATH [VAR]: the file name of an input without its known extension
# (c4-train.00000-of-01024.json.gz -> c4-train.00000-of-01024; other dots are kept, so
# inputs that differ only after their first dot keep distinct names). Printed, or put in VAR.
MLEV_INPUT_EXTENSIONS=(.jsonl.zst .jsonl.gz .json.zst .json.gz .jsonl .json .parquet .arrow .zst .gz)
mlev_input_name() {
    local _mlev_name=${1%/} _mlev_ext  # not `name`: VAR may be called that
    _mlev_name=${_mlev_name##*/}
    for _mlev_ext in "${MLEV_INPUT_EXTENSIONS[@]}"; do
        if [ "${#_mlev_name}" -gt "${#_mlev_ext}" ] && [ "${_mlev_name%"$_mlev_ext"}" != "$_mlev_name" ]; then
            _mlev_name=${_mlev_name%"$_mlev_ext"}
            break
        fi
    done
    if [ $# -ge 2 ]; then printf -v "$2" '%s' "$_mlev_name"; else printf '%s\n' "$_mlev_name"; fi
}

# mlev_setup: repository root, Python and environment. Sets MLEV_ROOT, MLEV_PYTHON.
mlev_setup() {
    MLEV_ROOT=${MEGATRON_LEV_ROOT:?mlev_setup needs MEGATRON_LEV_ROOT}
    if [ -n "${MEGATRON_LEV_PYTHON:-}" ]; then
        MLEV_PYTHON=$MEGATRON_LEV_PYTHON
    elif [ -x "$MLEV_ROOT/.venv/bin/python" ]; then
        MLEV_PYTHON=$MLEV_ROOT/.venv/bin/python
    else
        MLEV_PYTHON=python
    fi
    command -v "$MLEV_PYTHON" >/dev/null || mlev_die "Python '$MLEV_PYTHON' not found (set MEGATRON_LEV_PYTHON)"
    export MEGATRON_LEV_PYTHON=$MLEV_PYTHON MEGATRON_LEV_ROOT=$MLEV_ROOT
    export PYTHONPATH=$MLEV_ROOT${PYTHONPATH:+:$PYTHONPATH}
    # One thread per rank unless asked otherwise (as torchrun does); more only slows CPU ranks down.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # A rank that dies makes the others fail fast instead of hanging in a collective.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export PYTHONUNBUFFERED=1
    # Some Slurm releases do not pass the job's --cpus-per-task on to srun (SRUN_CPUS_PER_TASK
    # is the documented way); without it a 32-worker preprocess step could get one core.
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
        export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}
    fi
    export MLEV_RESTART=${SLURM_RESTART_COUNT:-0}
    LOG_DIR=${LOG_DIR:-logs}
    mkdir -p "$LOG_DIR" || mlev_die "cannot create LOG_DIR=$LOG_DIR"
}

# mlev_rendezvous: MASTER_ADDR = address of the first node of the allocation (its
# NodeAddr in slurm.conf, so node names need not resolve), MASTER_PORT = 15000 plus
# a number derived from the job id, the requeue count and the restart within the job
# (MLEV_ATTEMPT), below the Linux ephemeral range.
mlev_rendezvous() {
    local first addr
    first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm allocation}" | head -n 1)
    addr=$(scontrol show node "$first" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
    export MASTER_ADDR=${MASTER_ADDR:-${addr:-$first}}
    # a port the user chose stays; a derived one moves with each restart within the job (MLEV_ATTEMPT)
    [ -n "${MLEV_PORT_GIVEN+x}" ] || MLEV_PORT_GIVEN=${MASTER_PORT:-}
    export MASTER_PORT=${MLEV_PORT_GIVEN:-$((15000 + (SLURM_JOB_ID + 997 * MLEV_RESTART + 389 * ${MLEV_ATTEMPT:-0}) % 17000))}
    mlev_log "rendezvous $MASTER_ADDR:$MASTER_PORT (first node $first), nodes ${SLURM_JOB_NODELIST}," \
        "${SLURM_NTASKS:-?} tasks, restart $MLEV_RESTART$([ "${MLEV_ATTEMPT:-0}" = 0 ] || echo ", attempt $MLEV_ATTEMPT")"
}

# mlev_signal_name WORDS: srun's words for how a task ended ("Killed", "Exited with exit code 3")
# as "was killed by SIGKILL" / "exited with status 3".
mlev_signal_name() {
    case $1 in
        Killed) echo "was killed by SIGKILL" ;;
        Terminated) echo "was killed by SIGTERM" ;;
        Aborted) echo "was killed by SIGABRT (an abort)" ;;
        "Segmentation fault") echo "was killed by SIGSEGV (a crash)" ;;
        "Bus error") echo "was killed by SIGBUS (a crash)" ;;
        Interrupt) echo "was killed by SIGINT" ;;
        "Exited with exit code "*) echo "exited with status ${1#Exited with exit code }" ;;
        *) echo "ended: $1" ;;
    esac
}

# The lines srun writes for the tasks it reports as failed ("srun: error: n1: task 1: Killed").
MLEV_SRUN_TASK_ERROR='^srun: error: [^ ]+: tasks? [0-9][0-9,-]*: '

# mlev_srun_error_parts LINE: such a line's node, tasks ("1", "0-3,5") and words, in MLEV_NODE,
# MLEV_TASKS and MLEV_WHAT.
mlev_srun_error_parts() {
    local rest=${1#srun: error: }
    MLEV_NODE=${rest%%: *}
    rest=${rest#*: }
    MLEV_TASKS=${rest%%: *}
    MLEV_WHAT=${rest#*: }
    MLEV_TASKS=${MLEV_TASKS#tasks }
    MLEV_TASKS=${MLEV_TASKS#task }
}

# mlev_report_failed_tasks LOG OFFSET: after a failed step whose output starts at byte OFFSET
# of LOG, name each task srun reported ("srun: error: n1: task 1: Killed") with its rank, node,
# exit status or signal, and the last lines of its output (srun --label prefixes them "1: ").
mlev_report_failed_tasks() {
    local log=$1 offset=$2 line node tasks what ranks parts part r
    local lines=${MLEV_TAIL_LINES:-10}
    [ -f "$log" ] || return 0
    tail -c +"$((offset + 1))" "$log" | grep -E "$MLEV_SRUN_TASK_ERROR" |
        while IFS= read -r line; do
            mlev_srun_error_parts "$line"
            node=$MLEV_NODE tasks=$MLEV_TASKS what=$MLEV_WHAT
            ranks=()
            IFS=, read -ra parts <<<"$tasks"
            for part in "${parts[@]}"; do
                if [[ $part == *-* ]]; then
                    for ((r = ${part%-*}; r <= ${part#*-}; r++)); do ranks+=("$r"); done
                else
                    ranks+=("$part")
                fi
            done
            for r in "${ranks[@]}"; do
                mlev_log "rank $r (node $node) $(mlev_signal_name "$what"); its last lines in $log:"
                tail -c +"$((offset + 1))" "$log" | grep -E "^ *$r: " | tail -n "$lines" | sed 's/^/    /'
            done
        done
}

# mlev_step LOG [SRUN_OPTION...] -- CMD...: run CMD with srun (by default one task per
# task of the allocation) in the background, forward USR1/TERM/INT from the batch shell
# to it, wait for it, return its exit status. All tasks' output goes to LOG, prefixed by rank.
# When the step fails, each task srun reports as failed is named with its exit status or
# signal and the last lines of its output (mlev_report_failed_tasks).
mlev_step() {
    local log=$1 pid rc sig late offset
    local srun_opts=()
    shift
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do srun_opts+=("$1"); shift; done
    [ "${1:-}" = "--" ] || mlev_die "mlev_step: missing '--' before the command"
    shift
    mlev_log "step: $* (log: $log)"
    offset=$(stat -c %s "$log" 2>/dev/null || echo 0)  # this step's output starts here
    # --wait: once a task exits, the others get this long (e.g. to finish a checkpoint) before being killed.
    srun --label --kill-on-bad-exit=0 --wait="${TASK_EXIT_GRACE:-120}" "${srun_opts[@]}" "$@" >>"$log" 2>&1 &
    pid=$!
    for sig in USR1 TERM INT; do
        # shellcheck disable=SC2064
        trap "mlev_log 'batch shell got SIG$sig, forwarding to the job step'; kill -s $sig $pid 2>/dev/null" "$sig"
    done
    rc=0
    while kill -0 "$pid" 2>/dev/null; do
        wait "$pid"
        rc=$?
    done
    # `wait` interrupted by a trap returns 128+signal; collect the real status if it is still pending.
    wait "$pid" 2>/dev/null
    late=$?
    [ "$late" -ne 127 ] && rc=$late
    trap - USR1 TERM INT
    mlev_log "step exited with status $rc"
    if [ "$rc" -ne 0 ]; then
        mlev_report_failed_tasks "$log" "$offset"
    fi
    return "$rc"
}

# ---- restart after a failure: what a restart can cure, and how often within a window ----

# mlev_fatal_status EXIT_DIR STATUS: the status of the first rank whose exit a restart cannot cure
# (a config, data or checkpoint error, or the run's own health checks stopping it), else nothing.
# Each rank writes "<status> <kind>" into EXIT_DIR as it exits (megatron_lev/training/signals.py:
# exit_kind); a rank killed outright writes nothing. A report without a kind, or no report at all
# (then STATUS, the step's), counts 2 (a usage or launch error) and 3 (the skip limit) as fatal.
mlev_fatal_status() {
    local dir=$1 status=$2 f code kind reported=0
    for f in "$dir"/rank*; do
        [ -e "$f" ] || continue
        reported=1
        code='' kind=''
        read -r code kind <"$f" || true
        if [ "$kind" = fatal ] || { [ -z "$kind" ] && { [ "$code" = 2 ] || [ "$code" = 3 ]; }; }; then
            echo "$code"
            return 0
        fi
    done
    if [ "$reported" = 0 ] && { [ "$status" = 2 ] || [ "$status" = 3 ]; }; then
        echo "$status"
    fi
}

# mlev_failure_kind EXIT_DIR STATUS: "fatal" when a rank's exit is one a restart cannot cure
# (mlev_fatal_status), else "crash".
mlev_failure_kind() {
    if [ -n "$(mlev_fatal_status "$1" "$2")" ]; then echo fatal; else echo crash; fi
}

# mlev_count_failure FILE WINDOW CAUSE...: append this failure (epoch seconds, then CAUSE) to FILE and
# print how many of the failures it lists happened within the last WINDOW seconds, this one included.
mlev_count_failure() {
    local file=$1 window=$2 now
    shift 2
    now=$(date +%s)
    printf '%s %s\n' "$now" "$*" >>"$file"
    awk -v since=$((now - window)) '$1 + 0 >= since { n++ } END { print n + 0 }' "$file"
}

# mlev_failure_cause LOG OFFSET STATUS: one line for the log of a restart: the first task srun
# reported as failed in the step's output (from byte OFFSET of LOG), else the step's status.
mlev_failure_cause() {
    local log=$1 offset=$2 status=$3 line
    line=$( (tail -c +"$((offset + 1))" "$log" 2>/dev/null || true) | grep -E -m 1 "$MLEV_SRUN_TASK_ERROR" || true)
    if [ -z "$line" ]; then
        echo "the step exited with status $status"
        return 0
    fi
    mlev_srun_error_parts "$line"
    echo "rank $MLEV_TASKS (node $MLEV_NODE) $(mlev_signal_name "$MLEV_WHAT")"
}
