#!/usr/bin/env bash
# Offline checks of deploy/ (no Docker engine, no cluster runs here): what each step
# proves is in deploy/README.md. Installs what it needs; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
OPGATE="${OPGATE_BIN:-$PWD/target/debug/opgate}"
PY=target/py/bin/python
if [ ! -x "$PY" ]; then python3 -m venv target/py; fi
target/py/bin/pip install -q --disable-pip-version-check pyyaml kubernetes-validate
command -v docker-compose >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq docker-compose; }
command -v kubectl >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq kubectl; }

echo "-- opgate config check: deploy/opgate.toml with its variables set as compose sets them"
OPGATE_DATABASE_URL=postgres://opgate:opgate@postgres:5432/opgate \
OPGATE_KAFKA_BROKERS=kafka:9092 OPGATE_SIM_URL=http://sim:9400 \
OPGATE_OPERATOR_TOKEN=operator-demo-token-change-me OPGATE_VIEWER_TOKEN=viewer-demo-token-change-me \
OPGATE_AGENT_TOKEN=agent-demo-token-change-me \
  "$OPGATE" config check --config deploy/opgate.toml

echo "-- docker-compose config: deploy/compose.yaml against the Compose schema"
docker-compose -f deploy/compose.yaml config -q

echo "-- kubectl kustomize deploy/, then kubernetes-validate --strict (Kubernetes 1.31 schemas)"
mkdir -p target
kubectl kustomize deploy > target/deploy-kubernetes.yaml
# The validator has no schema for KEDA's ScaledObject (a CRD): it checks every other
# object, failing on any error; check_deploy.py checks the ScaledObjects' targets.
"$PY" - <<'PY'
import subprocess, sys, yaml, tempfile, os
docs = [d for d in yaml.safe_load_all(open("target/deploy-kubernetes.yaml")) if d]
known = [d for d in docs if not d["apiVersion"].startswith("keda.sh/")]
with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    yaml.safe_dump_all(known, f)
r = subprocess.run(["target/py/bin/kubernetes-validate", "--strict", "--quiet", "-k", "1.31.0", f.name])
os.unlink(f.name)
print(f"-- {len(known)} core objects valid" if r.returncode == 0 else "-- invalid objects above")
sys.exit(r.returncode)
PY

echo "-- cross-references: commands, roles, ports, files, variables"
"$PY" scripts/check_deploy.py "$OPGATE" target/deploy-kubernetes.yaml
