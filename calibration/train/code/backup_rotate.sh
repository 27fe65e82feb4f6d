#!/usr/bin/env bash
#
# backup_rotate.sh - make a compressed, dated backup of a directory and keep
# only a limited number of daily, weekly and monthly copies.
#
# Usage:
#   backup_rotate.sh [-n] [-d DAYS] [-w WEEKS] [-m MONTHS] SOURCE_DIR DEST_DIR
#
#   -n   dry run: print what would be done without changing anything
#   -d   daily backups to keep   (default 7)
#   -w   weekly backups to keep  (default 4, taken on Sundays)
#   -m   monthly backups to keep (default 6, taken on the 1st)
#
# Intended to run once a day from cron, for example:
#   15 2 * * *  /usr/local/bin/backup_rotate.sh /srv/app/data /mnt/backup/app

set -euo pipefail

KEEP_DAILY=7
KEEP_WEEKLY=4
KEEP_MONTHLY=6
DRY_RUN=0

log() {
    printf '%s [%s] %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$1" "$2" >&2
}

die() {
    log ERROR "$1"
    exit 1
}

usage() {
    sed -n '3,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

run() {
    if (( DRY_RUN )); then
        log DRY "$*"
    else
        "$@"
    fi
}

while getopts ':nd:w:m:h' opt; do
    case "$opt" in
        n) DRY_RUN=1 ;;
        d) KEEP_DAILY=$OPTARG ;;
        w) KEEP_WEEKLY=$OPTARG ;;
        m) KEEP_MONTHLY=$OPTARG ;;
        h) usage ;;
        :) die "option -$OPTARG needs a value" ;;
        *) die "unknown option -$OPTARG" ;;
    esac
done
shift $((OPTIND - 1))

[[ $# -eq 2 ]] || usage
SOURCE=$(realpath "$1")
DEST=$2

[[ -d "$SOURCE" ]] || die "source '$SOURCE' is not a directory"
for n in "$KEEP_DAILY" "$KEEP_WEEKLY" "$KEEP_MONTHLY"; do
    [[ "$n" =~ ^[0-9]+$ ]] || die "retention counts must be whole numbers, got '$n'"
done

# Refuse to run twice at the same time; a slow backup plus a retried cron
# job once filled the disk with half-written archives.
LOCK="/tmp/backup_rotate.$(basename "$SOURCE").lock"
exec 9>"$LOCK"
flock -n 9 || die "another backup of $SOURCE is already running"

run mkdir -p "$DEST/daily" "$DEST/weekly" "$DEST/monthly"

STAMP=$(date '+%Y%m%d-%H%M%S')
NAME="$(basename "$SOURCE")-$STAMP.tar.gz"
TMP="$DEST/daily/.$NAME.partial"

log INFO "archiving $SOURCE"
if (( ! DRY_RUN )); then
    # Write to a temporary name first so an interrupted run never leaves a
    # file that looks like a complete backup.
    tar --create --gzip --file "$TMP" \
        --directory "$(dirname "$SOURCE")" \
        --exclude='*.tmp' --exclude='.cache' \
        "$(basename "$SOURCE")"
    mv "$TMP" "$DEST/daily/$NAME"
    SIZE=$(du -h "$DEST/daily/$NAME" | cut -f1)
    log INFO "created daily/$NAME ($SIZE)"
fi

# Promote today's archive to weekly/monthly using hard links, which cost no
# extra space on the same filesystem.
if [[ $(date +%u) -eq 7 ]]; then
    run ln -f "$DEST/daily/$NAME" "$DEST/weekly/$NAME"
fi
if [[ $(date +%d) -eq 01 ]]; then
    run ln -f "$DEST/daily/$NAME" "$DEST/monthly/$NAME"
fi

prune() {
    local dir=$1 keep=$2
    local -a files
    mapfile -t files < <(ls -1t "$dir"/*.tar.gz 2>/dev/null || true)
    local count=${#files[@]}
    if (( count <= keep )); then
        log INFO "$(basename "$dir"): $count archive(s), nothing to prune"
        return
    fi
    for old in "${files[@]:keep}"; do
        log INFO "removing $(basename "$dir")/$(basename "$old")"
        run rm -f -- "$old"
    done
}

prune "$DEST/daily" "$KEEP_DAILY"
prune "$DEST/weekly" "$KEEP_WEEKLY"
prune "$DEST/monthly" "$KEEP_MONTHLY"

FREE=$(df -P "$DEST" | awk 'NR==2 {print $4}')
if (( FREE < 1048576 )); then
    log WARN "less than 1 GiB free on backup volume ($((FREE / 1024)) MiB)"
fi

log INFO "done"
