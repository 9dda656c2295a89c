#!/usr/bin/env bash
# A two-node SLURM cluster on this one host, for tests and demos: munged + slurmctld + `slurmd -N node1` and
# `slurmd -N node2`, from Debian's slurm-wlm and munge packages (installed when missing).
#
#   slurm/local_cluster.sh start    # idempotent; prints `export SLURM_CONF=...` (also in $DIR/env.sh)
#   slurm/local_cluster.sh status   # sinfo and daemon pids; exit 0 when up, 3 when not
#   slurm/local_cluster.sh stop     # cancels jobs, stops the daemons it started; idempotent
#
# Everything lives under ${SLURM_LOCAL_DIR:-/tmp/toolkit-slurm}: a real installation's /etc/slurm, its munge
# socket and its ports (6817/6818) are never touched. Exit 2: cannot install the packages (tests skip on it).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/toolkit-slurm}
CONF=$DIR/slurm.conf
MUNGE_SOCKET=$DIR/run/munge.socket
# Away from SLURM's defaults (6817/6818); overridable so two independent clusters can coexist.
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-16817}
NODE_PORT=${SLURM_LOCAL_NODE_PORT:-17001}
NODES=(node1 node2)
NODE_PORTS=("$NODE_PORT" "$((NODE_PORT + 1))")
HOST=$(hostname -s)
# The daemons live in sbin, which a non-login root shell may not have on PATH.
export PATH=$PATH:/usr/sbin:/sbin
export SLURM_CONF=$CONF

log() { echo "local_cluster: $*"; }

running() { # a zombie counts as gone: an init that reaps slowly (seen here: ~2 s) would stall every stop
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]]
}

pid_of() { # pid from a pid file, only if that process is still running
    local file=$1 pid
    [[ -s $file ]] || return 1
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] && running "$pid" && echo "$pid"
}

daemons() { # name and pid file of every daemon, in start order
    echo "munged $DIR/run/munged.pid"
    echo "slurmctld $DIR/run/slurmctld.pid"
    for node in "${NODES[@]}"; do echo "slurmd-$node $DIR/run/slurmd-$node.pid"; done
}

all_up() {
    local name file
    while read -r name file; do pid_of "$file" >/dev/null || return 1; done < <(daemons)
}

installed() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; }

preflight() { # hosts that cannot run this cluster at all: one line and exit 2 (the tests skip on it)
    if [[ $(id -u) -ne 0 ]]; then
        # The daemons run as root (SlurmUser=root) and node names go into /etc/hosts.
        echo "local_cluster: needs root (runs slurmctld/slurmd as root; installs slurm-wlm and munge with apt-get)" >&2
        exit 2
    fi
    if ! installed && ! command -v apt-get >/dev/null; then
        echo "local_cluster: slurm-wlm and munge are not installed and there is no apt-get to install them" >&2
        exit 2
    fi
}

ensure_packages() {
    installed && return 0
    log "installing slurm-wlm and munge: apt-get update -qq && apt-get install -y -qq slurm-wlm munge"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >"$DIR/apt.log" 2>&1
    then
        tail -n 20 "$DIR/apt.log" >&2
        echo "local_cluster: apt-get could not install slurm-wlm and munge (log: $DIR/apt.log)" >&2
        exit 2
    fi
    log "installed $(slurmctld -V 2>/dev/null), munge $(dpkg-query -W -f='${Version}' munge 2>/dev/null)"
}

ensure_hosts() {
    # Code that turns node names into addresses (a rendezvous on the head node) needs them to resolve.
    local missing=() node
    for node in "${NODES[@]}"; do getent hosts "$node" >/dev/null || missing+=("$node"); done
    ((${#missing[@]})) || return 0
    if echo "127.0.0.1 ${missing[*]}" 2>/dev/null >>/etc/hosts; then
        log "added '127.0.0.1 ${missing[*]}' to /etc/hosts"
    else
        log "warning: ${missing[*]} do not resolve and /etc/hosts is not writable"
    fi
}

write_conf() {
    local i
    {
        cat <<EOF
# Written by slurm/local_cluster.sh (rewritten at each start): two slurmd "nodes" on one host.
ClusterName=toolkit-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups needed: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the node lines below even where the host has fewer cores than they claim (no DRAIN).
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
KillWait=5
MinJobAge=300
JobRequeue=1
# Debian ships no mailer; without this slurmctld logs an error at every start.
MailProg=/bin/true
EOF
        for i in "${!NODES[@]}"; do
            echo "NodeName=${NODES[$i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=${NODE_PORTS[$i]} CPUs=2 RealMemory=1000 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
}

fail() { # message, then the tails of the daemon logs
    local f
    echo "local_cluster: $*" >&2
    for f in "$DIR"/log/*.log; do
        [[ -f $f ]] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }
    done
    exit 1
}

start_munged() {
    pid_of "$DIR/run/munged.pid" >/dev/null && return 0
    if [[ ! -s $DIR/munge/munge.key ]]; then
        # A private key: a system munged (if any) keeps its own key and socket.
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
    fi
    log "starting munged"
    munged --key-file "$DIR/munge/munge.key" --socket "$MUNGE_SOCKET" --pid-file "$DIR/run/munged.pid" \
        --log-file "$DIR/log/munged.log" --seed-file "$DIR/munge/munged.seed" 9>&- ||
        fail "munged did not start"
    local _
    for _ in $(seq 50); do
        munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    fail "munge -n | unmunge does not work"
}

wait_idle() {
    # A fresh cluster must reach idle; after restarting one slurmd of a busy cluster, mixed/allocated is up too.
    local states _ ok='^(node1 (idle|mixed|allocated|completing) node2 (idle|mixed|allocated|completing) )$'
    for _ in $(seq 120); do
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        [[ $states =~ $ok ]] && return 0
        sleep 0.5
    done
    fail "nodes not idle after 60 s (sinfo: ${states:-no answer})"
}

start() {
    mkdir -p "$DIR"/{state,run,log,munge} "${NODES[@]/#/$DIR/spool/}"
    chmod 700 "$DIR/munge"
    if all_up; then
        log "already running"
    else
        ensure_packages
        # A stray would hold a port or answer for a node that this script then could not stop.
        stop_stray_daemons || true
        ensure_hosts
        write_conf
        start_munged
        if ! pid_of "$DIR/run/slurmctld.pid" >/dev/null; then
            log "starting slurmctld on port $CTLD_PORT"
            # -c: start from a clean state, so jobs of an earlier session never come back.
            slurmctld -c -f "$CONF" 9>&- || fail "slurmctld did not start"
        fi
        local i
        for i in "${!NODES[@]}"; do
            pid_of "$DIR/run/slurmd-${NODES[$i]}.pid" >/dev/null && continue
            log "starting slurmd -N ${NODES[$i]} on port ${NODE_PORTS[$i]}"
            slurmd -N "${NODES[$i]}" -f "$CONF" 9>&- || fail "slurmd -N ${NODES[$i]} did not start"
        done
        wait_idle
        all_up || fail "a daemon exited after starting (port taken by another program?)"
        log "up: ${NODES[*]} idle in partition debug"
    fi
    echo "export SLURM_CONF=$CONF" >"$DIR/env.sh"
    echo "export SLURM_CONF=$CONF   # or: source $DIR/env.sh"
}

stop_pid() { # name pid: TERM, wait (bounded), then KILL
    local name=$1 pid=$2 _
    log "stopping $name ($pid)"
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do running "$pid" || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

ours() { # does process $1 belong to this cluster (its command line, cwd or open files name $DIR)?
    # grep reads everything (no -q): an early exit would SIGPIPE the writer and pipefail would say "no".
    { tr '\0' ' ' <"/proc/$1/cmdline"; echo; ls -l "/proc/$1/cwd" "/proc/$1/fd"; } 2>/dev/null | grep -F "$DIR/" >/dev/null
}

stop_stray_daemons() { # daemons of this cluster that no pid file names (a crash, a start that raced a stop)
    local pid managed=" " name file found=1
    while read -r name file; do managed+="$(pid_of "$file") "; done < <(daemons)
    for pid in $(pgrep -x 'munged|slurmctld|slurmd' || true); do
        if [[ $managed != *" $pid "* ]] && ours "$pid"; then
            stop_pid "stray $(cat "/proc/$pid/comm" 2>/dev/null)" "$pid"
            found=0
        fi
    done
    return $found
}

descendants() { # pids of every process below $1, deepest last
    local child
    for child in $(pgrep -P "$1" || true); do echo "$child"; descendants "$child"; done
}

stop() {
    local name file pid _ stray=() stopped=0
    # Jobs first: their slurmstepd processes outlive slurmd otherwise.
    if pid_of "$DIR/run/slurmctld.pid" >/dev/null && [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
        log "cancelling jobs"
        squeue -h -o %i | xargs -r scancel --full 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z $(squeue -h -t pending,running,completing,suspended -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
    # Reverse start order: nodes, controller, then munged.
    while read -r name file; do
        pid=$(pid_of "$file") && { stop_pid "$name" "$pid"; stopped=1; }
        rm -f "$file"
    done < <(daemons | tac)
    stop_stray_daemons && stopped=1
    # The slurmstepd of a job that ignored the kill goes with the job's own processes, or they would be orphaned.
    for pid in $(pgrep -x slurmstepd || true); do
        # shellcheck disable=SC2207  # pids are single words
        ours "$pid" && stray+=("$pid" $(descendants "$pid"))
    done
    if ((${#stray[@]})); then
        log "killing leftover job processes: ${stray[*]}"
        kill -9 "${stray[@]}" 2>/dev/null || true
        stopped=1
    fi
    if ((stopped)); then log "stopped"; else log "not running"; fi
}

status() {
    local name file pid up=0
    while read -r name file; do
        if pid=$(pid_of "$file"); then echo "$name: $pid"; else echo "$name: not running"; up=3; fi
    done < <(daemons)
    if ((up == 0)); then
        sinfo || up=3
        echo "export SLURM_CONF=$CONF"
    fi
    return $up
}

locked() { # start and stop from several shells (parallel test sessions) must not interleave
    mkdir -p "$DIR"
    exec 9>"$DIR/.lock"
    flock -w 900 9 || { echo "local_cluster: $DIR/.lock held for 900 s by another start/stop" >&2; exit 1; }
    "$@"
}

case ${1:-} in
    start) preflight; locked start ;;
    stop) locked stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 64 ;;
esac
