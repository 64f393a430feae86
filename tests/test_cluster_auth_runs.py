"""The cluster recipe's refusals, run here: a missing, empty or placeholder credential stops
a Ray pod, the Job's entry point, the Slurm script or the MLflow server in one line (with
stand-ins for `ray`, `mlflow` and Slurm's commands, which record what they get), and a real
`mlflow server` with the recipe's basic-auth app refuses an anonymous client."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_recipes import (
    BIN,
    CLUSTER,
    MLFLOW_SECRET,
    PLACEHOLDER,
    RAY_TOKEN_SECRET,
    RAYCLUSTERS,
    ROOT,
    clean_env,
    containers_of,
    documents,
    env_values,
    group_templates,
)


def kuberay_command(container: dict) -> list[str]:
    """The Ray container's command as KubeRay 1.7 builds it (BuildPod): the container's
    command and args, each between spaces, then `&&` the generated `ulimit ...; ray start
    ...`, under `/bin/bash -c --`; here `echo started` stands for the generated part."""
    given = "".join(f" {a} " for a in container.get("command", []) + container.get("args", []))
    # with "ray start" in them, KubeRay would run the container's command instead of its own
    assert "ray start" not in given
    return ["/bin/bash", "-c", "--", f"{given} && echo started"]


@pytest.mark.parametrize("path", RAYCLUSTERS, ids=lambda p: p.name)
def test_ray_pods_refuse_an_empty_or_placeholder_token_in_one_line(path):
    """A missing Secret or key never gets here (a required secretKeyRef: Kubernetes does not
    start the container); an empty token or the example's placeholder stops the container
    in one line, before Ray starts; a token lets it go on."""
    (cluster,) = documents(path)
    for group, template in group_templates(cluster):
        (container,) = template["spec"]["containers"]
        argv = kuberay_command(container)
        for token in (None, "", f"{PLACEHOLDER}A-RANDOM-TOKEN"):
            env = clean_env() if token is None else clean_env(RAY_AUTH_TOKEN=token)
            p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
            assert (p.returncode, p.stdout) == (1, ""), (group, token, p.stderr)
            (line,) = p.stderr.splitlines()
            assert line.startswith("RAY_AUTH_TOKEN is empty") and RAY_TOKEN_SECRET in line
        p = subprocess.run(
            argv,
            env=clean_env(RAY_AUTH_TOKEN="0f" * 32),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert (p.returncode, p.stdout, p.stderr) == (0, "started\n", "")


def stand_in(bin_dir: Path, name: str, then: str = "") -> None:
    """A command `name` that appends one line to $CALLS: its name, RAY_AUTH_MODE,
    RAY_AUTH_TOKEN and its arguments (tab-separated), then runs `then`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(
        "#!/bin/bash\n"
        'printf \'%s\\t%s\\t%s\\t%s\\n\' "$(basename "$0")" "${RAY_AUTH_MODE-}" '
        '"${RAY_AUTH_TOKEN-}" "$*" >> "$CALLS"\n' + then
    )
    path.chmod(0o755)


def calls(log: Path) -> list[list[str]]:
    return [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []


def test_job_entry_point_refuses_a_missing_ray_token(tmp_path):
    """With RAY_ADDRESS (a training Job) and token mode, the default: no token, an empty one
    or the example's placeholder is refused in one line on stderr with exit status 2, before
    `ray start` (a stand-in here, never called) and before the command; so is an empty MLflow
    password or Prefect auth string. With the token, `ray start` gets it from the
    environment, never on its command line, and the token is printed nowhere."""
    bin_dir, log, ran = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "ran"
    stand_in(bin_dir, "ray")
    base = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        CALLS=str(log),
        RAY_ADDRESS="hybridrl-demo-head-svc:6379",
    )
    script = [str(CLUSTER / "prefect" / "join-ray-and-run.sh"), "touch", str(ran)]
    token = "5a" * 32
    refused = [
        ({"RAY_AUTH_MODE": "token"}, "RAY_AUTH_TOKEN"),
        ({}, "RAY_AUTH_TOKEN"),  # token mode unless told otherwise
        ({"RAY_AUTH_TOKEN": ""}, "RAY_AUTH_TOKEN"),
        ({"RAY_AUTH_TOKEN": f"{PLACEHOLDER}A-RANDOM-TOKEN"}, "RAY_AUTH_TOKEN"),
        ({"RAY_AUTH_TOKEN": token, "MLFLOW_TRACKING_PASSWORD": ""}, "MLFLOW_TRACKING_PASSWORD"),
        (
            {"RAY_AUTH_TOKEN": token, "PREFECT_API_AUTH_STRING": f"{PLACEHOLDER}USER:PASSWORD"},
            "PREFECT_API_AUTH_STRING",
        ),
    ]
    for extra, var in refused:
        p = subprocess.run(
            ["bash", *script], env={**base, **extra}, capture_output=True, text=True, timeout=30
        )
        assert (p.returncode, p.stdout) == (2, ""), (extra, p.stderr)
        (line,) = p.stderr.splitlines()
        assert line.startswith("join-ray-and-run.sh: ") and var in line, line
        assert not log.exists() and not ran.exists()

    p = subprocess.run(
        ["bash", *script],
        env={**base, "RAY_AUTH_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0 and ran.exists(), p.stderr
    start, stop = calls(log)
    assert start[:3] == ["ray", "token", token] and start[3].startswith(
        "start --address=hybridrl-demo-head-svc:6379 --num-cpus=0 --num-gpus=0"
    )
    assert stop[0] == "ray" and stop[3] == "stop"
    assert token not in start[3] + p.stdout + p.stderr


def test_slurm_script_runs_ray_with_a_token_made_per_job(tmp_path):
    """The sbatch script without Slurm: `scontrol`, `srun`, `ray`, `hybridrl` and the node
    check are stand-ins that record what they get. Every Ray command, every job step and the
    driver run in token mode with one token, a new random one per job unless one is exported;
    srun passes the environment on (--export=ALL); the token is on no command line and in
    no output. A tracking or Prefect server without credentials is refused in one line before
    anything starts."""
    venv_bin, log = tmp_path / "venv" / "bin", tmp_path / "calls.log"
    for name in ("ray", "srun"):
        stand_in(venv_bin, name)
    # the driver also records the Prefect API login it was given (client, server)
    prefect_log = tmp_path / "prefect.log"
    logins = (
        'printf \'%s\\t%s\\n\' "${PREFECT_API_AUTH_STRING-}" "${PREFECT_SERVER_API_AUTH_STRING-}"'
    )
    stand_in(venv_bin, "hybridrl", f'{logins} >> "$PREFECT_LOG"\n')
    stand_in(venv_bin, "scontrol", "printf 'node0\\nnode1\\nnode2\\n'\n")
    # `python -c` (the token) is the real one; `python -` (the wait for the nodes) a stand-in
    stand_in(venv_bin, "python", "cat >/dev/null\n")
    text = (venv_bin / "python").read_text()
    (venv_bin / "python").write_text(
        text.replace(
            "#!/bin/bash\n", '#!/bin/bash\nif [ "${1-}" = -c ]; then exec "$REAL_PYTHON" "$@"; fi\n'
        )
    )
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "CALLS": str(log),
        "REAL_PYTHON": sys.executable,
        "VENV": str(venv_bin.parent),
        "HYBRIDRL_HOME": str(tmp_path),
        "SLURMD_NODENAME": "node0",
        "SLURM_JOB_NODELIST": "node[0-2]",
        "SLURM_CPUS_PER_TASK": "2",
        "PREFECT_LOG": str(prefect_log),
    }
    sbatch = str(CLUSTER / "slurm" / "hybridrl.sbatch")

    def run(**extra):
        log.unlink(missing_ok=True)
        prefect_log.unlink(missing_ok=True)
        p = subprocess.run(
            ["bash", sbatch, "trainer.total_training_steps=1"],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        return p, calls(log)

    tokens = []
    for _ in range(2):
        p, seen = run()
        assert p.returncode == 0, p.stderr
        names = [c[0] for c in seen]
        assert {"scontrol", "ray", "srun", "python", "hybridrl"} <= set(names)
        (token,) = {c[2] for c in seen if c[0] != "scontrol"}
        assert re.fullmatch(r"[0-9a-f]{64}", token)
        assert {c[1] for c in seen if c[0] != "scontrol"} == {"token"}
        assert all("--export=ALL" in c[3] for c in seen if c[0] == "srun")
        assert token not in "".join(c[3] for c in seen) + p.stdout + p.stderr
        tokens.append(token)
        # the job's own (ephemeral) Prefect API takes a login made for this job only
        ((client, server),) = {tuple(ln.split("\t")) for ln in prefect_log.read_text().splitlines()}
        assert client == server and re.fullmatch(r"hybridrl:[0-9a-f]{32}", server), (client, server)
        assert server not in "".join(c[3] for c in seen) + p.stdout + p.stderr
        tokens.append(server)
    assert len(set(tokens)) == 4

    given = "c3" * 32
    p, seen = run(RAY_AUTH_TOKEN=given)
    assert p.returncode == 0 and {c[2] for c in seen if c[0] != "scontrol"} == {given}

    refused = [
        ({"REAL_PYTHON": "/bin/false"}, "no Ray token"),  # no token could be made
        ({"TRACKING_URI": "http://mlflow.example:5000"}, "MLFLOW_TRACKING_USERNAME"),
        (
            {"TRACKING_URI": "https://mlflow.example", "MLFLOW_TRACKING_USERNAME": "u"},
            "MLFLOW_TRACKING_PASSWORD",
        ),
        ({"PREFECT_API_URL": "http://prefect.example:4200/api"}, "PREFECT_API_AUTH_STRING"),
    ]
    for extra, var in refused:
        p, seen = run(**extra)
        assert (p.returncode, p.stdout, seen) == (2, "", []), (extra, p.stderr)
        (line,) = p.stderr.splitlines()
        assert line.startswith("hybridrl.sbatch: ") and var in line
    p, seen = run(
        TRACKING_URI="http://mlflow.example:5000",
        MLFLOW_TRACKING_USERNAME="u",
        MLFLOW_TRACKING_PASSWORD="p",
        PREFECT_API_URL="http://prefect.example:4200/api",
        PREFECT_API_AUTH_STRING="u:p",
    )
    assert p.returncode == 0, p.stderr
    assert set(prefect_log.read_text().splitlines()) == {"u:p\t"}  # as given; no server here


def test_the_driver_keeps_token_auth_from_its_environment():
    """hybridrl sets RAY_AUTH_MODE=disabled for its local head on 127.0.0.1 only as a
    default: a driver whose environment says token (a flow-run Job, a Slurm job) keeps it."""
    code = "import os, hybrid_engine; print(os.environ['RAY_AUTH_MODE'])"
    for given, kept in ((None, "disabled"), ("token", "token")):
        env = clean_env() if given is None else clean_env(RAY_AUTH_MODE=given)
        p = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (p.returncode, p.stdout.strip()) == (0, kept), p.stderr


RAY_CLIENT = """
import sys, hybrid_engine, ray
try:
    ray.init(address=sys.argv[1], _node_ip_address="127.0.0.1", logging_level="ERROR")
except ConnectionError as e:
    sys.exit(f"refused: {e}")
print("nodes", len(ray.nodes()))
"""


def test_a_local_head_keeps_the_users_token_auth_and_refuses_a_tokenless_client(tmp_path):
    """With RAY_AUTH_MODE=token in the user's environment, the local head the pool starts
    (a real `ray start --head`) runs in token mode: a client with the token joins, a client
    without one (auth disabled, no token file) is refused by the head."""
    token = "ab" * 32
    env = clean_env(HOME=str(tmp_path), HYBRIDRL_RAY_STATE=str(tmp_path / "ray"), PYTHONPATH=".")
    user = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}

    def python(code: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            env={**env, **extra},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )

    head = "from hybrid_engine.pool.cluster import local_head; print(local_head(True, 1))"
    p = python(head, **user)
    assert p.returncode == 0, p.stderr
    address = p.stdout.split()[-1]
    try:
        p = python(RAY_CLIENT, address, **user)
        assert (p.returncode, p.stdout.strip()) == (0, "nodes 1"), p.stderr[-2000:]
        # two tries (Ray's default: 20 tries, ~1 s apart)
        p = python(
            RAY_CLIENT, address, RAY_AUTH_MODE="disabled", RAY_gcs_server_port_wait_time_s="2"
        )
        assert p.returncode == 1 and "refused: " in p.stderr, p.stdout + p.stderr[-2000:]
        assert "Authentication token is missing or incorrect" in p.stderr
    finally:
        stop = "from hybrid_engine.pool.cluster import stop_local_head; stop_local_head()"
        python(stop, **user)


def mlflow_server_parts() -> tuple[dict, dict]:
    docs = {d["kind"]: d for d in documents(CLUSTER / "k8s" / "mlflow.yaml")}
    (container,) = containers_of(docs["Deployment"])
    return container, docs


def test_mlflow_server_refuses_missing_credentials_in_one_line(tmp_path):
    """The container's command (bash, then `exec mlflow server`, a stand-in here): a missing,
    empty or placeholder admin user, password or secret key stops it in one line; with all
    three it runs `mlflow server` with the Deployment's args."""
    container, docs = mlflow_server_parts()
    log = tmp_path / "calls.log"
    stand_in(tmp_path / "bin", "mlflow")
    argv = container["command"] + container["args"]
    full = {
        "MLFLOW_AUTH_ADMIN_USERNAME": "hybridrl",
        "MLFLOW_AUTH_ADMIN_PASSWORD": "password-of-the-test",
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "key-of-the-test",
    }
    base = clean_env(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", CALLS=str(log))
    for var in full:
        for bad in (None, "", f"{PLACEHOLDER}A-RANDOM-PASSWORD"):
            env = {**base, **full}
            if bad is None:
                del env[var]
            else:
                env[var] = bad
            p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
            assert (p.returncode, p.stdout) == (1, ""), (var, bad, p.stderr)
            (line,) = p.stderr.splitlines()
            assert line.startswith(f"mlflow: {var} is empty") and MLFLOW_SECRET in line
            assert not log.exists()
    p = subprocess.run(argv, env={**base, **full}, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    ((name, _, _, args),) = calls(log)
    assert (name, args) == ("mlflow", " ".join(["server", *container["args"]]))
    # its auth config: the ConfigMap's file, mounted where MLFLOW_AUTH_CONFIG_PATH says
    env = env_values(container)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "auth-config")
    volume = next(
        v
        for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "auth-config"
    )
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    (file,) = docs["ConfigMap"]["data"]
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == f"{mount['mountPath']}/{file}"


def test_mlflow_basic_auth_refuses_anonymous_clients(tmp_path, monkeypatch):
    """A real `mlflow server` run by the Deployment's command, args and auth config (the
    ConfigMap's file; the stores moved from the volume into a temp dir): /health answers the
    probes without credentials, the API refuses a client without credentials or with a wrong
    password (401), and a client with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD
    creates a run."""
    import urllib.error
    import urllib.request

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from servers import free_port, stop, wait_http

    container, docs = mlflow_server_parts()
    (ini,) = docs["ConfigMap"]["data"].values()
    assert "database_uri = sqlite:////mlflow/basic_auth.db" in ini
    (tmp_path / "basic_auth.ini").write_text(
        ini.replace("sqlite:////mlflow/", f"sqlite:///{tmp_path}/")
    )
    port = free_port()
    moved = {
        "--host": "127.0.0.1",
        "--port": str(port),
        "--backend-store-uri": f"sqlite:///{tmp_path}/mlflow.db",
        "--artifacts-destination": str(tmp_path / "artifacts"),
    }
    args = [
        f"{flag}={moved[flag]}" if (flag := a.split("=", 1)[0]) in moved else a
        for a in container["args"]
    ]
    user, password = "hybridrl", "password-of-the-test"
    plain = {k: v for k, v in env_values(container).items() if v is not None}
    env = clean_env(
        **{
            **plain,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "basic_auth.ini"),
            # what the Secret's keys username, password and flask_secret_key hold
            "MLFLOW_AUTH_ADMIN_USERNAME": user,
            "MLFLOW_AUTH_ADMIN_PASSWORD": password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "key-of-the-test",
        }
    )
    proc = subprocess.Popen(
        container["command"] + args,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 90, proc)  # the probes' path, without credentials
        request = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/search?max_results=1")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
        client = MlflowClient(tracking_uri=url)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
        with pytest.raises(MlflowException, match="401"):
            client.search_experiments()
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        experiment = client.create_experiment("auth-check")
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "x", 1.0)
        assert client.get_run(run.info.run_id).data.metrics == {"x": 1.0}
    finally:
        stop(proc)
