#!/usr/bin/env bash
# Turns a fresh Paperspace GPU machine (ML-in-a-Box or plain Ubuntu 22.04) into a Prefect worker
# for mllm-pipeline, run as root by Paperspace at first boot (create-machine.sh registers it as
# the machine's startup script), or by hand:
#
#   usage: sudo bash startup.sh
#
# It installs Docker and the NVIDIA Container Toolkit when missing, and a systemd service,
# mllm-worker, that runs the project's image (infra/Dockerfile) with every GPU of the machine:
#   docker run --gpus all --env-file /etc/mllm/worker.env IMAGE prefect worker start --pool POOL --type process
# Flow runs execute as processes inside that container. systemd restarts the worker when it
# stops and starts it again after a reboot.
#
# Settings and secrets live in /etc/mllm/worker.env (root only, mode 600), which this script
# never prints and never writes secrets into: copy yours there (see worker.env.example, written
# next to it). A path unit starts the worker as soon as the file exists.
set -euo pipefail

ENV_DIR=/etc/mllm
ENV_FILE=$ENV_DIR/worker.env
RUNNER=/usr/local/bin/mllm-worker-run

die() { echo "startup.sh: $*" >&2; exit 1; }
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,20p' "$0"; exit 0; }
[[ $(id -u) -eq 0 ]] || die "run as root (sudo bash $0)"
command -v nvidia-smi >/dev/null || die "no nvidia-smi: this is not a GPU machine, or its NVIDIA driver is missing"

export DEBIAN_FRONTEND=noninteractive

if ! command -v docker >/dev/null; then
    echo "startup.sh: installing Docker"
    apt-get update -q
    apt-get install -y -q docker.io
    systemctl enable --now docker
fi

if ! command -v nvidia-ctk >/dev/null; then
    # NVIDIA's documented apt repository for the Container Toolkit.
    echo "startup.sh: installing the NVIDIA Container Toolkit"
    apt-get install -y -q curl gpg
    curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey \
        | gpg --dearmor --yes -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
    curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
        | sed 's#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#' \
        > /etc/apt/sources.list.d/nvidia-container-toolkit.list
    apt-get update -q
    apt-get install -y -q nvidia-container-toolkit
fi
if ! docker info 2>/dev/null | grep -qi 'runtimes:.*nvidia'; then
    nvidia-ctk runtime configure --runtime=docker
    systemctl restart docker
fi

install -d -m 700 "$ENV_DIR"
cat > "$ENV_DIR/worker.env.example" <<'ENV'
# /etc/mllm/worker.env: KEY=VALUE lines, no quotes, no spaces around '=' (docker --env-file format).
# Required:
MLLM_IMAGE=registry.example.com/mllm-pipeline:latest
PREFECT_API_URL=https://prefect.example.com/api
# Optional:
PREFECT_WORK_POOL=gpu-process
# PREFECT_API_KEY=...                 (Prefect Cloud)
# A secured stack: all of this from `mllm-pipeline stack worker-env --user NAME --ca-path /etc/mllm/ca.pem`,
# its CA copied to /etc/mllm/ca.pem (docs/team-stack.md).
MLFLOW_TRACKING_URI=https://mlflow.example.com
MLLM_STORAGE=s3://my-bucket/mllm
# AWS_ACCESS_KEY_ID=...
# AWS_SECRET_ACCESS_KEY=...
# AWS_ENDPOINT_URL=https://s3.example.com   (S3-compatible storage other than AWS)
ENV
chmod 600 "$ENV_DIR/worker.env.example"

# The runner reads two settings from the env file without sourcing it (nothing in it is
# executed or echoed) and hands the whole file to docker, which passes it to the worker.
cat > "$RUNNER" <<'RUN'
#!/usr/bin/env bash
set -euo pipefail
ENV_FILE=/etc/mllm/worker.env
setting() { sed -n "s/^$1=//p" "$ENV_FILE" | tail -n 1; }
[[ -r $ENV_FILE ]] || { echo "mllm-worker: $ENV_FILE is missing" >&2; exit 1; }
image=$(setting MLLM_IMAGE)
pool=$(setting PREFECT_WORK_POOL)
[[ -n $image ]] || { echo "mllm-worker: set MLLM_IMAGE in $ENV_FILE" >&2; exit 1; }
[[ -n $(setting PREFECT_API_URL) ]] || { echo "mllm-worker: set PREFECT_API_URL in $ENV_FILE" >&2; exit 1; }
# A secured stack's CA (`stack worker-env --ca-path /etc/mllm/ca.pem`), read-only in the container.
ca=()
[[ -r /etc/mllm/ca.pem ]] && ca=(-v /etc/mllm/ca.pem:/etc/mllm/ca.pem:ro)
docker rm -f mllm-worker >/dev/null 2>&1 || true
docker pull -q "$image" >/dev/null || echo "mllm-worker: could not pull $image, using the local copy" >&2
exec docker run --rm --name mllm-worker --gpus all --shm-size 8g --network host \
    --env-file "$ENV_FILE" "${ca[@]}" "$image" \
    prefect worker start --pool "${pool:-gpu-process}" --type process --name "$(hostname)"
RUN
chmod 755 "$RUNNER"

cat > /etc/systemd/system/mllm-worker.service <<UNIT
[Unit]
Description=mllm-pipeline Prefect worker (GPU, in Docker)
After=docker.service network-online.target
Wants=network-online.target
Requires=docker.service
ConditionPathExists=$ENV_FILE

[Service]
ExecStart=$RUNNER
ExecStop=/usr/bin/docker stop -t 60 mllm-worker
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target
UNIT

cat > /etc/systemd/system/mllm-worker.path <<UNIT
[Unit]
Description=Start the mllm-pipeline worker once $ENV_FILE exists

[Path]
PathExists=$ENV_FILE
Unit=mllm-worker.service

[Install]
WantedBy=multi-user.target
UNIT

systemctl daemon-reload
systemctl enable mllm-worker.service mllm-worker.path
systemctl start mllm-worker.path
if [[ -f $ENV_FILE ]]; then
    chmod 600 "$ENV_FILE"
    systemctl restart mllm-worker.service
    echo "startup.sh: worker started (journalctl -u mllm-worker -f)"
else
    echo "startup.sh: worker installed; it starts once $ENV_FILE exists (see $ENV_DIR/worker.env.example)"
fi
