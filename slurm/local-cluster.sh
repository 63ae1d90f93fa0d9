#!/usr/bin/env bash
# Real, single-machine SLURM cluster for tests and CI (Debian 12, as root, no systemd).
#
#   slurm/local-cluster.sh up      # install (if needed), configure, start, wait until usable
#   slurm/local-cluster.sh down    # stop all daemons (job/accounting state is kept)
#   slurm/local-cluster.sh status  # show daemons + sinfo; exit 0 iff every node is usable
#
# Layout: munged, MariaDB (unix socket only, no TCP), slurmdbd, slurmctld and N slurmd
# processes (`slurmd -N nK`) that emulate N nodes on 127.0.0.1, each with fake GPUs
# (char devices cloned from /dev/null, so CUDA_VISIBLE_DEVICES gets set by SLURM).
# Partitions: debug (default), low (preemptable, requeue), high (preempts low).
# Facts behind every setting: shared/research/slurm-local-cluster.md (Slurm 22.05.8).
#
# `up` is idempotent and fast (~1 s) when the cluster already runs. Config files are only
# rewritten when their content changes; if they change while daemons run, the SLURM
# daemons are restarted so the new config takes effect.
set -euo pipefail

# ---- tunables (env overrides; cheap because everything below is generated from them) ----
# Number of emulated nodes n1..nN; tests assume >= 2 to exercise multi-node code paths.
NODES=${SLURM_LOCAL_NODES:-2}
# Declared CPUs per node; more than the hardware has (SlurmdParameters=config_overrides),
# so 2x16-rank jobs can be scheduled on a 2-core box (slow, but real).
CPUS=${SLURM_LOCAL_CPUS:-16}
# Declared memory per node in MB (also overridden, not checked against the hardware).
MEM=${SLURM_LOCAL_MEM:-16000}
# Fake GPUs per node; 0 disables GRES entirely (e.g. where mknod is not permitted).
GPUS=${SLURM_LOCAL_GPUS:-8}
# Credential lifetime; it is also the delay before a requeued job may start again
# (default 120 s; 30 s keeps requeue/preemption tests short without breaking srun).
CRED_EXPIRE=${SLURM_LOCAL_CRED_EXPIRE:-30}
# Seconds to wait for the cluster to become usable before giving up.
WAIT_S=${SLURM_LOCAL_WAIT:-60}
# Seconds to wait for a concurrently running apt/dpkg to release its lock.
APT_WAIT_S=${SLURM_LOCAL_APT_WAIT:-900}
# Seconds `down` gives each daemon to exit after SIGTERM before SIGKILL.
STOP_WAIT_S=${SLURM_LOCAL_STOP_WAIT:-15}

PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
ETC=/etc/slurm
HOSTS_TAG="# nanotrain slurm/local-cluster.sh nodes"
DB_PASS=slurmpw # MariaDB only listens on a root-owned unix socket; not a secret.
# Daemons get a clean environment so nothing from the caller (venv, SLURM_* of an
# enclosing job, pytest variables) leaks into the cluster.
DAEMON_ENV=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
export SLURM_CONF=$ETC/slurm.conf PATH=/usr/local/sbin:/usr/sbin:/sbin:$PATH

log() { echo "local-cluster: $*"; }
die() { echo "local-cluster: ERROR: $*" >&2; exit 1; }

for v in NODES CPUS MEM GPUS CRED_EXPIRE WAIT_S APT_WAIT_S STOP_WAIT_S; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_${v%_S} must be a non-negative integer, got '${!v}'"
done
((NODES >= 1 && CPUS >= 1)) || die "need at least 1 node and 1 CPU"

NODE_NAMES=()
for ((i = 1; i <= NODES; i++)); do NODE_NAMES+=("n$i"); done
if ((NODES > 1)); then NODE_EXPR="n[1-$NODES]"; else NODE_EXPR=n1; fi

# ---------------------------------------------------------------- process helpers
# procps/psmisc (pgrep, fuser) are not installed on a minimal Debian, so read /proc.

# pid_alive PID COMM: PID exists, its executable name is COMM and it is not a zombie
# (exited daemons stay zombies for ~1.5 s here until PID 1 reaps them).
pid_alive() {
    local c= state=
    [[ -n $1 ]] && { read -r c <"/proc/$1/comm" && read -r _ _ state _ <"/proc/$1/stat"; } 2>/dev/null
    [[ $c == "$2" && $state != Z ]]
}

# find_by_comm COMM [ARG]: print the first live pid whose comm is COMM (and whose
# argv contains the word ARG); status 1 if there is none.
find_by_comm() {
    local d c
    for d in /proc/[0-9]*; do
        c=
        { read -r c <"$d/comm"; } 2>/dev/null || true
        [[ $c == "$1" ]] && pid_alive "${d#/proc/}" "$1" || continue
        if [[ -n ${2:-} ]]; then
            tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -qw -- "$2" || continue
        fi
        echo "${d#/proc/}"
        return 0
    done
    return 1
}

# daemon_pid KEY: pid of a running daemon (via its pid file, else /proc), or nothing.
# KEY is munged | mariadbd | slurmdbd | slurmctld | slurmd:NODE
daemon_pid() {
    local comm=${1%%:*} node= pidfile pid
    [[ $1 == *:* ]] && node=${1#*:}
    case $comm in
        munged) pidfile=/run/munge/munged.pid ;;
        mariadbd) pidfile=/run/mysqld/mysqld.pid ;;
        slurmd) pidfile=/run/slurm/slurmd-$node.pid ;;
        *) pidfile=/run/slurm/$comm.pid ;;
    esac
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if pid_alive "$pid" "$comm"; then echo "$pid"; return; fi
    # No (valid) pid file: e.g. started by hand. slurmd is matched by its -N argument.
    if [[ -n $node ]]; then find_by_comm slurmd "$node" || true
    else find_by_comm "$comm" || true; fi
}

all_daemons() {
    local n
    echo munged mariadbd slurmdbd slurmctld
    for n in "${NODE_NAMES[@]}"; do echo "slurmd:$n"; done
}

# slurmd keys of the configured nodes plus any left from a larger SLURM_LOCAL_NODES.
slurmd_keys() {
    local n f
    {
        for n in "${NODE_NAMES[@]}"; do echo "slurmd:$n"; done
        for f in /run/slurm/slurmd-*.pid; do
            [[ -e $f ]] && f=${f##*/slurmd-} && echo "slurmd:${f%.pid}"
        done
    } | sort -u
}

# stop_daemons KEY...: SIGTERM all of them at once, wait, SIGKILL stragglers.
stop_daemons() {
    local key pid pids=() names=() deadline
    for key in "$@"; do
        pid=$(daemon_pid "$key")
        [[ -n $pid ]] || continue
        log "stopping $key (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid") names+=("${key%%:*}")
    done
    ((${#pids[@]})) || return 0
    deadline=$((SECONDS + STOP_WAIT_S))
    local i alive
    while :; do
        alive=0
        for i in "${!pids[@]}"; do pid_alive "${pids[$i]}" "${names[$i]}" && alive=1; done
        ((alive)) || return 0
        ((SECONDS < deadline)) || break
        sleep 0.1
    done
    for i in "${!pids[@]}"; do
        if pid_alive "${pids[$i]}" "${names[$i]}"; then
            log "${names[$i]} (pid ${pids[$i]}) ignored SIGTERM for ${STOP_WAIT_S}s: SIGKILL"
            kill -KILL "${pids[$i]}" 2>/dev/null || true
        fi
    done
}

# start_daemon KEY PIDFILE CMD...: run CMD unless KEY is running; wait for its pid file.
start_daemon() {
    local key=$1 pidfile=$2 log_file deadline
    shift 2
    [[ -z $(daemon_pid "$key") ]] || return 0
    log "starting $key"
    log_file=/var/log/slurm/local-cluster-${key/:/-}.out
    rm -f "$pidfile"
    # Daemons must not inherit our stdout: a caller capturing it would wait forever.
    "${DAEMON_ENV[@]}" "$@" </dev/null >>"$log_file" 2>&1 || die "$key failed to start; see $log_file and /var/log/slurm/"
    deadline=$((SECONDS + 15))
    until [[ -n $(daemon_pid "$key") ]]; do
        ((SECONDS < deadline)) || die "$key did not come up within 15 s; see $log_file and /var/log/slurm/"
        sleep 0.1
    done
}

# retry SECONDS MESSAGE CMD...: run CMD (quietly) until it succeeds or time runs out.
retry() {
    local secs=$1 msg=$2 deadline
    shift 2
    deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$msg (gave up after ${secs}s)"
        sleep 0.2
    done
}

# ---------------------------------------------------------------- packages
missing_packages() {
    local p status
    for p in "${PACKAGES[@]}"; do
        status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
        [[ $status == "install ok installed" ]] || echo "$p"
    done
}

# True while another apt/dpkg runs (lock files are fcntl locks: flock can't see them).
apt_busy() {
    local c
    for c in apt apt-get aptitude dpkg unattended-upgr; do
        find_by_comm "$c" >/dev/null && return 0
    done
    return 1
}

wait_for_apt() {
    local deadline=$((SECONDS + APT_WAIT_S)) said=0
    while apt_busy; do
        ((said)) || { log "another apt/dpkg is running; waiting up to ${APT_WAIT_S}s for it"; said=1; }
        ((SECONDS < deadline)) || die "apt/dpkg still busy after ${APT_WAIT_S}s"
        sleep 2
    done
}

ensure_packages() {
    local missing
    missing=$(missing_packages)
    [[ -n $missing ]] || return 0
    wait_for_apt # the other apt may be installing exactly these packages
    missing=$(missing_packages)
    [[ -n $missing ]] || return 0
    log "installing:" $missing
    # Keep package scripts from starting services (mariadb would open TCP, munged and
    # slurm* would start without our config). Only if the machine has no policy yet.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
    fi
    local apt=(apt-get -q -o DPkg::Lock::Timeout="$APT_WAIT_S")
    local rc=0
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" update >/dev/null || rc=$?
    # shellcheck disable=SC2086
    ((rc)) || DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends $missing || rc=$?
    ((own_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get failed (rc $rc) installing: $missing"
    missing=$(missing_packages)
    [[ -z $missing ]] || die "packages still not installed after apt-get: $missing"
}

# ---------------------------------------------------------------- configuration
CHANGED_SLURM=0 # slurm.conf / gres.conf changed -> restart slurmctld + slurmd
CHANGED_DBD=0   # slurmdbd.conf changed -> restart slurmdbd

# put_file PATH MODE FLAGVAR < content: write only if different; set FLAGVAR=1 if written.
put_file() {
    local path=$1 mode=$2 flag=$3 tmp
    tmp=$(mktemp "$path.XXXXXX")
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if cmp -s "$tmp" "$path" && [[ $(stat -c %a "$path") == "$mode" ]]; then
        rm -f "$tmp"
    else
        mv -f "$tmp" "$path"
        log "wrote $path"
        printf -v "$flag" 1
    fi
}

# Fake GPUs: char devices 1:3 (same as /dev/null). Plain files are rejected by slurmd.
ensure_fake_gpus() {
    ((GPUS > 0)) || return 0
    local i dev
    for ((i = 0; i < GPUS; i++)); do
        dev=/dev/fakegpu$i
        [[ -c $dev ]] && continue
        rm -f "$dev" 2>/dev/null || true
        if ! mknod -m 666 "$dev" c 1 3 2>/dev/null; then
            log "WARNING: mknod $dev failed (no CAP_MKNOD?); running without fake GPUs"
            GPUS=0
            return 0
        fi
    done
}

write_configs() {
    local host gres_types="" gres_node="" n
    host=$(hostname -s)
    mkdir -p "$ETC"
    if ((GPUS > 0)); then gres_types="GresTypes=gpu"; gres_node="Gres=gpu:$GPUS"; fi
    put_file "$ETC/slurm.conf" 644 CHANGED_SLURM <<EOF
# Generated by slurm/local-cluster.sh; edits are overwritten on the next 'up'.
ClusterName=localcluster
# Explicit address: the controller must not depend on how '$host' resolves.
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Also the requeue delay (cred_expire + 1 s); default 120 s.
AuthInfo=cred_expire=$CRED_EXPIRE
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
# cgroup plugins work here but depend on the host and leave cgroups behind.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
# Lets nodes declare more CPUs/memory than the machine has.
SlurmdParameters=config_overrides
ReturnToService=2
$gres_types
StateSaveLocation=/var/spool/slurm/ctld
SlurmdSpoolDir=/var/spool/slurm/d/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$NODE_EXPR NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-$((17000 + NODES)) CPUs=$CPUS RealMemory=$MEM $gres_node State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# 22.05 spelling (no PreemptParameters): preempted jobs get the --signal (submitit: USR2).
SlurmctldParameters=preempt_send_user_signal
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=low Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30 PreemptMode=REQUEUE
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
    local files=/dev/fakegpu0
    ((GPUS > 1)) && files="/dev/fakegpu[0-$((GPUS - 1))]"
    # Process substitution, not a pipe: put_file must set CHANGED_SLURM in this shell.
    put_file "$ETC/gres.conf" 644 CHANGED_SLURM < <(
        echo "# Generated by slurm/local-cluster.sh"
        if ((GPUS > 0)); then
            for n in "${NODE_NAMES[@]}"; do echo "NodeName=$n Name=gpu File=$files"; done
        fi
    )
    put_file "$ETC/slurmdbd.conf" 600 CHANGED_DBD <<EOF
# Generated by slurm/local-cluster.sh
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
}

# Node names must resolve (submitit/torch use MASTER_ADDR=n1). Rewritten in place, not
# via sed -i, because /etc/hosts is often a bind mount that can't be replaced.
ensure_hosts() {
    local line="127.0.0.1 ${NODE_NAMES[*]} $HOSTS_TAG" rest
    grep -qxF -- "$line" /etc/hosts 2>/dev/null && return 0
    rest=$(grep -vF -- "$HOSTS_TAG" /etc/hosts 2>/dev/null || true)
    if printf '%s\n%s\n' "$rest" "$line" >/etc/hosts 2>/dev/null; then
        log "added '127.0.0.1 ${NODE_NAMES[*]}' to /etc/hosts"
    else
        log "WARNING: cannot write /etc/hosts; node names ${NODE_NAMES[*]} will not resolve"
    fi
}

# ---------------------------------------------------------------- readiness checks
# Print "node state" for each node of the default partition (one line per node).
node_states() { timeout 5 sinfo -h -N -p debug -o '%N %T' 2>/dev/null; }

# All nodes respond and can run jobs ('*' suffix = not responding).
nodes_usable() {
    local states n ok=0
    states=$(node_states) || return 1
    for n in "${NODE_NAMES[@]}"; do
        grep -qE "^$n (idle|mixed|allocated|completing)$" <<<"$states" && ok=$((ok + 1))
    done
    ((ok == NODES))
}

sacct_works() { timeout 10 sacct -n -X -P -o JobID -S now >/dev/null 2>&1; }

wait_until_usable() {
    local deadline=$((SECONDS + WAIT_S)) next_resume=0 states
    until nodes_usable; do
        states=$(node_states || true)
        if ((SECONDS >= deadline)); then
            echo "$states" | sed 's/^/local-cluster:   /' >&2
            die "nodes not usable after ${WAIT_S}s; see /var/log/slurm/slurmctld.log and slurmd-n*.log"
        fi
        # Nodes that answer but are down/drained (e.g. after an unclean stop): resume them.
        if ((SECONDS >= next_resume)) && grep -qE ' (down|drain|drained|draining|fail)$' <<<"$states"; then
            log "resuming down/drained nodes"
            timeout 5 scontrol update nodename="$NODE_EXPR" state=resume >/dev/null 2>&1 || true
            next_resume=$((SECONDS + 5))
        fi
        sleep 0.3
    done
    retry $((deadline - SECONDS > 5 ? deadline - SECONDS : 5)) \
        "sacct does not answer; see /var/log/slurm/slurmdbd.log" sacct_works
}

# ---------------------------------------------------------------- subcommands
need_root() {
    [[ $(id -u) -eq 0 ]] && return 0
    echo "local-cluster: '$1' must run as root (it installs packages, writes /etc/slurm and manages system daemons)." >&2
    echo "local-cluster: try: sudo $0 $1" >&2
    exit 1
}

cmd_up() {
    need_root up
    local t0=$SECONDS n
    ensure_packages
    ensure_fake_gpus
    write_configs
    ensure_hosts
    mkdir -p /run/munge /run/slurm /run/mysqld /var/spool/slurm/ctld /var/log/slurm
    for n in "${NODE_NAMES[@]}"; do mkdir -p "/var/spool/slurm/d/$n"; done
    chown munge:munge /run/munge
    chown mysql:mysql /run/mysqld

    # New config while running: restart what reads it (cheaper than reasoning about
    # which keys `scontrol reconfigure` can apply).
    if ((CHANGED_SLURM)); then
        # shellcheck disable=SC2046
        stop_daemons $(slurmd_keys) slurmctld
    fi
    ((CHANGED_DBD)) && stop_daemons slurmdbd

    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating munge key"
        runuser -u munge -- mungekey --create >/dev/null
    fi
    start_daemon munged /run/munge/munged.pid runuser -u munge -- /usr/sbin/munged
    retry 10 "munge does not work" bash -c 'munge -n | unmunge'

    if [[ ! -d /var/lib/mysql/mysql ]]; then
        log "initialising MariaDB data directory"
        mariadb-install-db --user=mysql >/var/log/slurm/local-cluster-mariadb-install.out 2>&1 ||
            die "mariadb-install-db failed; see /var/log/slurm/local-cluster-mariadb-install.out"
    fi
    if [[ -z $(daemon_pid mariadbd) ]]; then
        # No TCP listener at all; slurmdbd reaches it through the socket ('localhost').
        start_daemon mariadbd /run/mysqld/mysqld.pid setsid -f /usr/sbin/mariadbd --user=mysql \
            --skip-networking --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid
        retry 30 "MariaDB does not answer; see /var/log/slurm/local-cluster-mariadbd.out" mariadb-admin ping
    fi

    if [[ -z $(daemon_pid slurmdbd) ]]; then
        mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
                    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
            die "cannot create the MariaDB user for slurmdbd"
        start_daemon slurmdbd /run/slurm/slurmdbd.pid /usr/sbin/slurmdbd
        # slurmctld registers the cluster itself, but only if slurmdbd already answers.
        retry 30 "slurmdbd does not answer; see /var/log/slurm/slurmdbd.log" \
            timeout 5 sacctmgr -n -P show cluster
    fi

    start_daemon slurmctld /run/slurm/slurmctld.pid /usr/sbin/slurmctld
    for n in "${NODE_NAMES[@]}"; do
        start_daemon "slurmd:$n" "/run/slurm/slurmd-$n.pid" /usr/sbin/slurmd -N "$n"
    done

    wait_until_usable
    log "up: $NODES nodes ($NODE_EXPR, $CPUS CPUs, $GPUS fake GPUs each), partitions debug/low/high, sacct on ($((SECONDS - t0))s)"
}

cmd_down() {
    need_root down
    # shellcheck disable=SC2046
    stop_daemons $(slurmd_keys) slurmctld
    stop_daemons slurmdbd
    stop_daemons mariadbd
    stop_daemons munged
    log "down"
}

cmd_status() {
    local key pid rc=0
    for key in $(all_daemons); do
        pid=$(daemon_pid "$key")
        if [[ -n $pid ]]; then printf 'local-cluster: %-12s running (pid %s)\n' "$key" "$pid"
        else printf 'local-cluster: %-12s stopped\n' "$key"; fi
    done
    if command -v sinfo >/dev/null; then
        timeout 5 sinfo 2>&1 || true
    else
        log "sinfo not installed"
    fi
    if nodes_usable; then log "usable"; else log "NOT usable"; rc=1; fi
    return $rc
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 up|down|status" >&2
        exit 2
        ;;
esac
