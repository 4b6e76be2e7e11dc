#!/usr/bin/env bash
# Build the training image from a checkout at its commit, and push it to a registry.
#
# Usage: infra/docker/build-image.sh [--local-base] [--torch-wheel WHEEL] [--push REGISTRY] [--no-cache] [CONTEXT]
#
#   CONTEXT        the checkout to build (default: this repository); GIT_COMMIT is its HEAD
#   --local-base   FROM the image infra/docker/base-image.sh makes (debootstrap), for machines
#                  that cannot pull python:3.11-slim; else BASE_IMAGE (default python:3.11-slim)
#   --torch-wheel  a torch wheel to install instead of PyPI's (e.g. the CPU build
#                  /opt/wheels/torch-2.13.0+cpu-...whl); it is used at build time only
#   --push R       also tag it R/mllm-pipeline:<commit> (R: host:port of a registry) and push it
#   --no-cache     build every layer again (what a first build on a new machine costs)
#
# Prints the image's name last (the registry's when pushed). Layers are cached by Docker: a
# second build of the same commit takes seconds, a new commit rebuilds only the project layers.
# Builds run with --network host so that pip reaches the package index (and, through a
# TLS-inspecting proxy, with the CA bundle pip is configured with: `pip config get global.cert`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
context=$(cd "$here/../.." && pwd)
local_base=0; wheel=""; registry=""; no_cache=()
while (($#)); do
    case $1 in
        --local-base) local_base=1 ;;
        --torch-wheel) wheel=$2; shift ;;
        --push) registry=$2; shift ;;
        --no-cache) no_cache=(--no-cache) ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "build-image: unknown option $1" >&2; exit 2 ;;
        *) context=$(cd "$1" && pwd) ;;
    esac
    shift
done
say() { echo "build-image: $*" >&2; }

commit=$(git -C "$context" rev-parse HEAD)
[[ -z $(git -C "$context" status --porcelain --untracked-files=no) ]] \
    || say "warning: $context has uncommitted changes; the image holds them but says commit $commit"
base=${BASE_IMAGE:-python:3.11-slim}
((local_base)) && base=$("$here/base-image.sh")

# The Dockerfile needs BuildKit (RUN --mount). A client that has the buildx plugin uses it; a
# client older than 23.0 has it built in. Debian's docker.io ships such a CLI, which may be
# behind a newer one without buildx on PATH.
buildkit_docker() {
    local d
    for d in $(type -ap docker); do
        "$d" buildx version >/dev/null 2>&1 && { echo "$d"; return; }
        local major; major=$("$d" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
        [[ $major =~ ^[0-9]+$ ]] && ((major < 23)) && { echo "$d"; return; }
    done
    return 1
}
docker_bin=$(buildkit_docker) \
    || { say "no docker client here builds with BuildKit: install the docker-buildx plugin"; exit 2; }

# Build-only inputs, bind-mounted into the RUNs that install: a torch wheel, the CA bundle.
# Not in git, not in the image.
stage="$context/infra/docker/local"
mkdir -p "$stage"
rm -rf "$stage/wheels" "$stage/ca.crt"
if [[ -n $wheel ]]; then
    [[ -f $wheel ]] || { say "no wheel at $wheel"; exit 2; }
    mkdir -p "$stage/wheels" && cp "$wheel" "$stage/wheels/"
fi
cert=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
[[ -n $cert && -f $cert ]] && cp "$cert" "$stage/ca.crt"

tag="mllm-pipeline:${commit:0:12}"
say "building $tag from $context (base $base, commit $commit)"
start=$SECONDS
DOCKER_BUILDKIT=1 "$docker_bin" build "${no_cache[@]}" --progress plain --network host -f "$context/infra/Dockerfile" \
    --build-arg BASE="$base" --build-arg GIT_COMMIT="$commit" -t "$tag" "$context" >&2
rm -rf "$stage/wheels" "$stage/ca.crt"
say "built $tag in $((SECONDS - start)) s"
if [[ -n $registry ]]; then
    remote="$registry/$tag"
    docker tag "$tag" "$remote"
    docker push "$remote" >/dev/null
    say "pushed $remote"
    tag=$remote
fi
echo "$tag"
