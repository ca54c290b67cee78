"""The real pair served from containers: the CPU overlay's manifests (Qwen2.5-Coder 0.5B draft,
1.5B target, int8) run with `podman kube play`, the models read from a cache volume, the demo's
prompts asked through the API container. Writes a result file (docs/results.md).

    deploy/container/build.sh localhost/specsplit:latest        # the image, in podman's storage
    python ops/kubernetes_real_pair.py --out ops/results/kubernetes-real-pair-cpu2.json

The cache volume holds this machine's models (``--cache``, default ~/.cache/specsplit, filled by
`specsplit models pull`), linked into a folder bound as the claim's volume, so removing the
volume touches no file of the cache; the model-cache Job runs as in a cluster and finds the
models there. Everything it starts is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "deploy" / "kubernetes"))
import make_secrets
import podman_play

PROMPTS = [  # ops/demo.sh's
    "Write a Python function that returns True when a number is prime.",
    "Explain in two sentences what a KV cache does in a transformer.",
    "def fibonacci(n):",
    "Write a Python one-liner that reverses a string.",
]


def overlay(tmp: Path, image: str) -> Path:
    name, _, tag = image.rpartition(":")
    ov = tmp / "overlay"
    ov.mkdir()
    (ov / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(REPO / 'deploy' / 'kubernetes' / 'overlays' / 'cpu', ov)}]\n"
        f"images: [{{name: localhost/specsplit, newName: {name}, newTag: {tag}}}]\n"
        # this machine's cores, as honcho's fleet splits them: the draft one thread, the target all
        "patches:\n" + "".join(
            f"  - target: {{kind: Deployment, name: specsplit-{role}}}\n    patch: |-\n"
            f"      - {{op: replace, path: /spec/template/spec/containers/0/resources/limits/cpu, value: \"{cpus}\"}}\n"
            for role, cpus in (("draft", 1), ("target", os.cpu_count()))))
    return ov


def ask(url: str, key: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=900, json={
        "model": "qwen2.5-coder-1.5b-instruct", "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}]})
    r.raise_for_status()
    body, wall = r.json(), time.perf_counter() - t0
    choice = body["choices"][0]
    return {"prompt": prompt, "answer": choice["message"]["content"], "finish_reason": choice["finish_reason"],
            "completion_tokens": body["usage"]["completion_tokens"], "wall_s": round(wall, 2),
            "tok_s": round(body["usage"]["completion_tokens"] / wall, 2), "speculative": choice["speculative"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default="localhost/specsplit:latest")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/specsplit"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", help="write the result JSON here")
    args = p.parse_args(argv)
    podman, network = ["podman"], f"specsplit-real-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        rendered = subprocess.run(["kubectl", "kustomize", str(overlay(Path(tmp), args.image))], check=True,
                                  capture_output=True, text=True, timeout=120).stdout
    objects = make_secrets.make_files()
    key = objects["specsplit-api-keys"]["api-keys"].strip()
    plan = podman_play.adapt(podman_play.load(rendered) + podman_play.load(make_secrets.to_yaml(objects)))
    plan.claims = []  # the claim's volume: a folder of this machine's models, bound below
    record = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, {platform.machine()}",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=REPO, check=False).stdout.strip(),
              "command": "python ops/kubernetes_real_pair.py " + " ".join(argv or sys.argv[1:]),
              "image": args.image, "overlay": "deploy/kubernetes/overlays/cpu", "answers": []}
    from specsplit.models.presets import get_preset

    volume = Path(tempfile.mkdtemp(prefix="specsplit-models-"))
    volume.chmod(0o755)  # read by the containers' user
    preset = get_preset("qwen-coder")
    for model in {preset.draft.name, preset.target.name}:
        (volume / "models").mkdir(exist_ok=True)
        subprocess.run(["cp", "-al", str(Path(args.cache) / "models" / model), str(volume / "models")], check=True)
    podman_play.run(podman, "network", "create", network)
    podman_play.run(podman, "volume", "create", "--opt", "type=none", "--opt", "o=bind",
                    "--opt", f"device={volume}", "specsplit-models")
    t0 = time.monotonic()
    try:
        podman_play.up(plan, podman, network)
        infra = podman_play.run(podman, "pod", "inspect", "specsplit-api-pod-0", "--format",
                                "{{.InfraContainerID}}").stdout.strip()
        nets = json.loads(podman_play.run(podman, "inspect", infra, "--format",
                                          "{{json .NetworkSettings.Networks}}").stdout)
        url = f"http://{next(iter(nets.values()))['IPAddress']}:8000"
        while podman_play.run(podman, "exec", "specsplit-api-pod-0-api", "specsplit-probe", "http",
                              "http://127.0.0.1:8000/health", check=False).returncode:
            if time.monotonic() - t0 > 1800:
                raise TimeoutError("the fleet did not serve in 30 min")
            time.sleep(5)
        record["serving_after_s"] = round(time.monotonic() - t0, 1)
        print(f"serving after {record['serving_after_s']}s at {url}", file=sys.stderr)
        for prompt in PROMPTS:
            answer = ask(url, key, prompt, args.max_tokens)
            print(f"=== {prompt}\n{answer['answer']}\n[{answer['completion_tokens']} tokens, {answer['tok_s']} tok/s]",
                  file=sys.stderr)
            record["answers"].append(answer)
    finally:
        left = podman_play.down(plan, podman)
        podman_play.run(podman, "network", "rm", "--force", network, check=False)
        subprocess.run(["rm", "-rf", str(volume)], check=False)
        print("\n".join(left) or "removed", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
