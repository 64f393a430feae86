#!/usr/bin/env bash
# Entry point of a Prefect flow-run Job on Kubernetes: base-job-template.json makes this the
# container's command, and Prefect's flow-run command (`python -m prefect.engine`) its args.
#
# Why a wrapper: the flow run is a Ray driver (hybridrl connects with
# `ray.init(address=RAY_ADDRESS)`, the head's GCS address HOST:6379), and a Ray 2.60 driver
# attaches through a raylet on its own machine: with none running in the pod, ray.init waits
# for one and then fails. So the pod first joins the cluster as a node that offers no CPUs
# and no GPUs (no pool worker is ever placed on it), then runs the command.
#
# Signals: the kubelet sends SIGTERM to this process (PID 1) when the Job is deleted (a
# cancellation) or the node is drained. It is passed on to the command, so that hybridrl's
# train flow ends in state "Preempted" (or "Cancelled") with every committed stage kept, and
# the deployment's trigger resumes it. When the command ends, the node leaves the cluster.
# Without RAY_ADDRESS (a flow that needs no Ray, e.g. evaluate) the command runs alone.
set -euo pipefail

if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [ARG...]   (Prefect passes its flow-run command)" >&2
  exit 2
fi
# Credentials come from Secrets (base-job-template.json) and are never printed. Ray's token
# authentication: the cluster of ../kuberay/ requires the token (the Secret
# hybridrl-ray-token); token mode unless told otherwise. A missing, empty or placeholder
# token, or an empty or placeholder MLflow password or Prefect auth string, is refused in one
# line before anything starts.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
for var in MLFLOW_TRACKING_PASSWORD PREFECT_API_AUTH_STRING; do
  if [ -n "${!var+set}" ]; then
    case "${!var}" in
      "" | REPLACE-WITH-*)
        echo "join-ray-and-run.sh: $var is empty or the example placeholder: set it in its Secret (k8s/secret-example.yaml)" >&2
        exit 2
        ;;
    esac
  fi
done
joined=false
if [ -n "${RAY_ADDRESS:-}" ]; then
  if [ "$RAY_AUTH_MODE" = token ] && [ ! -s "${RAY_AUTH_TOKEN_PATH:-}" ]; then
    case "${RAY_AUTH_TOKEN:-}" in
      "" | REPLACE-WITH-*)
        echo "join-ray-and-run.sh: RAY_AUTH_MODE=token but RAY_AUTH_TOKEN is empty or the example placeholder: put the cluster's token under the key auth_token of the Secret hybridrl-ray-token (k8s/secret-example.yaml)" >&2
        exit 2
        ;;
    esac
  fi
  # RAY_ADDRESS is the head's GCS address HOST:6379 (not a ray:// client address)
  ray start --address="$RAY_ADDRESS" --num-cpus=0 --num-gpus=0 \
    --object-store-memory="${RAY_DRIVER_OBJECT_STORE_BYTES:-268435456}" \
    --disable-usage-stats
  joined=true
fi

child=0
trap 'if [ "$child" -gt 0 ]; then kill -TERM "$child" 2>/dev/null || true; fi' TERM INT

"$@" &
child=$!
status=0
# A trapped signal interrupts `wait`; wait again until the command has finished its own
# shutdown (hybridrl finishes the commit in progress first), then keep its exit status.
while true; do
  if wait "$child"; then status=0; else status=$?; fi
  kill -0 "$child" 2>/dev/null || break
done

if [ "$joined" = true ]; then
  ray stop >/dev/null 2>&1 || true
fi
exit "$status"
