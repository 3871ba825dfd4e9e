#!/usr/bin/env bash
# A throwaway GlusterFS 10.3 volume on loopback, mounted twice, for kvtier's shared-pool tests.
#
#   scripts/glusterfs.sh up DIR      # start it; prints `export KVTIER_GLUSTER_...=...` lines
#   scripts/glusterfs.sh down DIR    # unmount, stop and delete the volume, stop its daemons
#   scripts/glusterfs.sh status DIR  # the same lines as `up` when it is up, exit 1 otherwise
#
# `up` runs one glusterd of its own (no systemd), a distributed volume of two bricks
# (DIR/bricks/b1, DIR/bricks/b2) and two FUSE clients, DIR/mnt-a and DIR/mnt-b: two mounts are
# two clients with their own caches, standing for two machines. Everything lives under DIR
# (state, logs in DIR/log) except what GlusterFS puts in fixed places: the bricks' unix
# sockets in /var/run/gluster (removed by `down`) and the bricks' logs in
# /var/log/glusterfs/bricks (moved into DIR/log by `down`). On stdout, `up` prints shell lines
# (`eval "$(scripts/glusterfs.sh up DIR)"`), also written to DIR/gluster.env:
#   KVTIER_GLUSTER_MOUNT_A, KVTIER_GLUSTER_MOUNT_B  the two mount points
#   KVTIER_GLUSTER_VOLUME, KVTIER_GLUSTER_HOST      the volume and the address its daemons use
# Progress and timings go to stderr.
#
# Several instances (different DIRs) run side by side: each has its own glusterd, bound to a
# loopback address of its own (127.0.0.N, N in 2..254, picked from a hash of DIR and probed
# under a lock; GlusterFS clients and bricks always reach glusterd on port 24007, so the
# address is what tells the instances apart), its own CLI socket and a volume named after DIR
# (kvtier-<hash>). A glusterd already listening on *:24007 (a system service) blocks every
# address: stop it first. 127.0.0.1 is never used, and the CLI refuses it as a brick host anyway.
#
# Settings (the reasons are in docs/filesystems.md): performance.open-behind off (with it, a
# file unlinked on one client while another opens it reads ENOENT there); the metadata-cache
# option group is NOT enabled (stale reads for over 5 s); the clients' caches are the defaults.
#
# Needs root, /dev/fuse and the Debian packages glusterfs-server and glusterfs-client, which
# `up` installs with apt-get when they are missing (set KVTIER_GLUSTER_NO_INSTALL=1 to fail
# instead). `down` after a failed or half-done `up` cleans up what there is; `up` on a DIR
# that is already up prints its lines again.
set -euo pipefail

PORT=24007  # fixed: bricks and clients fetch their volfiles from HOST:24007
LOCK=/run/lock/kvtier-glusterfs.lock

log() { echo "glusterfs.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
    echo "usage: $0 up|down|status DIR" >&2
    exit 2
}

[ $# -eq 2 ] || usage
CMD=$1
case $CMD in up | down | status) ;; *) usage ;; esac
[ -n "$2" ] || usage
mkdir -p "$2"
DIR=$(realpath "$2")
ID=$(printf %s "$DIR" | sha1sum | cut -c1-8)
VOL=kvtier-$ID
STATE=$DIR/state
ENVFILE=$DIR/gluster.env
LOGDIR=$DIR/log
SOCK=$DIR/run/glusterd.sock
[ ${#SOCK} -lt 100 ] || SOCK=/run/kvtier-glusterd-$ID.sock  # unix socket paths stop at 107 bytes

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# A process that exists and is not a zombie, and is one of GlusterFS's (a reused pid is not).
alive() {
    local pid=$1
    [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
    [ "$(awk '{ print $3 }' "/proc/$pid/stat" 2>/dev/null)" != Z ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q gluster
}

# SIGTERM, then SIGKILL after a few seconds; returns once the process is gone.
stop_pid() {
    local pid=$1 i
    alive "$pid" || return 0
    kill "$pid" 2>/dev/null || true
    for i in $(seq 50); do
        alive "$pid" || return 0
        sleep 0.1
    done
    log "pid $pid ignored SIGTERM for 5 s: SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    for i in $(seq 50); do
        alive "$pid" || return 0
        sleep 0.1
    done
    log "warning: pid $pid is still there"
}

cli() {
    gluster --mode=script --glusterd-sock="$SOCK" --log-file="$LOGDIR/cli.log" "$@"
}

is_mounted() { grep -qF " $1 fuse.glusterfs " /proc/mounts; }

# The FUSE client serving mount point $1 (its last argument is the mount point).
client_pid() {
    local p
    for p in /proc/[0-9]*; do
        if [ "$(tr '\0' '\n' <"$p/cmdline" 2>/dev/null | tail -n 1)" = "$1" ] &&
            tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q '^/usr/sbin/glusterfs .*--volfile-id'; then
            echo "${p#/proc/}"
            return
        fi
    done
}

env_lines() {
    printf 'export KVTIER_GLUSTER_MOUNT_A=%q\n' "$DIR/mnt-a"
    printf 'export KVTIER_GLUSTER_MOUNT_B=%q\n' "$DIR/mnt-b"
    printf 'export KVTIER_GLUSTER_VOLUME=%q\n' "$VOL"
    printf 'export KVTIER_GLUSTER_HOST=%q\n' "$HOST"
}

load_state() {
    HOST='' GLUSTERD_PID='' CLIENT_A='' CLIENT_B=''
    # shellcheck disable=SC1090
    [ -f "$STATE" ] && . "$STATE"
    return 0
}

save_state() {
    {
        printf 'HOST=%q\n' "$HOST"
        printf 'SOCK=%q\n' "$SOCK"
        printf 'GLUSTERD_PID=%q\n' "${GLUSTERD_PID:-}"
        printf 'CLIENT_A=%q\n' "${CLIENT_A:-}"
        printf 'CLIENT_B=%q\n' "${CLIENT_B:-}"
    } >"$STATE"
}

is_up() {
    load_state
    [ -n "$HOST" ] && alive "$GLUSTERD_PID" && is_mounted "$DIR/mnt-a" && is_mounted "$DIR/mnt-b"
}

ensure_packages() {
    if command -v glusterd >/dev/null && command -v gluster >/dev/null && [ -x /sbin/mount.glusterfs ]; then
        return
    fi
    [ "${KVTIER_GLUSTER_NO_INSTALL:-0}" != 1 ] ||
        die "GlusterFS is not installed: as root, apt-get install glusterfs-server glusterfs-client"
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null ||
        die "GlusterFS is not installed and this is not root on Debian: as root, apt-get install glusterfs-server glusterfs-client"
    log "installing glusterfs-server glusterfs-client (apt-get)"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq glusterfs-server glusterfs-client >&2
}

# Something already accepts connections on $1:24007.
listening() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$PORT" 2>/dev/null; }

pick_host() {
    local start n i
    start=$((16#${ID:0:4} % 253))
    for i in $(seq 0 252); do
        n=$(((start + i) % 253 + 2))
        if ! listening "127.0.0.$n"; then
            echo "127.0.0.$n"
            return
        fi
    done
    die "every 127.0.0.N:$PORT is taken (a glusterd listening on *:$PORT, the system's? stop it first)"
}

up() {
    local t0 t1 vol_file i
    t0=$(now)
    if is_up; then
        log "already up under $DIR"
        env_lines | tee "$ENVFILE"
        return
    fi
    [ ! -f "$STATE" ] || { log "a previous instance under $DIR is half up: cleaning it first"; down; }
    [ "$(id -u)" = 0 ] || die "needs root (glusterd, FUSE mounts)"
    trap 'rc=$?; if [ $rc -ne 0 ]; then log "up failed (exit $rc): cleaning up; logs in $LOGDIR"; { grep -h " E " "$LOGDIR"/*.log 2>/dev/null | tail -n 8 >&2 || true; }; down || true; fi' EXIT
    [ -c /dev/fuse ] || die "/dev/fuse is missing: FUSE mounts are impossible here (a container needs --device /dev/fuse)"
    ensure_packages
    mkdir -p "$LOGDIR" "$DIR/work" "$DIR/run" "$DIR/bricks/b1" "$DIR/bricks/b2" "$DIR/mnt-a" "$DIR/mnt-b"
    HOST='' GLUSTERD_PID=''
    save_state  # from here on, `down` knows this is ours to clean

    mkdir -p "$(dirname "$LOCK")"
    exec 9>"$LOCK"
    flock -w ${KVTIER_GLUSTER_LOCK_WAIT_S:-120} 9 || die "timed out waiting for $LOCK (another instance starting?)"
    HOST=$(pick_host)
    vol_file=$DIR/glusterd.vol
    cat >"$vol_file" <<EOF
volume management
    type mgmt/glusterd
    option working-directory $DIR/work
    option run-directory $DIR/run
    option glusterd-sockfile $SOCK
    option transport-type socket
    option transport.socket.bind-address $HOST
    option transport.socket.listen-port $PORT
    option transport.socket.keepalive-time 10
    option transport.socket.keepalive-interval 2
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
EOF
    setsid glusterd -N -f "$vol_file" -p "$DIR/glusterd.pid" -l "$LOGDIR/glusterd.log" \
        </dev/null >>"$LOGDIR/glusterd.out" 2>&1 9>&- &
    GLUSTERD_PID=$!
    save_state
    for i in $(seq 100); do
        if cli volume list >/dev/null 2>&1; then break; fi
        alive "$GLUSTERD_PID" || { tail -n 20 "$LOGDIR/glusterd.log" >&2 || true; die "glusterd exited; see $LOGDIR"; }
        sleep 0.1
    done
    cli volume list >/dev/null 2>&1 || die "glusterd did not answer within 10 s; see $LOGDIR"
    exec 9>&-  # glusterd holds its address now: other instances probe past it
    t1=$(now)

    cli volume create "$VOL" transport tcp "$HOST:$DIR/bricks/b1" "$HOST:$DIR/bricks/b2" force >&2
    cli volume set "$VOL" performance.open-behind off >&2
    cli volume start "$VOL" >&2
    for m in a b; do
        mount -t glusterfs -o "log-file=$LOGDIR/mnt-$m.log" "$HOST:/$VOL" "$DIR/mnt-$m"
    done
    CLIENT_A=$(client_pid "$DIR/mnt-a")
    CLIENT_B=$(client_pid "$DIR/mnt-b")
    save_state
    trap - EXIT
    log "up in $(since "$t0") s (glusterd answering after $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s): volume $VOL on $HOST, mounts $DIR/mnt-a $DIR/mnt-b"
    env_lines | tee "$ENVFILE"
}

down() {
    local t0 m pid sockets='' f
    t0=$(now)
    load_state
    for m in a b; do
        if is_mounted "$DIR/mnt-$m"; then
            umount "$DIR/mnt-$m" 2>/dev/null || { log "mnt-$m busy: lazy unmount"; umount -l "$DIR/mnt-$m" || true; }
        fi
    done
    for pid in "$CLIENT_A" "$CLIENT_B"; do stop_pid "$pid"; done
    # The bricks' sockets (in /var/run/gluster, named by a hash) are removed once they exit.
    for f in "$DIR"/run/vols/"$VOL"/*.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f" 2>/dev/null || true)
        if alive "$pid"; then
            sockets="$sockets $(tr '\0' '\n' <"/proc/$pid/cmdline" | grep -A1 -x -- -S | tail -n 1 || true)"
        fi
    done
    local t_umount t_stop t_daemons
    t_umount=$(since "$t0")
    if alive "$GLUSTERD_PID"; then
        cli volume stop "$VOL" force >/dev/null 2>&1 || log "volume stop failed (ignored)"
        cli volume delete "$VOL" >/dev/null 2>&1 || log "volume delete failed (ignored)"
    fi
    t_stop=$(since "$t0")
    for f in "$DIR"/run/vols/"$VOL"/*.pid; do
        [ -f "$f" ] || continue
        stop_pid "$(cat "$f" 2>/dev/null || true)"
    done
    stop_pid "$GLUSTERD_PID"
    t_daemons=$(since "$t0")
    [ -z "${GLUSTERD_PID:-}" ] && [ -f "$DIR/glusterd.pid" ] && stop_pid "$(cat "$DIR/glusterd.pid")"
    for f in $sockets; do
        case $f in /var/run/gluster/*.socket | /run/gluster/*.socket) rm -f "$f" ;; esac
    done
    [ "$SOCK" = "$DIR/run/glusterd.sock" ] || rm -f "$SOCK"
    if [ -f "$STATE" ]; then
        mkdir -p "$LOGDIR"
        for b in b1 b2; do
            f=/var/log/glusterfs/bricks/$(printf %s "${DIR#/}/bricks/$b" | tr / -).log
            [ ! -f "$f" ] || mv "$f" "$LOGDIR/brick-$b.log"
        done
        for m in a b; do
            if is_mounted "$DIR/mnt-$m"; then
                log "warning: $DIR/mnt-$m is still mounted: not removing $DIR/bricks"
                return 1
            fi
            rmdir "$DIR/mnt-$m" 2>/dev/null || true
        done
        rm -rf "$DIR/bricks" "$DIR/work" "$DIR/run" "$DIR/glusterd.vol" "$DIR/glusterd.pid" "$ENVFILE" "$STATE"
    fi
    log "down in $(since "$t0") s (unmounted at $t_umount s, volume stopped and deleted at $t_stop s, daemons gone at $t_daemons s; $DIR; logs kept in $LOGDIR)"
}

status() {
    is_up || { log "not up under $DIR"; exit 1; }
    env_lines
}

"$CMD"
