#!/usr/bin/env bash
# Entrypoint of the distamp image: `docker run IMAGE [LAUNCH_OPTIONS...] SCRIPT [ARGS...]` runs
# `distamp launch LAUNCH_OPTIONS... SCRIPT ARGS...`, e.g.
#     docker run ... IMAGE --nproc-per-node 8 /opt/distamp/launch/train.py --out /checkpoints/run1
# A first argument that is a program (bash, python, torchrun, mpirun, distamp, ...) runs as given,
# for `docker run -it IMAGE bash` and for launchers that start the ranks themselves.
# `exec` replaces this shell, so signals (docker stop's SIGTERM, SLURM's SIGUSR1) reach the
# launcher directly and its exit status is the container's.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    exec distamp launch --help
fi
case "$1" in
    -*) ;;  # an option of distamp launch
    *.py) ;;  # a script: launch it
    *)
        if command -v "$1" >/dev/null 2>&1; then
            exec "$@"
        fi
        ;;
esac
exec distamp launch "$@"
