#!/usr/bin/env bash
# A local base image for infra/Dockerfile where no registry on the internet can be reached (so
# `FROM python:3.11-slim` cannot be pulled) but Debian's packages can: debootstrap a minimal
# Debian with Python 3.11, then `docker import` it.
#
# Usage: infra/docker/base-image.sh       prints the image's name, e.g. mllm-base:bookworm-3f2a9c01d4e5
#
# The tag is a digest of everything that goes into it (this script's commands, the suite, the mirror,
# the packages), so a second call finds the image and returns at once. Needs root (debootstrap)
# and about 40 s and 150 MB the first time.
set -euo pipefail
SUITE=${BASE_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python3-venv: the image installs into a venv (Debian's python is externally managed);
# git: runs record their commit when they can; tini: signals reach the flow run;
# ca-certificates: pip over HTTPS.
PACKAGES=python3,python3-venv,git,tini,ca-certificates
# Comments aside, this script is the recipe: its lines and the settings make the digest.
digest=$( { grep -v "^[[:space:]]*#" "$0"; echo "$SUITE $MIRROR $PACKAGES"; } | sha256sum | cut -c1-12)
name="mllm-base:${SUITE}-${digest}"
if docker image inspect "$name" >/dev/null 2>&1; then
    echo "$name"; exit 0
fi
command -v debootstrap >/dev/null || { echo "base-image: debootstrap missing (apt-get install debootstrap, or run infra/docker/setup.sh as root)" >&2; exit 1; }
root=$(mktemp -d /tmp/mllm-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base-image: debootstrap $SUITE ($PACKAGES) into $root" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# What a base image does not need: package lists and caches.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase --include=$PACKAGES $SUITE $MIRROR" - "$name" >/dev/null
echo "$name"
