#!/bin/sh
# The m27 image's entrypoint (deploy/Dockerfile; docs/deploy.md).
#
#   IMAGE orchestrator [FLAGS]      python -m m27.orchestrator [FLAGS]; likewise scheduler,
#                                   node-agent, checkpoint-store, report, telegram
#   IMAGE health [--live] [ADDRESS | URL]
#                                   exit 0 when the gRPC server at ADDRESS (default
#                                   $M27_GRPC_ADDRESS) says SERVING (ready; --live:
#                                   alive, ready or not), or URL answers 200
#   IMAGE m27 ... | nats-server ... | any other command: run as given
#
# Secrets: m27 reads an nkey seed, an API key or a token file only while nobody but its
# owner can read it (docs/security.md). Mounted secrets rarely look like that (Kubernetes
# makes them group-readable for fsGroup; compose bind-mounts the host's file), so with
# M27_SECRETS_FROM=DIR[:DIR...] every file in those directories is first copied into
# M27_SECRETS_DIR (default /run/m27/secrets, mode 0700) as a 0600 file of this user
# (before a service or a command; not for `health`, which probes run again and again).
set -eu

here=$(dirname "$0")

usage() {
    cat <<'EOF'
usage: IMAGE SERVICE [FLAGS]   orchestrator | scheduler | node-agent | checkpoint-store |
                               report | telegram  (python -m m27.<service> FLAGS)
       IMAGE health [--live] [HOST:PORT | http://...]
                               gRPC health (ready; --live: alive) or an HTTP 200
       IMAGE m27 ARGS          the m27 command (m27 bus setup, m27 api token create, ...)
       IMAGE nats-server ARGS  the nats-server the m27 wheel ships
EOF
}

copy_secrets() {
    dest=${M27_SECRETS_DIR:-/run/m27/secrets}
    umask 077
    mkdir -p "$dest"
    chmod 700 "$dest"
    rest=$M27_SECRETS_FROM
    while [ -n "$rest" ]; do
        src=${rest%%:*}
        case $rest in *:*) rest=${rest#*:} ;; *) rest= ;; esac
        [ -n "$src" ] || continue
        if [ ! -d "$src" ]; then
            echo "m27-entrypoint: M27_SECRETS_FROM names $src, which is not a directory" >&2
            exit 2
        fi
        # Kubernetes secret volumes hold links into a hidden ..data directory: the glob
        # skips dot names, and -f follows the links to the files.
        for file in "$src"/*; do
            [ -f "$file" ] || continue
            name=$(basename "$file")
            tmp="$dest/.$name.$$.tmp"
            cp "$file" "$tmp"
            chmod 600 "$tmp"
            mv -f "$tmp" "$dest/$name"
        done
    done
}

case ${1:-} in
    health | "" | help | -h | --help) ;;
    *) if [ -n "${M27_SECRETS_FROM:-}" ]; then copy_secrets; fi ;;
esac

case ${1:-} in
    orchestrator | scheduler | report | telegram) module=$1 ;;
    node-agent | node_agent) module=node_agent ;;
    checkpoint-store | checkpoint_store) module=checkpoint_store ;;
    health)
        shift
        exec python "$here/health.py" "$@"
        ;;
    "" | help | -h | --help)
        usage
        exit 0
        ;;
    *) exec "$@" ;;
esac
shift
exec python -m "m27.$module" "$@"
