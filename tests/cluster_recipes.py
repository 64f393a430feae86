"""What the tests of deployments/cluster/ share: the recipe's files, read, and the rules its
credentials follow (test_cluster_recipes.py, test_cluster_auth.py, test_cluster_auth_runs.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import kubernetes_validate
import yaml

ROOT = Path(__file__).parents[1]
CLUSTER = ROOT / "deployments" / "cluster"
BIN = Path(sys.executable).parent
# the oldest Kubernetes minor still widely run, and the newest the validator knows
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CRD_SCHEMA = CLUSTER / "kuberay" / "raycluster-crd-v1.7.0.schema.json"
RAYCLUSTERS = sorted((CLUSTER / "kuberay").glob("raycluster-*.yaml"))
CORE_FILES = sorted((CLUSTER / "k8s").glob("*.yaml"))
IMAGE_HOME = "/opt/hybridrl"  # WORKDIR of the Dockerfile, where the image holds the checkout
# the Secrets of k8s/secret-example.yaml that hold the recipe's credentials
RAY_TOKEN_SECRET = "hybridrl-ray-token"
MLFLOW_SECRET = "hybridrl-mlflow-auth"
PREFECT_SECRET = "hybridrl-prefect-auth"
PLACEHOLDER = "REPLACE-WITH-"  # how the example Secrets' values begin


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s_valid(doc: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def as_pod_template(template: dict, name: str) -> dict:
    """A pod template (PodTemplateSpec) as the core/v1 object that holds one."""
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name},
        "template": template,
    }


def group_templates(cluster: dict) -> list[tuple[str, dict]]:
    spec = cluster["spec"]
    return [("head", spec["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])
    ]


def prefect_yaml() -> dict:
    return yaml.safe_load((CLUSTER / "prefect" / "prefect.yaml").read_text())


def base_job_template() -> dict:
    return json.loads((CLUSTER / "prefect" / "base-job-template.json").read_text())


class NoServer:
    """A Prefect client that refuses every call: rendering needs no server."""

    def __getattr__(self, name):
        raise AssertionError(f"the rendering called the Prefect API ({name})")


DEPLOYMENTS = [d["name"] for d in prefect_yaml()["deployments"]]


def deployment(name: str) -> dict:
    return next(d for d in prefect_yaml()["deployments"] if d["name"] == name)


# Credentials: never a literal value in a recipe, only a reference to a Secret.
CREDENTIALS = {
    "RAY_AUTH_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_AUTH_ADMIN_USERNAME",
    "MLFLOW_AUTH_ADMIN_PASSWORD",
    "MLFLOW_FLASK_SERVER_SECRET_KEY",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_API_KEY",
    "PREFECT_SERVER_API_AUTH_STRING",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
}
WORKER_SECRET_SETTINGS = "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_"


def containers_of(doc: dict) -> list[dict]:
    if doc["kind"] == "RayCluster":
        return [c for _, t in group_templates(doc) for c in t["spec"]["containers"]]
    if doc["kind"] in ("Deployment", "Job"):
        return doc["spec"]["template"]["spec"]["containers"]
    return []


def from_secret(container: dict, name: str) -> tuple[str, str] | None:
    """(Secret, key) when the variable is set once, from a required secretKeyRef (no literal
    value, not optional: Kubernetes refuses to start the container without it); else None."""
    entries = [e for e in container.get("env", []) if e["name"] == name]
    if len(entries) != 1 or "value" in entries[0]:
        return None
    ref = entries[0].get("valueFrom", {}).get("secretKeyRef")
    if ref is None or ref.get("optional", False):
        return None
    return ref["name"], ref["key"]


def env_values(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any credential, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIALS and k != "RAY_AUTH_MODE"}
    return {**env, **extra}
