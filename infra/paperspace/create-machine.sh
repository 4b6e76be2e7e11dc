#!/usr/bin/env bash
# Creates a Paperspace GPU machine that becomes an mllm-pipeline Prefect worker at first boot.
#
#   usage: PAPERSPACE_API_KEY=... TEMPLATE_ID=... infra/paperspace/create-machine.sh NAME
#
# Environment:
#   PAPERSPACE_API_KEY  required; a team API key (console.paperspace.com > team settings > API keys)
#   TEMPLATE_ID         required; the OS template, e.g. ML-in-a-Box or Ubuntu 22.04. List them with
#                       curl -H "Authorization: Bearer $PAPERSPACE_API_KEY" "https://api.paperspace.com/v1/templates?isPublic=true"
#   MACHINE_TYPE        default A4000 (others: A5000, A6000, A100-80G, H100, ...)
#   REGION              default "East Coast (NY2)"; or "West Coast (CA1)", "Europe (AMS1)"
#   DISK_SIZE           default 100 (GB)
#   AUTO_SHUTDOWN_HOURS optional; Paperspace shuts the machine down after this many hours
#   DRY_RUN=1           print the request bodies instead of sending them
#
# Two calls to Paperspace's API (https://api.paperspace.com/v1, Bearer authentication; the
# Gradient jobs API is gone since July 2024, the machines API remains):
#   1. POST /startup-scripts {name, script, isRunOnce}: uploads infra/paperspace/startup.sh
#      (field names from the API reference "Startup Scripts",
#      https://docs.digitalocean.com/reference/paperspace/api-reference/startup-scripts/);
#   2. POST /machines {name, machineType, templateId, diskSize, region, ...}: the five fields
#      of "Create a Machine with the Paperspace API"
#      (https://docs.digitalocean.com/products/paperspace/machines/getting-started/create-machine-with-api/),
#      plus autoShutdownEnabled/autoShutdownTimeout from the same page, and publicIpType,
#      startupScriptId and startOnCreate as SkyPilot's Paperspace client sends them
#      (sky/provision/paperspace/utils.py).
# The startup script holds no secrets: copy /etc/mllm/worker.env to the machine afterwards
# (infra/README.md, "Paperspace"). This script never prints the API key.
set -euo pipefail

usage() { sed -n '2,16p' "$0" >&2; exit 2; }
die() { echo "create-machine.sh: $*" >&2; exit 1; }

[[ $# -eq 1 && $1 != -h && $1 != --help ]] || usage
NAME=$1
[[ -n ${PAPERSPACE_API_KEY:-} || -n ${DRY_RUN:-} ]] || die "PAPERSPACE_API_KEY is not set"
[[ -n ${TEMPLATE_ID:-} ]] || die "TEMPLATE_ID is not set (list the OS templates: see the usage above)"
MACHINE_TYPE=${MACHINE_TYPE:-A4000}
REGION=${REGION:-East Coast (NY2)}
DISK_SIZE=${DISK_SIZE:-100}
[[ $DISK_SIZE =~ ^[0-9]+$ ]] || die "DISK_SIZE must be a number of GB, not '$DISK_SIZE'"
[[ -z ${AUTO_SHUTDOWN_HOURS:-} || $AUTO_SHUTDOWN_HOURS =~ ^[0-9]+$ ]] || die "AUTO_SHUTDOWN_HOURS must be a whole number"
command -v python3 >/dev/null || die "python3 is needed to build and read JSON"
command -v curl >/dev/null || die "curl is needed"

API=https://api.paperspace.com/v1
STARTUP=$(dirname "$0")/startup.sh
[[ -r $STARTUP ]] || die "cannot read $STARTUP"

# JSON built by python from the environment, never by pasting strings into JSON.
script_body() {
    SCRIPT_FILE=$STARTUP SCRIPT_NAME="mllm-worker-$NAME" python3 -c '
import json, os
print(json.dumps({"name": os.environ["SCRIPT_NAME"],
                  "script": open(os.environ["SCRIPT_FILE"]).read(),
                  "isRunOnce": True}))'
}
machine_body() {
    M_NAME=$NAME M_TYPE=$MACHINE_TYPE M_TEMPLATE=$TEMPLATE_ID M_REGION=$REGION M_DISK=$DISK_SIZE \
    M_SCRIPT=$1 M_SHUTDOWN=${AUTO_SHUTDOWN_HOURS:-} python3 -c '
import json, os
e = os.environ
body = {"name": e["M_NAME"], "machineType": e["M_TYPE"], "templateId": e["M_TEMPLATE"],
        "diskSize": int(e["M_DISK"]), "region": e["M_REGION"], "publicIpType": "dynamic",
        "startupScriptId": e["M_SCRIPT"], "startOnCreate": True}
if e["M_SHUTDOWN"]:
    body.update(autoShutdownEnabled=True, autoShutdownTimeout=int(e["M_SHUTDOWN"]))
print(json.dumps(body))'
}
# POST $1 with body on stdin; the Authorization header comes from a file descriptor, so the
# key appears neither in the output nor in the process list.
post() {
    curl -sS --fail-with-body -X POST "$API/$1" \
        -H @<(printf 'Authorization: Bearer %s\n' "$PAPERSPACE_API_KEY") \
        -H 'Content-Type: application/json' --data-binary @-
}
field() { python3 -c 'import json, sys; d = json.load(sys.stdin); d = d.get("data", d); print(d[sys.argv[1]])' "$1"; }

if [[ -n ${DRY_RUN:-} ]]; then
    echo "POST $API/startup-scripts"; script_body | python3 -c 'import json,sys; d=json.load(sys.stdin); d["script"]="<%d bytes of startup.sh>" % len(d["script"]); print(json.dumps(d))'
    echo "POST $API/machines"; machine_body "<startup script id>"
    exit 0
fi

script_id=$(script_body | post startup-scripts | field id) || die "could not create the startup script"
echo "startup script: $script_id"
response=$(machine_body "$script_id" | post machines) || die "could not create the machine: $response"
machine_id=$(printf '%s' "$response" | field id)
echo "machine: $machine_id ($MACHINE_TYPE, $REGION). It bills by the hour from now until it is stopped."
echo "Next: copy your worker.env to /etc/mllm/worker.env on it (infra/README.md, Paperspace)."
