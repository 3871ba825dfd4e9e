#!/usr/bin/env bash
# A bandwidth-limited filesystem for benchmarks: ext4 on a loop device whose reads a block-IO
# cgroup caps at a fixed rate, standing for a pool whose bandwidth is the bottleneck.
#
#   scripts/slowdisk.sh up DIR [MBPS]   # MBPS: read limit in MB/s (10^6 bytes), default 200
#   scripts/slowdisk.sh down DIR
#
# `up` makes DIR/img (8 GiB, sparse), attaches it to a free loop device, formats it, mounts it
# on DIR/mnt and makes a cgroup that limits reads from that device: cgroup v2 `io.max` where the
# io controller is enabled, else cgroup v1 `blkio.throttle.read_bps_device`. Only processes in
# that cgroup are limited, and only on that device. It prints `export` lines (also written to
# DIR/slowdisk.env):
#   KVTIER_SLOW_MOUNT   the mount point
#   KVTIER_SLOW_PROCS   the cgroup's cgroup.procs: write a pid there to limit it and its children
# Reads are limited at the block layer, so a page-cache hit is not: drop the page cache
# (`echo 3 > /proc/sys/vm/drop_caches`) before each cold read. Writes are not limited.
# Needs root and a loop device.
set -euo pipefail

log() { echo "slowdisk.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $# -ge 2 ]] || die "usage: $0 up DIR [MBPS] | down DIR"
cmd=$1; dir=$(realpath -m "$2"); mbps=${3:-200}
name="kvtier-slow-$(echo -n "$dir" | md5sum | cut -c1-8)"

cgroup_dir() {
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw io /sys/fs/cgroup/cgroup.controllers; then
    echo "/sys/fs/cgroup/$name"
  elif [[ -d /sys/fs/cgroup/blkio ]]; then
    echo "/sys/fs/cgroup/blkio/$name"
  else
    die "no cgroup v2 io controller and no cgroup v1 blkio hierarchy"
  fi
}

up() {
  [[ $EUID -eq 0 ]] || die "needs root"
  [[ "$mbps" =~ ^[0-9]+$ && "$mbps" -gt 0 ]] || die "MBPS must be a positive integer, got '$mbps'"
  mkdir -p "$dir/mnt"
  if ! mountpoint -q "$dir/mnt"; then
    truncate -s 8G "$dir/img"
    local loop; loop=$(losetup -f --show "$dir/img")
    mkfs.ext4 -q -F "$loop"
    mount "$loop" "$dir/mnt"
  fi
  local dev; dev=$(findmnt -no SOURCE "$dir/mnt")
  local majmin; majmin=$(lsblk -no MAJ:MIN "$dev" | tr -d ' ')
  local cg; cg=$(cgroup_dir)
  mkdir -p "$cg"
  local bps=$((mbps * 1000000))
  if [[ -f "$cg/io.max" ]]; then
    grep -qw io "$(dirname "$cg")/cgroup.subtree_control" || echo +io > "$(dirname "$cg")/cgroup.subtree_control"
    echo "$majmin rbps=$bps" > "$cg/io.max"
  else
    echo "$majmin $bps" > "$cg/blkio.throttle.read_bps_device"
  fi
  log "$dev ($majmin) on $dir/mnt, reads limited to $mbps MB/s for processes in $cg"
  printf 'export KVTIER_SLOW_MOUNT=%q\nexport KVTIER_SLOW_PROCS=%q\n' "$dir/mnt" "$cg/cgroup.procs" \
    | tee "$dir/slowdisk.env"
}

down() {
  if mountpoint -q "$dir/mnt"; then
    local dev; dev=$(findmnt -no SOURCE "$dir/mnt")
    umount "$dir/mnt"
    losetup -d "$dev" 2>/dev/null || true
  fi
  local cg; cg=$(cgroup_dir)
  if [[ -d "$cg" ]]; then
    # a cgroup with processes cannot go: move them back to the root first
    while read -r pid; do echo "$pid" > "$(dirname "$cg")/cgroup.procs" 2>/dev/null || true; done < "$cg/cgroup.procs"
    rmdir "$cg"
  fi
  rm -rf "$dir"
  log "down: $dir"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  *) die "unknown command '$cmd' (up, down)" ;;
esac
