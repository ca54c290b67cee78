"""Run the rendered Kubernetes manifests on one machine with `podman kube play` (podman 4.3+).

    kubectl kustomize deploy/kubernetes/overlays/cpu > fleet.yaml
    python deploy/kubernetes/make_secrets.py --out secrets.yaml
    python deploy/kubernetes/podman_play.py up fleet.yaml secrets.yaml     # Job first, then the fleet
    python deploy/kubernetes/podman_play.py down fleet.yaml secrets.yaml

The manifests are the ones a cluster gets; ``adapt`` changes only what podman lacks or does
otherwise, each change said where it is made:

- no Services: a Service's DNS name in an address (``tcp://NAME:``) becomes the name podman gives
  the first pod of the one Deployment it selects (``DEPLOYMENT-pod-0``; podman's DNS resolves
  pod names on a network);
- a Job becomes a Pod run to completion (``restartPolicy: Never``) before the Deployments, so
  their init containers, which wait for what the Jobs make, are dropped (podman 4.3 gives init
  containers the pod's restart policy: under ``Always`` one that succeeds runs again forever);
- podman publishes every ``containerPort`` on the host: the ports are dropped (pods reach each
  other on the podman network);
- an ``emptyDir`` is a named volume shared by every pod that names it: each is renamed
  ``OWNER-VOLUME``;
- before 4.8, podman writes a Secret volume's ``data`` values without base64-decoding them: the
  Secrets are created with ``podman secret create``, holding the decoded text;
- kinds podman ignores (PodDisruptionBudget, ServiceMonitor) are dropped.
Probes become podman healthchecks only where podman runs them (a systemd host): ``probe_commands``
gives each container's readiness and liveness commands to run with ``podman exec``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RUN_KINDS = ("Deployment", "Pod")


@dataclass
class Plan:
    """What ``up`` runs: ``jobs`` (Pod documents, run to completion first) and ``fleet``
    (Deployments), each with the ConfigMaps and volume claims before them; ``secrets``: name ->
    {file: text}; ``volumes``: the named volumes podman will make (for ``down``)."""

    configmaps: list[dict] = field(default_factory=list)
    claims: list[dict] = field(default_factory=list)
    jobs: list[dict] = field(default_factory=list)
    fleet: list[dict] = field(default_factory=list)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    volumes: list[str] = field(default_factory=list)

    def pods(self) -> list[str]:
        """Every pod podman will make, jobs first."""
        names = [j["metadata"]["name"] for j in self.jobs]
        for d in self.fleet:
            names += [f"{d['metadata']['name']}-pod-{i}" for i in range(d["spec"].get("replicas", 1))]
        return names


def load(text: str) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(text) if d]


def podman_version(podman: list[str]) -> tuple[int, int]:
    out = subprocess.run([*podman, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    major, minor = re.match(r"(\d+)\.(\d+)", out.strip()).groups()
    return int(major), int(minor)


def service_hosts(docs: list[dict]) -> dict[str, str]:
    """Service name -> the pod name podman gives the first replica of the one Deployment it selects."""
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    hosts = {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"].get("selector") or {}
        chosen = [d for d in deployments
                  if selector.items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()]
        if selector and len(chosen) == 1:
            hosts[svc["metadata"]["name"]] = f"{chosen[0]['metadata']['name']}-pod-0"
    return hosts


def _rehost(value: str, hosts: dict[str, str]) -> str:
    for name, pod in hosts.items():
        value = re.sub(rf"(?<=://){re.escape(name)}(?=:)", pod, value)
    return value


def _pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def _adapt_pod(doc: dict, hosts: dict[str, str], volumes: list[str]) -> dict:
    doc = copy.deepcopy(doc)
    spec, owner = _pod_spec(doc), doc["metadata"]["name"]
    renamed = {}
    for vol in spec.get("volumes", []):
        if "emptyDir" in vol:  # a named volume in podman: one per owner, not one per name
            renamed[vol["name"]] = vol["name"] = f"{owner}-{vol['name']}"
            volumes.append(vol["name"])
        elif "secret" in vol or "configMap" in vol:  # podman keeps these as named volumes too
            volumes.append(vol["secret"]["secretName"] if "secret" in vol else vol["configMap"]["name"])
    if doc["kind"] != "Pod":
        spec.pop("initContainers", None)  # they wait for the Jobs, which ran first
    for ctr in spec.get("initContainers", []) + spec["containers"]:
        ctr.pop("ports", None)  # podman would publish each on the host
        for env in ctr.get("env", []):
            if "value" in env:
                env["value"] = _rehost(env["value"], hosts)
        for mount in ctr.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
    return doc


def adapt(docs: list[dict]) -> Plan:
    """The podman plan for rendered manifests (see the module docstring for each change)."""
    hosts, plan = service_hosts(docs), Plan()
    for doc in docs:
        kind = doc["kind"]
        if kind == "ConfigMap":
            doc = copy.deepcopy(doc)
            doc["data"] = {k: _rehost(v, hosts) for k, v in (doc.get("data") or {}).items()}
            plan.configmaps.append(doc)
        elif kind == "PersistentVolumeClaim":
            plan.claims.append(doc)
            plan.volumes.append(doc["metadata"]["name"])
        elif kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
            plan.secrets[doc["metadata"]["name"]] = {**data, **(doc.get("stringData") or {})}
        elif kind == "Job":
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": doc["metadata"]["name"]},
                   "spec": {**copy.deepcopy(doc["spec"]["template"]["spec"]), "restartPolicy": "Never"}}
            plan.jobs.append(_adapt_pod(pod, hosts, plan.volumes))
        elif kind in RUN_KINDS:
            plan.fleet.append(_adapt_pod(doc, hosts, plan.volumes))
    return plan


def secret_document(name: str, files: dict[str, str], version: tuple[int, int]) -> str:
    """What ``podman secret create NAME -`` stores for a Secret volume: a Secret document, with
    plain text in ``data`` before podman 4.8 (which writes those values as they are)."""
    if version >= (4, 8):
        data = {k: base64.b64encode(v.encode()).decode() for k, v in files.items()}
    else:
        data = files
    return json.dumps({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": data})


def plan_yaml(plan: Plan, part: str) -> str:
    """The YAML of ``part`` ("jobs" or "fleet"), ConfigMaps and claims first (podman reads
    ConfigMaps in document order; the claims are made once, with the jobs)."""
    import yaml

    head = plan.configmaps + (plan.claims if part == "jobs" else [])
    return yaml.safe_dump_all(head + getattr(plan, part), sort_keys=False)


def probe_commands(plan: Plan) -> dict[str, dict[str, list[str]]]:
    """container name as podman names it -> {"readiness": argv, "liveness": argv} (exec probes)."""
    out = {}
    for doc in plan.fleet:
        for i in range(doc["spec"].get("replicas", 1)):
            for ctr in _pod_spec(doc)["containers"]:
                probes = {kind: ctr[f"{kind}Probe"]["exec"]["command"] for kind in ("readiness", "liveness")
                          if "exec" in ctr.get(f"{kind}Probe", {})}
                out[f"{doc['metadata']['name']}-pod-{i}-{ctr['name']}"] = probes
    return out


# ---- running it -------------------------------------------------------------------------------
def run(podman: list[str], *args: str, input: str | None = None, timeout: float = 300, check: bool = True):
    res = subprocess.run([*podman, *args], input=input, capture_output=True, text=True, timeout=timeout, check=False)
    if check and res.returncode:
        raise RuntimeError(f"podman {' '.join(args[:3])} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res


def container_state(podman: list[str], name: str) -> dict:
    res = run(podman, "inspect", "--format", "{{json .State}}", name, check=False, timeout=60)
    return json.loads(res.stdout) if res.returncode == 0 else {}


def up(plan: Plan, podman: list[str], network: str, job_timeout_s: float = 1800) -> None:
    """Secrets, then each Job to completion (exit 0), then the fleet."""
    version = podman_version(podman)
    for name, files in plan.secrets.items():
        run(podman, "secret", "create", name, "-", input=secret_document(name, files, version))
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("jobs", "fleet"):
            if not getattr(plan, part):
                continue
            path = Path(tmp) / f"{part}.yaml"
            path.write_text(plan_yaml(plan, part))
            run(podman, "kube", "play", "--network", network, str(path), timeout=600)
            if part == "jobs":
                for job in plan.jobs:
                    wait_job(podman, job, job_timeout_s)


def wait_job(podman: list[str], job: dict, timeout_s: float) -> None:
    name = job["metadata"]["name"]
    ctr = f"{name}-{job['spec']['containers'][0]['name']}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = container_state(podman, ctr)
        if state.get("Status") == "exited":
            if state.get("ExitCode") != 0:
                logs = run(podman, "logs", ctr, check=False).stderr[-3000:]
                raise RuntimeError(f"job {name} exited {state.get('ExitCode')}:\n{logs}")
            return
        time.sleep(1)
    raise TimeoutError(f"job {name} did not finish in {timeout_s:.0f}s")


def down(plan: Plan, podman: list[str]) -> list[str]:
    """Remove every pod, volume and secret of ``plan``; returns what could not be removed."""
    left = []
    for pod in reversed(plan.pods()):
        res = run(podman, "pod", "rm", "--force", "--time", "10", pod, check=False, timeout=120)
        if res.returncode and "no pod with name" not in res.stderr:
            left.append(f"pod {pod}: {res.stderr.strip()}")
    for vol in dict.fromkeys(plan.volumes):
        res = run(podman, "volume", "rm", "--force", vol, check=False, timeout=60)
        if res.returncode and "no such volume" not in res.stderr:
            left.append(f"volume {vol}: {res.stderr.strip()}")
    for name in plan.secrets:
        res = run(podman, "secret", "rm", name, check=False, timeout=60)
        if res.returncode and "no such secret" not in res.stderr:
            left.append(f"secret {name}: {res.stderr.strip()}")
    return left


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy/kubernetes/podman_play.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("manifests", nargs="+", help="rendered YAML files (the fleet, the secrets)")
    p.add_argument("--network", default="specsplit", help="podman network (made if missing)")
    args = p.parse_args(argv)
    docs = [d for f in args.manifests for d in load(Path(f).read_text())]
    podman = ["podman"]
    plan = adapt(docs)
    if args.action == "up":
        if run(podman, "network", "exists", args.network, check=False).returncode:
            run(podman, "network", "create", args.network)
        up(plan, podman, args.network)
        print("pods:", " ".join(plan.pods()))
        return 0
    left = down(plan, podman)
    print("\n".join(left) or "removed")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
