#!/usr/bin/env bash
# usage: infra/make-env.sh > infra/.env
# The compose stack's passwords (infra/compose.yaml has no defaults and refuses to start without
# them): random, letters and digits only (they go into database URLs), in docker's env-file form.
# Keep the file to yourself (chmod 600 infra/.env); .gitignore keeps it out of git.
set -euo pipefail
if [[ $# -gt 0 ]]; then
  echo "usage: infra/make-env.sh > infra/.env" >&2
  exit 2
fi
secret() {
  local s
  s=$(head -c 64 /dev/urandom | base64 -w0 | tr -dc 'A-Za-z0-9')
  echo "${s:0:$1}"
}
echo "POSTGRES_PASSWORD=$(secret 40)"
echo "MINIO_ROOT_USER=mllm-$(secret 8)"
echo "MINIO_ROOT_PASSWORD=$(secret 40)"
