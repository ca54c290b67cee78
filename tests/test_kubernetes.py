"""The Kubernetes deployment checked on one machine: deploy/kubernetes rendered with kustomize and
validated offline against Kubernetes 1.33's schema; the image built from the working tree with
no network inside the build (Containerfile), its layers free of weights, keys and secrets; and
the fleet run from the same manifests with `podman kube play` (tiny preset, two target workers):
answers through the API container equal the target's greedy decoding, also when a target worker
container and the orchestrator container are killed mid-run. Skipped, with the reason, where
kubectl or podman is missing; everything podman made is removed, also on failure."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests import podman_image, test_precompile
from tests.conftest import greedy_cached, wait_until

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
sys.path.insert(0, str(KUBE))
import make_secrets
import podman_play

K8S_VERSION = "1.33.0"
WORKERS = ("specsplit-draft", "specsplit-target", "specsplit-pair")
# prompts whose tiny-target greedy answers run past 600 tokens before an end token (the first runs
# 2,915: test_api; the others came first from _long_prompts' seed search, tried first to spare the
# ~9 greedy decodes of that search); the kills wait on streamed chunks (8, then 4 more: a round
# each), far fewer than 600 tokens
LONG_PROMPTS = ([5, 17, 99, 3, 250], [276, 183, 239, 24, 339, 257, 109], [317, 297, 392, 372, 336, 217, 247])
LONG_TOKENS = 600
PROBE_ARG = re.compile(r"^[A-Za-z0-9_./:=@%+-]+$")  # podman joins exec probes with spaces for sh -c
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl is not installed (renders the kustomize overlays)")


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return podman_play.load(out.stdout)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def validate(docs: list[dict], tmp: Path) -> subprocess.CompletedProcess:
    import yaml

    path = tmp / f"manifests-{uuid.uuid4().hex[:8]}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    tool = Path(sys.executable).with_name("kubernetes-validate")
    return subprocess.run([str(tool), "--strict", "-k", K8S_VERSION, "--quiet", str(path)],
                          capture_output=True, text=True, timeout=300, check=False)


# ---------------------------------------------------------------------------- the probe script
def test_probe_reads_a_roles_metrics(tmp_path):
    import http.server

    text = b'# TYPE specsplit:router_workers_live gauge\nspecsplit:router_workers_live{service="target"} 2.0\n'

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 503)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = [sys.executable, str(REPO / "deploy" / "container" / "specsplit-probe")]
    port = str(server.server_address[1])

    def rc(*args: str) -> int:
        return subprocess.run([*probe, *args], capture_output=True, timeout=30, check=False).returncode

    try:
        assert rc("metrics", port) == 0
        assert rc("metrics", port, "--at-least", "specsplit:router_workers_live=2") == 0
        assert rc("metrics", port, "--at-least", "specsplit:router_workers_live=3") == 1
        assert rc("http", f"http://127.0.0.1:{port}/metrics") == 0
        assert rc("http", f"http://127.0.0.1:{port}/health") == 1
        assert rc("http", f"http://127.0.0.1:{port}/health", "--any-status") == 0
    finally:
        server.shutdown()
    assert rc("metrics", port) == 1  # nothing answers
    env = {**os.environ, "SPECSPLIT_PRESET": "tiny", "SPECSPLIT_CACHE_DIR": str(tmp_path)}
    assert subprocess.run([*probe, "models"], capture_output=True, env=env, timeout=60, check=False).returncode == 1


# ---------------------------------------------------------------------------- the manifests
@needs_kubectl
def test_manifests_validate_offline_and_follow_the_fleet(tmp_path):
    import inspect

    from specsplit.transport.worker_loop import WorkerLoop

    drain_s = inspect.signature(WorkerLoop).parameters["drain_timeout_s"].default
    secrets = podman_play.load(make_secrets.to_yaml(make_secrets.make_files()))
    for overlay in ("cpu", "gpu", "gpu-pair"):
        docs = kustomize(KUBE / "overlays" / overlay)
        res = validate(docs + secrets, tmp_path)
        assert res.returncode == 0, f"{overlay}: {res.stdout}{res.stderr}"
        configmaps = {**by_kind(docs + secrets, "ConfigMap")}
        provided = set(by_kind(secrets, "Secret")) | set(configmaps)
        for name, dep in by_kind(docs, "Deployment").items():
            spec = dep["spec"]["template"]["spec"]
            ctr = spec["containers"][0]
            assert spec["securityContext"]["runAsNonRoot"] and ctr["securityContext"]["readOnlyRootFilesystem"]
            assert ctr["resources"]["requests"] and ctr["resources"]["limits"], name
            for kind in ("readiness", "liveness"):
                cmd = ctr[f"{kind}Probe"]["exec"]["command"]
                assert cmd[0] == "specsplit-probe" and all(PROBE_ARG.match(a) for a in cmd), (name, cmd)
            ports = {p["containerPort"] for p in ctr["ports"]}
            assert int(dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]) in ports
            for vol in spec["volumes"]:  # every Secret and ConfigMap a pod mounts exists
                ref = (vol.get("secret") or {}).get("secretName") or (vol.get("configMap") or {}).get("name")
                assert ref is None or ref in provided, (name, ref)
            if name in WORKERS:  # a rolling update waits out the drain of the request in hand
                assert spec["terminationGracePeriodSeconds"] >= drain_s + 10, name
                assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        deployments = by_kind(docs, "Deployment")
        # CPU workers read the int8 target's codes from the read-only model volume: the Job writes them
        pull = by_kind(docs, "Job")["specsplit-models-pull"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert ("--int8-codes" in pull) == (overlay == "cpu"), (overlay, pull)
        if overlay == "gpu-pair":  # one pod per GPU serves both routers: no draft or target worker of its own
            assert not {"specsplit-draft", "specsplit-target"} & (set(deployments) | set(by_kind(docs, "Service")))
            pair = deployments["specsplit-pair"]["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"]: e.get("value") for e in pair["env"]}
            assert pair["args"] == ["specsplit", "pair"] and pair["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert env["SPECSPLIT_DRAFT_DEVICE"] == env["SPECSPLIT_TARGET_DEVICE"] == "cuda"
            assert {p["containerPort"] for p in pair["ports"]} == {9800, 9900}  # each role's metrics port
            continue
        target = deployments["specsplit-target"]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in target["env"]}
        if overlay == "gpu":
            assert target["resources"]["limits"]["nvidia.com/gpu"] == "1" and env["SPECSPLIT_TARGET_DEVICE"] == "cuda"
        else:
            assert "nvidia.com/gpu" not in target["resources"]["limits"]
    # the ServiceMonitor (a CRD: no schema here) names ports every Service has
    (monitor,) = kustomize(KUBE / "monitoring")
    services = by_kind(kustomize(KUBE / "overlays" / "cpu"), "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for name, svc in services.items():
        assert selector.items() <= svc["metadata"]["labels"].items(), name
        assert ports & {p["name"] for p in svc["spec"]["ports"]}, name
    # --strict catches a misspelled field
    bad = kustomize(KUBE / "overlays" / "cpu")
    by_kind(bad, "Deployment")["specsplit-api"]["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    assert validate(bad, tmp_path).returncode != 0


# ---------------------------------------------------------------------------- the image
@pytest.fixture(scope="module")
def image(tmp_path_factory):
    why = podman_image.missing_tools()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("podman")
    # podman refuses a run root over 50 characters, and pytest's folders (under xdist: .../popen-gw0/)
    # run longer: its storage lives in a short folder of its own, removed by reset()
    podman = podman_image.Podman(Path(tempfile.mkdtemp(prefix="specsplit-podman-")))
    try:
        context = podman_image.build_context(root / "context")
        built = podman_image.build_image(podman, context, f"localhost/specsplit:test-{uuid.uuid4().hex[:8]}")
        shutil.rmtree(context)
        record = {"build_s": round(built.build_s, 1), "size_mb": round(built.size_bytes / 1e6)}
        print(f"\nimage {built.tag}: built in {record['build_s']}s, {record['size_mb']} MB")
        (REPO / "runs").mkdir(exist_ok=True)
        (REPO / "runs" / "kubernetes-image.json").write_text(json.dumps(record) + "\n")
        yield podman, built
    finally:
        podman.reset()


WEIGHTS = (".safetensors", ".gguf", ".bin")
TENSORS = (".pt", ".pth", ".ckpt", ".onnx", ".npz")  # weights when large (torch ships a 3 KB test .pt)
KEY_NAMES = re.compile(r"(\.key_secret|\.key|fleet\.secret|api-keys|id_rsa[^/]*|id_ed25519[^/]*)$")
# a CURVE certificate's secret key (40 Z85 characters), a PEM private key
KEY_TEXT = re.compile(rb'secret-key\s*=\s*"[\x21-\x7e]{40}"|-----BEGIN [A-Z ]*PRIVATE KEY-----')


@pytest.mark.timeout(1800)
def test_image_layers_hold_no_weights_keys_or_secrets(image):
    podman, built = image
    found, files, layers = [], 0, set()
    for layer, path, size, head in podman_image.layer_files(podman, built.tag):
        files += 1
        layers.add(layer)
        weights = path.endswith(WEIGHTS) or (path.endswith(TENSORS) and size > 1 << 20)
        if weights or KEY_NAMES.search(path) or KEY_TEXT.search(head):
            found.append(f"layer {layer}: {path} ({size} bytes)")
    assert files > 10_000 and len(layers) >= 3, (files, layers)  # the base's, the install's and the scripts' were read
    assert not found, "\n".join(found)
    config = json.loads(podman("image", "inspect", built.tag).stdout)[0]["Config"]
    assert config["User"].split(":")[0] == "10001"
    assert not [e for e in config.get("Env", []) if re.search(r"SECRET|KEY", e.split("=")[0])], config["Env"]


@pytest.mark.timeout(1800)
def test_a_rebuild_after_a_code_change_ships_it_and_reuses_the_dependency_layers(image, tmp_path):
    """The image built again after a code change, as deploy/container/build.sh does: the layers up
    to the dependencies' are the first build's (a rebuild builds only the project's), and the new
    image runs the changed code. podman 4's buildah does not hash a bind mount's content: before
    the Containerfile COPYed each wheel folder's SHA256SUMS, this rebuild reused the whole first
    image, the older project's code in it."""
    podman, built = image
    marker = f"REBUILT_{uuid.uuid4().hex[:8]}"
    context = podman_image.build_context(tmp_path / "context", marker=f"{marker} = 1")
    again = podman_image.build_image(podman, context, f"{built.tag}-rebuilt")
    print(f"\nimage rebuilt after a code change in {again.build_s:.1f}s (first build {built.build_s:.1f}s)")
    try:
        first, second = (json.loads(podman("image", "inspect", "--format", "{{json .RootFS.Layers}}", tag).stdout)
                         for tag in (built.tag, again.tag))
        # the base, the dependencies' digest and the dependencies; then the project's digest, the
        # project and the scripts
        assert len(first) == len(second) == 6, (first, second)
        assert first[:3] == second[:3] and first[3] != second[3], (first, second)
        grep = "grep -c {m} /opt/specsplit/lib/python3*/site-packages/specsplit/__init__.py"
        for tag, want in ((again.tag, "1"), (built.tag, "0")):
            res = podman("run", "--rm", "--entrypoint", "/bin/sh", tag, "-c", grep.format(m=marker), check=False)
            assert res.stdout.strip() == want, (tag, res.stdout, res.stderr)
        # the rebuilt project's layer is small (its bytecode only: the dependencies' is in theirs),
        # and a process that loads a model as a worker does finds a current .pyc for everything
        sizes = [step["size"] for step in json.loads(podman("history", "--format", "json", again.tag).stdout)]
        assert sizes[5] < 20e6 < sizes[7], sizes  # newest first: the project's step, the dependencies'
        res = podman("run", "--rm", "--entrypoint", "python", again.tag, "-c", test_precompile.PROBE,
                     check=False, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got["modules"] > 1000 and got["stale"] == [], got["stale"][:20]
    finally:
        podman("rmi", "--force", again.tag, check=False, timeout=300)


# ---------------------------------------------------------------------------- the fleet
def _test_overlay(tmp: Path, tag: str) -> Path:
    """The CPU overlay as a test runs it: the tiny fp32 pair (its own greedy reference), two
    target workers, one thread per worker on this small machine, the image just built."""
    name, _, tag_only = tag.rpartition(":")
    ov = tmp / "overlay"
    ov.mkdir()
    (ov / "kustomization.yaml").write_text(f"""apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{os.path.relpath(KUBE / 'overlays' / 'cpu', ov)}]
configMapGenerator:
  - name: specsplit-env
    behavior: merge
    literals: [SPECSPLIT_DRAFT_QUANTIZE=none, SPECSPLIT_TARGET_QUANTIZE=none, SPECSPLIT_LOG_JSON=false]
  - name: specsplit-models
    behavior: merge
    literals: [SPECSPLIT_PRESET=tiny]
replicas: [{{name: specsplit-target, count: 2}}]
images: [{{name: localhost/specsplit, newName: {name}, newTag: {tag_only}}}]
patches:
  - target: {{kind: Deployment, name: "specsplit-(draft|target)"}}
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/resources
        value: {{requests: {{cpu: 100m, memory: 256Mi}}, limits: {{cpu: "1", memory: 2Gi}}}}
""")
    return ov


class Stream(threading.Thread):
    """One streamed completion through the API; ``chunks`` counts text chunks as they come."""

    def __init__(self, url: str, key: str, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.key, self.prompt, self.max_tokens = url, key, prompt, max_tokens
        self.text, self.chunks, self.final, self.error = "", 0, None, None

    def run(self) -> None:
        import httpx

        body = {"model": "tiny-v1", "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=240,
                              headers={"Authorization": f"Bearer {self.key}"}) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "choices" not in event:  # an error event, not a chunk
                        raise RuntimeError(f"the API sent {event}")
                    choice = event["choices"][0]
                    self.text += choice["text"]
                    self.chunks += 1
                    if choice.get("finish_reason"):
                        self.final = choice
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:  # reported by the test
            self.error = exc


def _free_subnet() -> str:
    """A /24 no interface or route of this machine uses (another podman's network may hold
    podman's default one, and two bridges with one gateway address break both)."""
    used = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=30, check=False).stdout
    for third in random.Random().sample(range(1, 255), 254):
        if f"10.231.{third}." not in used:
            return f"10.231.{third}.0/24"
    raise RuntimeError("no free 10.231.x.0/24 subnet")


def _crash(podman, ctr: str) -> None:
    """SIGKILL the container's process from outside, as the kernel's OOM killer would: a crash,
    which the restart policy restarts (`podman kill` counts as a stop by the user, and is not)."""
    os.kill(int(podman("inspect", "--format", "{{.State.Pid}}", ctr).stdout), signal.SIGKILL)


def _api_url(podman) -> str:
    infra = podman("pod", "inspect", "specsplit-api-pod-0", "--format", "{{.InfraContainerID}}").stdout.strip()
    nets = json.loads(podman("inspect", infra, "--format", "{{json .NetworkSettings.Networks}}").stdout)
    return f"http://{next(iter(nets.values()))['IPAddress']}:8000"


def _health(url: str) -> int:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=3).status_code
    except httpx.HTTPError:
        return 0


def _logs(podman, plan) -> str:
    out = []
    for pod in plan.pods():
        for line in podman("ps", "-a", "--filter", f"pod={pod}", "--format", "{{.Names}}", check=False).stdout.split():
            if not line.endswith("-infra"):
                res = podman("logs", "--tail", "25", line, check=False)
                out.append(f"--- {line}\n{res.stdout[-2500:]}{res.stderr[-2500:]}")
    return "\n".join(out)


@needs_kubectl
@pytest.mark.timeout(1800)
def test_fleet_from_the_manifests_answers_like_the_target(image, tmp_path):
    import httpx

    podman, built = image
    objects = make_secrets.make_files()
    key = objects["specsplit-api-keys"]["api-keys"].strip()
    docs = kustomize(_test_overlay(tmp_path, built.tag)) + podman_play.load(make_secrets.to_yaml(objects))
    plan, network = podman_play.adapt(docs), f"specsplit-{uuid.uuid4().hex[:8]}"
    podman("network", "create", "--subnet", _free_subnet(), network)
    t0 = time.monotonic()
    try:
        podman_play.up(plan, podman.cmd, network, job_timeout_s=300)
        url = _api_url(podman)
        wait_until(lambda: _health(url) == 200, 420, "the API serves", poll_s=1)
        up_s = time.monotonic() - t0
        # every readiness and liveness probe of the manifests passes in its container
        for ctr, probes in podman_play.probe_commands(plan).items():
            for kind, cmd in probes.items():
                res = podman("exec", ctr, *cmd, check=False, timeout=60)
                assert res.returncode == 0, f"{ctr} {kind}: {res.stdout}{res.stderr}"
        assert podman("exec", "specsplit-target-pod-0-target", "specsplit-probe", "models").returncode == 0
        model, tok = _served_reference(podman, tmp_path)

        # answers equal the target's greedy decoding
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        for seed in range(3):
            rng = random.Random(seed)
            prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(3, 12))]
            got = httpx.post(f"{url}/v1/completions", headers=headers, timeout=120, json={
                "model": "tiny-v1", "prompt": prompt, "max_tokens": 32, "temperature": 0}).json()
            assert got["choices"][0]["text"] == tok.decode(_expected(model, tok, prompt, 32)), got

        # a target worker and the orchestrator killed while three answers stream
        prompts, answers = _long_prompts(model, tok, 3, LONG_TOKENS)
        streams = [Stream(url, key, p, LONG_TOKENS) for p in prompts]
        for s in streams:
            s.start()

        def advanced(by: int, since: list[int]) -> bool:  # or one has ended: checked below
            return all(s.chunks >= m + by or not s.is_alive() for s, m in zip(streams, since))

        wait_until(lambda: advanced(8, [0] * 3), 120, "every stream started", poll_s=0.05)
        _crash(podman, "specsplit-target-pod-0-target")
        mark = [s.chunks for s in streams]
        wait_until(lambda: advanced(4, mark), 180, "streams go on", poll_s=0.05)
        assert all(s.is_alive() for s in streams), [(s.error, s.final) for s in streams]
        _crash(podman, "specsplit-orchestrator-pod-0-orchestrator")
        for s in streams:
            s.join(300)
        for s, answer in zip(streams, answers):
            assert s.error is None and s.final is not None, (s.error, s.text[-200:])
            assert s.text == tok.decode(answer)
            assert s.final["speculative"]["resumes"] >= 1  # it outlived its orchestrator
        for ctr in ("specsplit-target-pod-0-target", "specsplit-orchestrator-pod-0-orchestrator"):
            assert int(podman("inspect", "--format", "{{.RestartCount}}", ctr).stdout) >= 1, ctr
        wait_until(lambda: _health(url) == 200, 120, "the API serves again", poll_s=1)
        messages = [{"role": "user", "content": "def add(a, b):"}]
        got = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "tiny-v1", "messages": messages, "max_tokens": 24, "temperature": 0}).json()
        want = tok.decode(_expected(model, tok, tok.encode_chat(messages), 24))
        assert got["choices"][0]["message"]["content"] == want
        print(f"\nfleet: serving {up_s:.0f}s after kube play; test body {time.monotonic() - t0:.0f}s")
    except BaseException:
        print(_logs(podman, plan))  # shown with the failure
        raise
    finally:
        left = podman_play.down(plan, podman.cmd)
        podman("network", "rm", "--force", network, check=False)
        podman("rmi", "--force", built.tag, check=False, timeout=300)
    assert not left, left


def _served_reference(podman, tmp: Path):
    """The target the fleet serves, read back from its model-cache volume, and its tokenizer."""
    import tarfile

    from specsplit.api.tokenizer import ServedTokenizer
    from specsplit.models import load_model

    archive, out = tmp / "models.tar", tmp / "models"
    podman("volume", "export", "specsplit-models", "--output", str(archive), timeout=300)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    target = out / "models" / "tiny-v1" / "target"
    model, _ = load_model(target)
    return model, ServedTokenizer(target)


def _expected(model, tok, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of the target, ended at the first stop id (included), as the fleet ends it."""
    ids, _ = greedy_cached(model, prompt, n)
    for i, t in enumerate(ids):
        if t in tok.stop_token_ids:
            return ids[:i + 1]
    return ids


def _long_prompts(model, tok, count: int, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` prompts whose greedy answers run at least ``n`` tokens (still streaming when
    the test kills a container a few chunks in, however fast this machine), and those answers:
    LONG_PROMPTS first, then prompts drawn by seed (a target other than today's tiny one)."""
    def candidates():
        yield from LONG_PROMPTS
        for seed in itertools.count(100):
            rng = random.Random(seed)
            yield [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(4, 12))]

    prompts, answers = [], []
    for prompt in candidates():
        if len(prompts) == count:
            break
        answer = _expected(model, tok, prompt, n)
        if len(answer) == n:
            prompts.append(prompt)
            answers.append(answer)
    return prompts, answers
