#!/usr/bin/env bash
# A Docker engine and an image registry on this machine, for the docker work pool and its tests.
#
# Usage: sudo infra/docker/setup.sh   (or `make docker-setup`)
#
# Reuses an engine that already answers. Otherwise, as root on Debian/Ubuntu: installs docker.io
# (dockerd), docker-registry (the Distribution 2.8 server) and debootstrap (which makes the
# local base image, infra/docker/base-image.sh) from the distribution's packages, starts dockerd
# in the background (log: /var/log/mllm-dockerd.log) and a registry on 127.0.0.1:$REGISTRY_PORT
# (default 5001; storage in /var/lib/mllm-registry). Docker trusts registries on 127.0.0.0/8
# over plain HTTP, so no TLS is needed for a loopback one.
# The tests start a registry of their own (the same binary) on a free port; the one started
# here is for pushing images by hand: docker push 127.0.0.1:5001/mllm-pipeline:TAG.
set -euo pipefail
REGISTRY_PORT=${REGISTRY_PORT:-5001}
say() { echo "docker-setup: $*" >&2; }

engine_answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }
registry_answers() {  # python3 rather than curl, which a minimal machine may lack
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${REGISTRY_PORT}/v2/', timeout=2)" 2>/dev/null
}

need=()
command -v dockerd >/dev/null 2>&1 || engine_answers || need+=(docker.io)
command -v docker-registry >/dev/null 2>&1 || need+=(docker-registry)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if ((${#need[@]})); then
    if [[ $(id -u) != 0 ]]; then
        say "missing ${need[*]}: run this script as root (it installs them with apt-get)"; exit 1
    fi
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # apt on a busy mirror: a few tries rather than a failed CI run.
    for try in 1 2 3; do
        if apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; then
            break
        fi
        [[ $try == 3 ]] && { say "apt-get failed three times"; exit 1; }
        sleep $((try * 10))
    done
fi
# The docker.io package ships a CLI too; a newer one already on PATH is kept (it speaks the
# daemon's older API version).

if engine_answers; then
    say "engine answers: $(docker version --format 'server {{.Server.Version}}, api {{.Server.APIVersion}}')"
else
    [[ $(id -u) == 0 ]] || { say "no Docker engine answers and only root can start one"; exit 1; }
    say "starting dockerd (log: /var/log/mllm-dockerd.log)"
    # setsid: the daemon outlives this script and the CI step that ran it.
    setsid dockerd >/var/log/mllm-dockerd.log 2>&1 < /dev/null &
    for _ in $(seq 60); do engine_answers && break; sleep 1; done
    engine_answers || { say "dockerd did not answer within 60 s:"; tail -20 /var/log/mllm-dockerd.log >&2; exit 1; }
    say "engine answers: $(docker version --format 'server {{.Server.Version}}, api {{.Server.APIVersion}}')"
fi

if registry_answers; then
    say "registry answers on 127.0.0.1:${REGISTRY_PORT}"
elif [[ $(id -u) == 0 ]]; then
    mkdir -p /var/lib/mllm-registry
    cat > /etc/mllm-registry.yml <<YAML
version: 0.1
storage:
  filesystem:
    rootdirectory: /var/lib/mllm-registry
http:
  addr: 127.0.0.1:${REGISTRY_PORT}
YAML
    setsid docker-registry serve /etc/mllm-registry.yml >/var/log/mllm-registry.log 2>&1 < /dev/null &
    for _ in $(seq 30); do registry_answers && break; sleep 1; done
    registry_answers || { say "registry did not start:"; tail -20 /var/log/mllm-registry.log >&2; exit 1; }
    say "registry answers on 127.0.0.1:${REGISTRY_PORT}"
fi
