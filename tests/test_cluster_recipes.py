"""The cluster recipe of deployments/cluster/, checked without a cluster (no Kubernetes,
KubeRay, Slurm, docker or GPU here; no Ray is started and nothing trains):

- every core Kubernetes object (the MLflow Deployment, Service and volume claim, the Secret,
  the Prefect worker and its RBAC), the pod templates of the RayClusters' groups, and the Job
  the Prefect worker makes from the base job template are validated against the Kubernetes
  OpenAPI schemas (kubernetes-validate, strict: an unknown field is an error);
- the RayClusters against the openAPIV3Schema of KubeRay's CRD (a copy of v1.7.0's), closed
  the way `kubectl apply` (strict field validation) closes it;
- the base job template by Prefect's own code: the server's work-pool validation, the
  prefect-kubernetes job configuration rendering it for each deployment of prefect.yaml,
  whose job variables pass the server's check and whose configs pass hybridrl's;
- the scripts by `bash -n` and shellcheck, and the Job's entry point forwards SIGTERM;
- the files agree with each other and with the code (ray start / mlflow server options,
  the head service name, images, resources, paths in the image).

Authentication: test_cluster_auth.py and test_cluster_auth_runs.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from cluster_recipes import (
    BIN,
    CLUSTER,
    CORE_FILES,
    CRD_SCHEMA,
    DEPLOYMENTS,
    IMAGE_HOME,
    MLFLOW_SECRET,
    PLACEHOLDER,
    PREFECT_SECRET,
    RAY_TOKEN_SECRET,
    RAYCLUSTERS,
    ROOT,
    NoServer,
    as_pod_template,
    base_job_template,
    deployment,
    documents,
    group_templates,
    k8s_valid,
    prefect_yaml,
)


# ------------------------------------------------------------------ core Kubernetes objects
@pytest.mark.parametrize(
    "path,index",
    [(p, i) for p in CORE_FILES for i in range(len(documents(p)))],
    ids=lambda v: v.name if isinstance(v, Path) else str(v),
)
def test_kubernetes_objects_match_the_api_schema(path, index):
    k8s_valid(documents(path)[index])


@pytest.mark.parametrize("path", RAYCLUSTERS, ids=lambda p: p.name)
def test_raycluster_pod_templates_match_the_api_schema(path):
    (cluster,) = documents(path)
    for group, template in group_templates(cluster):
        k8s_valid(as_pod_template(template, f"{cluster['metadata']['name']}-{group}"))


def test_a_misspelled_field_fails_the_kubernetes_schema():
    """The validation can fail: a misspelled field, at the top of a spec or deep in a
    container, is an error, not a field silently ignored."""
    deployment = next(
        d for d in documents(CLUSTER / "k8s" / "mlflow.yaml") if d["kind"] == "Deployment"
    )
    k8s_valid(deployment)
    top = copy.deepcopy(deployment)
    top["spec"]["replica"] = top["spec"].pop("replicas")
    deep = copy.deepcopy(deployment)
    container = deep["spec"]["template"]["spec"]["containers"][0]
    container["imagePulPolicy"] = container.pop("imagePullPolicy")
    for bad, field in ((top, "replica"), (deep, "imagePulPolicy")):
        with pytest.raises(kubernetes_validate.ValidationError, match=field):
            k8s_valid(bad)


def test_the_secret_examples_hold_no_real_keys():
    secrets = {s["metadata"]["name"]: s for s in documents(CLUSTER / "k8s" / "secret-example.yaml")}
    assert {name: set(s["stringData"]) for name, s in secrets.items()} == {
        "hybridrl-s3": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"},
        RAY_TOKEN_SECRET: {"auth_token"},
        MLFLOW_SECRET: {"username", "password", "flask_secret_key"},
        PREFECT_SECRET: {"auth_string"},
    }
    for s in secrets.values():
        assert s["kind"] == "Secret" and s["metadata"]["namespace"] == "hybridrl"
        assert all(v.startswith(PLACEHOLDER) for v in s["stringData"].values())


# ------------------------------------------------------------------ RayClusters and the CRD
def closed(schema: dict) -> dict:
    """The CRD's schema with every object that lists its properties closed to others (not
    those marked x-kubernetes-preserve-unknown-fields). The API server prunes unknown fields
    of a custom resource, and `kubectl apply` (strict field validation) refuses them; plain
    JSON Schema would accept them."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_schema() -> dict:
    return json.loads(CRD_SCHEMA.read_text())


@pytest.fixture(scope="module")
def raycluster_validator(crd_schema):
    return jsonschema.Draft7Validator(closed(crd_schema))


@pytest.mark.parametrize("path", RAYCLUSTERS, ids=lambda p: p.name)
def test_rayclusters_match_kuberays_crd(path, raycluster_validator):
    (cluster,) = documents(path)
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in raycluster_validator.iter_errors(cluster)
    ]
    assert not errors, errors


def test_a_misspelled_field_fails_the_crd_schema(crd_schema, raycluster_validator):
    """A misspelled key of the RayCluster spec and of a container inside it are refused; the
    CRD's schema as published (open objects) would let both through."""
    (cluster,) = documents(CLUSTER / "kuberay" / "raycluster-demo.yaml")
    top = copy.deepcopy(cluster)
    group = top["spec"]["workerGroupSpecs"][0]
    group["rayStartParam"] = group.pop("rayStartParams")
    deep = copy.deepcopy(cluster)
    container = deep["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    container["imagePulPolicy"] = container.pop("imagePullPolicy")
    for bad, field in ((top, "rayStartParam"), (deep, "imagePulPolicy")):
        messages = [e.message for e in raycluster_validator.iter_errors(bad)]
        assert any(f"'{field}' was unexpected" in m for m in messages), messages
        assert jsonschema.Draft7Validator(crd_schema).is_valid(bad)


def start_params(group: dict) -> dict[str, float]:
    """What a group's pods offer Ray: CPUs, GPUs and custom resources, read from its
    rayStartParams the way KubeRay reads the resources JSON (quotes trimmed)."""
    params = group["rayStartParams"]
    offer = {"CPU": float(params["num-cpus"]), "GPU": float(params.get("num-gpus", 0))}
    if "resources" in params:
        offer |= {k: float(v) for k, v in json.loads(params["resources"].strip("'\"` ")).items()}
    return offer


@pytest.mark.parametrize("path", RAYCLUSTERS, ids=lambda p: p.name)
def test_rayclusters_agree_with_ray_and_the_image(path):
    """Every rayStartParams key is a `ray start` option; the Ray version is the installed
    one (a driver must match its cluster); the head runs no pool worker. (Token auth:
    test_no_endpoint_runs_without_authentication.)"""
    import ray
    from ray.scripts.scripts import start

    options = {o.removeprefix("--") for p in start.params for o in p.opts}
    (cluster,) = documents(path)
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray.__version__
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        assert set(group["rayStartParams"]) <= options, set(group["rayStartParams"]) - options
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        offer = start_params(group)
        assert offer["CPU"] == float(limits["cpu"])
        assert offer["GPU"] == float(limits.get("nvidia.com/gpu", 0))


# ------------------------------------------------------------------ Prefect: the work pool
def test_base_job_template_is_one_prefects_server_accepts():
    """The server's own check (job_configuration and variables present; every placeholder a
    declared variable), the variables a valid JSON schema, and their defaults valid."""
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.schema_tools import is_valid_schema, validate
    from prefect.utilities.templating import find_placeholders

    template = base_job_template()
    WorkPoolCreate(name="hybridrl-k8s", type="kubernetes", base_job_template=template)
    variables = template["variables"]
    is_valid_schema(variables, preprocess=False)
    used = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]))}
    assert used <= set(variables["properties"]), used - set(variables["properties"])
    defaults = {k: v["default"] for k, v in variables["properties"].items() if "default" in v}
    validate({**defaults, "image": "x"}, variables, raise_on_error=True, ignore_required=False)


def test_an_undeclared_placeholder_is_refused_by_prefect():
    from prefect.server.schemas.actions import WorkPoolCreate

    template = base_job_template()
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "containers"
    ][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpu_count }}"
    with pytest.raises(ValueError, match="gpu_count"):
        WorkPoolCreate(name="hybridrl-k8s", type="kubernetes", base_job_template=template)


def rendered_job(job_variables: dict) -> dict:
    """The Job manifest a Kubernetes worker makes for a flow run of a deployment with these
    job variables: prefect-kubernetes' own configuration class, rendering and preparation."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(
            base_job_template(), job_variables, client=NoServer()
        )
    )
    run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="brave-otter")
    config.prepare_for_flow_run(flow_run=run)
    return config.job_manifest


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_each_deployment_renders_a_valid_job(name):
    from prefect.utilities.schema_tools import validate

    job_variables = deployment(name)["work_pool"]["job_variables"]
    variables = base_job_template()["variables"]
    validate(job_variables, variables, raise_on_error=True, ignore_required=False)
    job = rendered_job(job_variables)
    # Prefect requires parallelism and completions inside the pod spec, where the Pod API has
    # no such fields: the API server drops them with a warning (fieldValidation=Warn, the
    # default for API clients). They are the only fields the strict schema refuses.
    pod = job["spec"]["template"]["spec"]
    assert (pod["parallelism"], pod["completions"]) == (1, 1)
    with pytest.raises(kubernetes_validate.ValidationError) as refused:
        k8s_valid(job)
    assert "'completions', 'parallelism' were unexpected" in refused.value.message
    del pod["parallelism"], pod["completions"]
    k8s_valid(job)

    (container,) = pod["containers"]
    assert container["image"] == job_variables["image"]
    assert container["command"] == [
        "bash",
        f"{IMAGE_HOME}/deployments/cluster/prefect/join-ray-and-run.sh",
    ]
    assert (ROOT / container["command"][1].removeprefix(f"{IMAGE_HOME}/")).is_file()
    # the engine itself, so the kubelet's SIGTERM reaches the flow (the variable the worker
    # adds, PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR, is read by `prefect flow-run execute`)
    assert container["args"] == ["python", "-m", "prefect.engine"]
    env = {e["name"]: e for e in container["env"]}
    for key, value in job_variables["env"].items():
        assert env[key]["value"] == value
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        ref = env[key]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (job_variables["s3_secret_name"], key)
    assert job["metadata"]["namespace"] == job_variables["namespace"]
    assert job["spec"]["backoffLimit"] == 0


# ------------------------------------------------------------------ Prefect: the deployments
def test_prefect_yaml_runs_the_flows_from_the_image():
    doc = prefect_yaml()
    (pull,) = doc["pull"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == IMAGE_HOME
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"WORKDIR {IMAGE_HOME}\n" in dockerfile
    for d in doc["deployments"]:
        path, func = d["entrypoint"].split(":")
        assert f"def {func}(" in (ROOT / path).read_text()
        assert d["work_pool"]["name"] == "hybridrl-k8s"


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_deployment_configs_pass_hybridrls_check(name, monkeypatch):
    """flows.deploy.read_deployments, as `hybridrl deploy` runs it, with the job's plain
    environment (HYBRIDRL_STORAGE__ROOT, HYBRIDRL_TRACKING__URI, ...) set as in the Job."""
    from flows.deploy import read_deployments

    d = deployment(name)
    for key, value in d["work_pool"]["job_variables"]["env"].items():
        monkeypatch.setenv(key, value)
    (checked,) = read_deployments(CLUSTER / "prefect" / "prefect.yaml", [name])
    if "config" in checked["parameters"]:
        assert (ROOT / checked["parameters"]["config"]).is_file()


def test_a_misspelled_override_fails_the_deployment_check(tmp_path):
    from flows.deploy import DeployError, read_deployments

    bad = tmp_path / "prefect.yaml"
    text = (CLUSTER / "prefect" / "prefect.yaml").read_text()
    bad.write_text(text.replace("- ray.num_cpus_per_rank=2", "- ray.num_cpu_per_rank=2"))
    with pytest.raises(DeployError, match="demo-cpu-kuberay.*ray.num_cpu_per_rank"):
        read_deployments(bad, ["demo-cpu-kuberay"])


@pytest.mark.parametrize("name", [n for n in DEPLOYMENTS if "kuberay" in n])
def test_each_training_fits_its_raycluster(name):
    """RAY_ADDRESS names the head service KubeRay makes for one of the RayClusters, in the
    Job's namespace, running the Job's image; the actor ranks (each needing
    ray.num_cpus_per_rank, ray.num_gpus_per_rank and ray.actor_resources) fit the pods
    of its worker groups by the pool's own placement check."""
    from hybrid_engine.config import load_config
    from hybrid_engine.pool import placement

    d = deployment(name)
    jv = d["work_pool"]["job_variables"]
    host, port = jv["env"]["RAY_ADDRESS"].split(":")
    clusters = {f"{c['metadata']['name']}-head-svc": c for p in RAYCLUSTERS for c in documents(p)}
    cluster = clusters[host]
    assert port == "6379" and cluster["metadata"]["namespace"] == jv["namespace"]
    images = {c["image"] for _, t in group_templates(cluster) for c in t["spec"]["containers"]}
    assert images == {jv["image"]}
    cfg = load_config(ROOT / d["parameters"]["config"], d["parameters"]["overrides"])
    assert cfg.trainer.backend == "ray" and cfg.trainer.num_threads == cfg.ray.num_cpus_per_rank
    # the pool's own placement check, on the nodes the worker groups' pods make
    nodes = [
        {"resources": start_params(group)}
        for group in cluster["spec"]["workerGroupSpecs"]
        for _ in range(group["replicas"])
    ]
    want = placement.bundle(cfg, "actor")
    assert placement.never_fits(cfg.ray.placement, cfg.actor.layout.dp, want, nodes) is None


# ------------------------------------------------------------------ MLflow, images, docs
def test_mlflow_server_matches_the_tracking_uri():
    import mlflow.cli

    docs = {d["kind"]: d for d in documents(CLUSTER / "k8s" / "mlflow.yaml")}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    options = {o for p in mlflow.cli.server.params for o in p.opts}
    flags = {a.split("=", 1)[0] for a in container["args"]}
    # bash checks the credentials, then `exec mlflow server "$@"` with the args
    assert container["command"][:2] == ["/bin/bash", "-c"] and len(container["command"]) == 4
    assert container["command"][2].endswith('; exec mlflow server "$@"')
    assert flags <= options, flags - options
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert args["artifacts-destination"].startswith("s3://")
    service = docs["Service"]
    (port,) = service["spec"]["ports"]
    uris = {
        d["work_pool"]["job_variables"]["env"]["HYBRIDRL_TRACKING__URI"]
        for d in prefect_yaml()["deployments"]
    }
    assert uris == {f"http://{service['metadata']['name']}:{port['port']}"}
    host = f"{service['metadata']['name']}:{port['port']}"
    assert host in args["allowed-hosts"].split(",")


def test_dockerfile_installs_torch_first_then_the_project():
    """Static checks only: no docker here, the image is never built by the suite."""
    text = (CLUSTER / "Dockerfile").read_text()
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    assert "torch==2.13.0" in runs[0]
    assert any("pip install . " in r for r in runs[1:])
    # the MLflow server's basic-auth app needs Flask-WTF (mlflow's `auth` extra)
    assert any('"mlflow[auth]"' in r for r in runs[1:])
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[(.*?)\]", pyproject).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert f"COPY {package} ./{package}\n" in text
    assert "COPY configs ./configs\n" in text and "COPY deployments ./deployments\n" in text


def test_the_readme_lists_every_file():
    readme = (CLUSTER / "README.md").read_text()
    for path in sorted(p for p in CLUSTER.rglob("*") if p.is_file() and p.name != "README.md"):
        assert f"`{path.relative_to(CLUSTER)}`" in readme, path


# ------------------------------------------------------------------ scripts
SCRIPTS = [CLUSTER / "slurm" / "hybridrl.sbatch", CLUSTER / "prefect" / "join-ray-and-run.sh"]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_pass_shellcheck(path):
    p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(
        [str(BIN / "shellcheck"), "--shell=bash", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout


def test_job_entry_point_forwards_sigterm_and_returns_the_status(tmp_path):
    """Without RAY_ADDRESS the wrapper joins no cluster: what is left is its signal path. The
    SIGTERM it receives (as the kubelet sends it to PID 1) reaches the command, which
    finishes its shutdown; the wrapper exits with the command's status."""
    child = tmp_path / "child.py"
    child.write_text(
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep(0.5); print('stopped cleanly', flush=True); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(30)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    wrapper = subprocess.Popen(
        ["bash", str(SCRIPTS[1]), sys.executable, str(child)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert wrapper.stdout.readline().strip() == "up"
    time.sleep(0.2)
    wrapper.send_signal(signal.SIGTERM)
    out, _ = wrapper.communicate(timeout=20)
    assert (wrapper.returncode, out.strip()) == (7, "stopped cleanly")


def test_the_namespace_takes_traffic_from_its_own_pods_only():
    """A NetworkPolicy of the recipe's namespace selects every pod in it (the Ray pods,
    MLflow, the worker, the flow-run Jobs) and lets in traffic from pods of that namespace
    only: no namespaceSelector, no ipBlock, no rule without a `from`."""
    policies = [d for p in CORE_FILES for d in documents(p) if d["kind"] == "NetworkPolicy"]
    assert policies, "no NetworkPolicy in deployments/cluster/k8s/"
    namespaces = {
        d["metadata"].get("namespace")
        for p in [*CORE_FILES, *RAYCLUSTERS]
        for d in documents(p)
        if d["kind"] in ("RayCluster", "Deployment")
    }
    (namespace,) = namespaces
    covering = [
        p
        for p in policies
        if p["metadata"]["namespace"] == namespace
        and p["spec"]["podSelector"] == {}
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert covering, policies
    for policy in covering:
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from"), rule  # a rule without `from` lets everyone in
            assert all(set(peer) == {"podSelector"} for peer in rule["from"]), rule
