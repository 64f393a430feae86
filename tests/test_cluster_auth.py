"""Authentication in the cluster recipe, checked on the files and on the Job the Prefect
worker makes (prefect-kubernetes' own code, its Kubernetes API a stand-in that keeps what it
is sent): no Ray, MLflow or Prefect endpoint runs without authentication, every credential
comes from a Secret (never a literal, a deployment's parameters or the config), and every
Secret a container needs is in the example file."""

from __future__ import annotations

import asyncio
import copy
import json
import uuid

import pytest
from cluster_recipes import (
    CLUSTER,
    CORE_FILES,
    CREDENTIALS,
    DEPLOYMENTS,
    MLFLOW_SECRET,
    PREFECT_SECRET,
    RAY_TOKEN_SECRET,
    RAYCLUSTERS,
    WORKER_SECRET_SETTINGS,
    NoServer,
    base_job_template,
    containers_of,
    deployment,
    documents,
    env_values,
    from_secret,
)


def auth_problems(doc: dict) -> list[str]:
    """Why this recipe object would run a Ray, MLflow or Prefect endpoint, or a client of one,
    without authentication, or hold a credential as a literal value; [] when it does not.
    RayClusters: token auth with the Secret hybridrl-ray-token, in the spec and every
    container. Flow-run Jobs: a Ray driver, an MLflow client and a Prefect client, each with
    its credentials from a Secret. The MLflow server: the basic-auth app, its admin from a
    Secret. The Prefect worker: a client, which hands its auth string on by reference."""
    meta = doc["metadata"]
    what = f"{doc['kind']} {meta.get('name') or meta.get('generateName')}"
    problems = []

    def need(container, var, secret, key):
        if from_secret(container, var) != (secret, key):
            problems.append(f"{what}/{container['name']}: {var} is not from the Secret {secret}")

    def ray_node_or_driver(container):
        if env_values(container).get("RAY_AUTH_MODE") != "token":
            problems.append(f"{what}/{container['name']}: RAY_AUTH_MODE is not token")
        need(container, "RAY_AUTH_TOKEN", RAY_TOKEN_SECRET, "auth_token")

    for container in containers_of(doc):
        for e in container.get("env", []):
            if e["name"] in CREDENTIALS and "value" in e:
                problems.append(f"{what}/{container['name']}: {e['name']} is a literal value")
    if doc["kind"] == "RayCluster":
        auth = doc["spec"].get("authOptions")
        if auth != {"mode": "token", "secretName": RAY_TOKEN_SECRET}:
            problems.append(
                f"{what}: spec.authOptions {auth} is not token auth with {RAY_TOKEN_SECRET}"
            )
        for container in containers_of(doc):
            ray_node_or_driver(container)
    elif doc["kind"] == "Job":
        (container,) = containers_of(doc)
        ray_node_or_driver(container)
        need(container, "MLFLOW_TRACKING_USERNAME", MLFLOW_SECRET, "username")
        need(container, "MLFLOW_TRACKING_PASSWORD", MLFLOW_SECRET, "password")
        need(container, "PREFECT_API_AUTH_STRING", PREFECT_SECRET, "auth_string")
    elif doc["kind"] == "Deployment" and meta["name"] == "mlflow":
        (container,) = containers_of(doc)
        if "--app-name=basic-auth" not in container.get("args", []):
            problems.append(f"{what}: the server does not run the basic-auth app")
        need(container, "MLFLOW_AUTH_ADMIN_USERNAME", MLFLOW_SECRET, "username")
        need(container, "MLFLOW_AUTH_ADMIN_PASSWORD", MLFLOW_SECRET, "password")
        need(container, "MLFLOW_FLASK_SERVER_SECRET_KEY", MLFLOW_SECRET, "flask_secret_key")
    elif doc["kind"] == "Deployment" and meta["name"] == "prefect-worker":
        (container,) = containers_of(doc)
        need(container, "PREFECT_API_AUTH_STRING", PREFECT_SECRET, "auth_string")
        env = env_values(container)
        by_ref = (env.get(f"{WORKER_SECRET_SETTINGS}NAME"), env.get(f"{WORKER_SECRET_SETTINGS}KEY"))
        if by_ref != (PREFECT_SECRET, "auth_string"):
            problems.append(f"{what}: the worker would write its auth string into each Job")
    return problems


def worker_container() -> dict:
    docs = documents(CLUSTER / "k8s" / "prefect-worker.yaml")
    (container,) = containers_of(next(d for d in docs if d["kind"] == "Deployment"))
    return container


# what the worker's PREFECT_API_AUTH_STRING (from its Secret) holds, in these tests
WORKER_AUTH_STRING = "hybridrl:auth-string-of-the-test"


def created_job(job_variables: dict, monkeypatch, worker_settings: bool = True) -> dict:
    """The Job the worker of k8s/prefect-worker.yaml sends to the Kubernetes API for a flow
    run: rendered with the worker's own Prefect settings (its PREFECT_API_URL and auth string,
    which a worker copies into every Job), then prefect-kubernetes' `_create_job` with the
    worker's PREFECT_INTEGRATIONS_KUBERNETES_WORKER_* settings (unless `worker_settings` is
    False), against a stand-in for the API that keeps what it was sent."""
    import prefect_kubernetes.worker as k8s_worker
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    env = env_values(worker_container())
    for name, value in env.items():
        if name.startswith(WORKER_SECRET_SETTINGS):
            if worker_settings:
                monkeypatch.setenv(name, value)
            else:
                monkeypatch.delenv(name, raising=False)
    sent = []

    class Api:
        def __init__(self, *args, **kwargs):
            pass

        async def create_namespaced_job(self, namespace, body):
            sent.append(copy.deepcopy(body))
            return body

    monkeypatch.setattr(k8s_worker, "BatchV1Api", Api)
    worker_settings_now = {
        PREFECT_API_URL: env["PREFECT_API_URL"],
        PREFECT_API_AUTH_STRING: WORKER_AUTH_STRING,
    }
    with temporary_settings(updates=worker_settings_now):
        config = asyncio.run(
            k8s_worker.KubernetesWorkerJobConfiguration.from_template_and_values(
                base_job_template(), job_variables, client=NoServer()
            )
        )
        run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="brave-otter")
        config.prepare_for_flow_run(flow_run=run)
    worker = k8s_worker.KubernetesWorker(work_pool_name="hybridrl-k8s")
    asyncio.run(worker._create_job(config, client=None))
    (job,) = sent
    return job


@pytest.mark.parametrize(
    "path",
    [*RAYCLUSTERS, CLUSTER / "k8s" / "mlflow.yaml", CLUSTER / "k8s" / "prefect-worker.yaml"],
    ids=lambda p: p.name,
)
def test_no_endpoint_runs_without_authentication(path):
    """The Ray pods, the MLflow server and the Prefect worker: token auth / basic auth /
    the server's auth string, every credential from a Secret."""
    docs = [d for d in documents(path) if d["kind"] in ("RayCluster", "Deployment")]
    assert docs
    for doc in docs:
        assert auth_problems(doc) == []


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_flow_run_jobs_carry_credentials_by_reference_only(name, monkeypatch):
    """The Job a flow run of each deployment gets: Ray token, MLflow user and password,
    Prefect auth string from Secrets; the worker's own auth string nowhere in the manifest;
    no credential among what the deployment stores (its parameters and job variables)."""
    d = deployment(name)
    job = created_job(d["work_pool"]["job_variables"], monkeypatch)
    assert auth_problems(job) == []
    assert WORKER_AUTH_STRING not in json.dumps(job)
    stored = json.dumps({"parameters": d["parameters"], "job_variables": d["work_pool"]})
    assert not [c for c in CREDENTIALS if c in stored]
    template = json.dumps(base_job_template()["variables"])
    assert not [c for c in CREDENTIALS if f'"{c}": ' in template]


def test_the_auth_check_catches_recipes_without_authentication(monkeypatch):
    """auth_problems can fail: each way of running an endpoint without authentication, or
    holding a credential as a value, is reported."""
    (cluster,) = documents(CLUSTER / "kuberay" / "raycluster-demo.yaml")
    mlflow_docs = documents(CLUSTER / "k8s" / "mlflow.yaml")
    server = next(d for d in mlflow_docs if d["kind"] == "Deployment")
    worker = next(
        d for d in documents(CLUSTER / "k8s" / "prefect-worker.yaml") if d["kind"] == "Deployment"
    )

    def changed(doc, change):
        doc = copy.deepcopy(doc)
        change(doc, containers_of(doc))
        return doc

    def drop_env(container, name):
        container["env"] = [e for e in container["env"] if e["name"] != name]

    def set_env(container, name, entry):
        drop_env(container, name)
        container["env"].append({"name": name, **entry})

    optional_ref = {
        "secretKeyRef": {"name": RAY_TOKEN_SECRET, "key": "auth_token", "optional": True}
    }
    cases = [
        (
            changed(cluster, lambda d, c: d["spec"].update(authOptions={"mode": "disabled"})),
            "spec.authOptions",
        ),
        (changed(cluster, lambda d, c: d["spec"].pop("authOptions")), "spec.authOptions"),
        (
            changed(cluster, lambda d, c: set_env(c[0], "RAY_AUTH_MODE", {"value": "disabled"})),
            "ray-head: RAY_AUTH_MODE is not token",
        ),
        (
            changed(cluster, lambda d, c: set_env(c[1], "RAY_AUTH_TOKEN", {"value": "0" * 64})),
            "ray-worker: RAY_AUTH_TOKEN is a literal value",
        ),
        (
            changed(
                cluster, lambda d, c: set_env(c[1], "RAY_AUTH_TOKEN", {"valueFrom": optional_ref})
            ),
            "ray-worker: RAY_AUTH_TOKEN is not from the Secret",
        ),
        (
            changed(server, lambda d, c: c[0]["args"].remove("--app-name=basic-auth")),
            "basic-auth app",
        ),
        (
            changed(
                server, lambda d, c: set_env(c[0], "MLFLOW_AUTH_ADMIN_PASSWORD", {"value": "x"})
            ),
            "MLFLOW_AUTH_ADMIN_PASSWORD is a literal value",
        ),
        (
            changed(worker, lambda d, c: drop_env(c[0], "PREFECT_API_AUTH_STRING")),
            "PREFECT_API_AUTH_STRING is not from",
        ),
        (
            changed(worker, lambda d, c: drop_env(c[0], f"{WORKER_SECRET_SETTINGS}NAME")),
            "write its auth string into each Job",
        ),
    ]
    for bad, expected in cases:
        problems = auth_problems(bad)
        assert any(expected in p for p in problems), (expected, problems)
    # Jobs: a deployment that turns Ray's auth off, and a worker without the two settings,
    # which writes its own auth string into the Job as a value
    jv = copy.deepcopy(deployment("demo-cpu-kuberay")["work_pool"]["job_variables"])
    jv["env"]["RAY_AUTH_MODE"] = "disabled"
    assert any(
        "RAY_AUTH_MODE is not token" in p for p in auth_problems(created_job(jv, monkeypatch))
    )
    job = created_job(
        deployment("demo-cpu-kuberay")["work_pool"]["job_variables"], monkeypatch, False
    )
    assert WORKER_AUTH_STRING in json.dumps(job)
    assert any("PREFECT_API_AUTH_STRING is a literal value" in p for p in auth_problems(job))


def test_every_secret_a_recipe_needs_is_in_the_example(monkeypatch):
    """Each Secret and key a container requires (and the RayClusters' authOptions) is one the
    example file defines, so that applying one's copy of it lets every pod start."""
    example = {
        s["metadata"]["name"]: set(s["stringData"])
        for s in documents(CLUSTER / "k8s" / "secret-example.yaml")
    }
    objects = [d for p in [*RAYCLUSTERS, *CORE_FILES] for d in documents(p)]
    objects.append(
        created_job(deployment(DEPLOYMENTS[0])["work_pool"]["job_variables"], monkeypatch)
    )
    refs = set()
    for doc in objects:
        for container in containers_of(doc):
            for e in container.get("env", []):
                if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                    refs.add((ref["name"], ref["key"]))
        if doc["kind"] == "RayCluster":
            refs.add((doc["spec"]["authOptions"]["secretName"], "auth_token"))
    missing = {(name, key) for name, key in refs if key not in example.get(name, set())}
    assert not missing
    assert {name for name, _ in refs} == set(example)
    variables = base_job_template()["variables"]["properties"]
    assert (
        variables["ray_token_secret_name"]["default"],
        variables["mlflow_auth_secret_name"]["default"],
        variables["prefect_auth_secret_name"]["default"],
    ) == (RAY_TOKEN_SECRET, MLFLOW_SECRET, PREFECT_SECRET)
