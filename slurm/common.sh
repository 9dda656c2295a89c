# Sourced by the sbatch scripts (submit them from the project root). Sets RECIPE, RECIPE_ARGS, PYTHON,
# HEAD_NODE, MASTER_PORT and RUN_DIR, and runs job steps so that the batch shell can forward pre-emption.

toolkit_job_setup() {
  if [ $# -lt 1 ]; then
    echo "error: give the recipe: sbatch slurm/<script>.sbatch recipes/<recipe>.py [flags...]" >&2
    exit 2
  fi
  RECIPE=$1
  shift
  if [ ! -f "$RECIPE" ]; then
    echo "error: recipe $RECIPE not found under $(pwd) (submit from the project root)" >&2
    exit 2
  fi
  RECIPE_ARGS=$(printf '%q ' "$@")
  if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
  fi
  if [ -n "${TOOLKIT_SWEEP:-}" ] && [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
    # A task of `python -m toolkit sweep --launcher slurm`: its run's flags and directory, written by the sweep.
    RECIPE_ARGS="$(cat "$TOOLKIT_SWEEP/tasks/$SLURM_ARRAY_TASK_ID.args") $RECIPE_ARGS"
    RUN_DIR=$(cat "$TOOLKIT_SWEEP/tasks/$SLURM_ARRAY_TASK_ID.dir")
  fi
  if [ -n "${TOOLKIT_SEARCH:-}" ] && [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
    # A task of `python -m toolkit sweep --search ... --launcher slurm`: it takes a trial from the study (after a
    # requeue, its own again) and runs it with the trial's flags, directory and TOOLKIT_TRIAL.
    local trial
    trial=$("$PYTHON" -m toolkit sweep --trial-worker "$TOOLKIT_SEARCH")
    if [ -z "$trial" ]; then
      echo "no trial left in the study $TOOLKIT_SEARCH"
      exit 0
    fi
    RECIPE_ARGS="$(cat "$TOOLKIT_SEARCH/tasks/$trial.args") $RECIPE_ARGS"
    RUN_DIR=$(cat "$TOOLKIT_SEARCH/tasks/$trial.dir")
    TOOLKIT_TRIAL=$(cat "$TOOLKIT_SEARCH/tasks/$trial.trial")
    export TOOLKIT_TRIAL
  fi
  # The head node is the first of the allocation; every node's launcher connects to it.
  HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
  # A port derived from the job id: two jobs sharing a head node do not collide; a requeued job keeps it.
  MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
  # The job id survives requeues, so the requeued job finds this run directory and resumes from it.
  RUN_DIR=${RUN_DIR:-runs/$(basename "$RECIPE" .py)/slurm-$SLURM_JOB_ID}
  mkdir -p "$RUN_DIR/logs"
  echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST: head $HEAD_NODE:$MASTER_PORT, run dir $RUN_DIR"
}

toolkit_srun() {
  # srun runs in the background so the batch shell can act on SIGUSR1 and SIGTERM (bash defers traps while a
  # foreground command runs). SIGUSR1 (from `#SBATCH --signal=B:USR1@120` or `scancel --batch --signal=USR1`) is
  # forwarded to every process of the job steps; the workers checkpoint, requeue and exit 0. SIGTERM (`scancel`,
  # the time limit; `scancel --batch` reaches only this shell) likewise, and the workers checkpoint and exit 0
  # without a requeue.
  srun --open-mode=append --output="$RUN_DIR/logs/%j-node%n.log" "$@" &
  local step=$!
  trap "echo 'batch shell: SIGUSR1, forwarding to the job steps'; scancel --signal=USR1 $SLURM_JOB_ID" USR1
  trap "echo 'batch shell: SIGTERM, forwarding to the job steps'; scancel --signal=TERM $SLURM_JOB_ID" TERM
  local status=0
  while true; do
    wait "$step" && status=0 || status=$?
    kill -0 "$step" 2>/dev/null || break   # wait was interrupted by the trap: srun is still running
  done
  trap - USR1 TERM
  echo "job step finished with status $status"
  return "$status"
}
