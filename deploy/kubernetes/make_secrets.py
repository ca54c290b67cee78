"""Fresh keys for a SpecSplit fleet on Kubernetes, as the manifests' Secrets and ConfigMap (YAML).

    python deploy/kubernetes/make_secrets.py --out specsplit-secrets.yaml   # mode 0600; then
    kubectl apply -n NAMESPACE -f specsplit-secrets.yaml

What it makes (the names deploy/kubernetes/base mounts):
- Secret ``specsplit-fleet``: ``fleet.secret``, the secret every router peer proves;
- Secret ``specsplit-curve-server``: ``server.key_secret``, the CURVE keypair of the routers and
  the orchestrator (servers);
- Secret ``specsplit-curve-client``: ``client.key_secret``, the keypair of the workers and the
  API (clients);
- Secret ``specsplit-api-keys``: ``api-keys``, one API key (printed on stderr) or ``--api-key``'s;
- ConfigMap ``specsplit-curve-public``: ``server.key`` (the servers' public key, which clients
  check) and ``authorized.keys`` (the public keys servers admit: the client's and the servers'
  own, since the orchestrator is the routers' client).

Keys are made as ``specsplit keys new`` makes them (brokers.curve). Rotating: run it again, apply,
and restart every Deployment (``kubectl rollout restart deployment -l app.kubernetes.io/name=specsplit``).
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LABELS = {"app.kubernetes.io/name": "specsplit", "app.kubernetes.io/part-of": "specsplit"}


def make_files(api_key: str | None = None) -> dict[str, dict[str, str]]:
    """{object name: {file name: text}}: fresh secrets and keys (CURVE keypairs as files in the
    zmq.auth certificate format, as `specsplit keys new` writes them)."""
    sys.path.insert(0, str(REPO))  # brokers, from a checkout
    from brokers.curve import load_keypair, write_keypair

    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name in ("server", "client"):
            public, secret = write_keypair(tmp, name)
            files[name] = (public.read_text(), secret.read_text(), load_keypair(secret)[0].decode())
    return {
        "specsplit-fleet": {"fleet.secret": secrets.token_hex(32) + "\n"},
        "specsplit-curve-server": {"server.key_secret": files["server"][1]},
        "specsplit-curve-client": {"client.key_secret": files["client"][1]},
        "specsplit-api-keys": {"api-keys": (api_key or f"sk-{secrets.token_urlsafe(32)}") + "\n"},
        "specsplit-curve-public": {
            "server.key": files["server"][0],
            "authorized.keys": f"{files['server'][2]} servers (routers, orchestrator)\n"
                               f"{files['client'][2]} clients (workers, API)\n",
        },
    }


def to_yaml(objects: dict[str, dict[str, str]], namespace: str | None = None) -> str:
    """Kubernetes YAML: a ConfigMap for ``specsplit-curve-public``, an Opaque Secret for the rest."""
    import yaml

    docs = []
    for name, files in objects.items():
        meta = {"name": name, "labels": dict(LABELS), **({"namespace": namespace} if namespace else {})}
        if name == "specsplit-curve-public":
            docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": files})
        else:
            data = {k: base64.b64encode(v.encode()).decode() for k, v in files.items()}
            docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": data})
    return yaml.safe_dump_all(docs, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy/kubernetes/make_secrets.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the YAML here (mode 0600) instead of stdout")
    p.add_argument("--namespace", help="put the objects in this namespace")
    p.add_argument("--api-key", help="the API key clients send (default: a fresh one, printed on stderr)")
    args = p.parse_args(argv)
    objects = make_files(args.api_key)
    text = to_yaml(objects, args.namespace)
    if args.out:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if not args.api_key:
        print(f"API key: {objects['specsplit-api-keys']['api-keys'].strip()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
