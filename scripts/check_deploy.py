"""Cross-checks of deploy/ that no schema catches: the compose file, the Kubernetes
manifests (as `kubectl kustomize deploy/` built them), deploy/opgate.toml, the
Dockerfile and the opgate binary must agree on commands, roles, ports, files and
variables. Exits non-zero listing every disagreement.

usage: check_deploy.py OPGATE_BIN BUILT_MANIFESTS.yaml"""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ROLES = {"ingest", "relay", "dispatch", "reconcile", "api"}
problems = []


def problem(text):
    problems.append(text)


def port_of(listen):
    return int(listen.rsplit(":", 1)[1])


def check_opgate_args(where, args, opgate):
    """A command line of opgate: its subcommand exists and, for run, its roles do."""
    if not args:
        return
    sub = [a for a in args[:2] if not a.startswith("-")]
    help_run = subprocess.run([opgate, *sub, "--help"], capture_output=True, text=True)
    if help_run.returncode != 0:
        problem(f"{where}: `opgate {' '.join(sub)}` is not a command: {help_run.stderr.strip()[:200]}")
    if args[0] == "run" and "--roles" in args:
        roles = set(args[args.index("--roles") + 1].split(","))
        if roles - ROLES:
            problem(f"{where}: unknown roles {sorted(roles - ROLES)}")


def main():
    opgate, built = sys.argv[1], sys.argv[2]
    config_text = (DEPLOY / "opgate.toml").read_text()
    config = tomllib.loads(config_text)
    variables = set(re.findall(r"\$\{([A-Z0-9_]+)\}", config_text))
    api_port = port_of(config["api"]["listen"])
    metrics_port = port_of(config["metrics"]["listen"])

    # ---- compose ----
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    opgate_services = {n: s for n, s in services.items() if s.get("image") == "opgate:local"}
    for name, svc in services.items():
        if "image" not in svc and "build" not in svc:
            problem(f"compose {name}: neither image nor build")
        for dep in svc.get("depends_on", {}):
            if dep not in services:
                problem(f"compose {name}: depends on unknown service {dep}")
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                if not (DEPLOY / source).exists():
                    problem(f"compose {name}: mounts {source}, which does not exist")
    built_by = {s["build"]["dockerfile"] for s in opgate_services.values() if "build" in s}
    for dockerfile in built_by:
        if not (DEPLOY / ".." / dockerfile).exists():
            problem(f"compose: Dockerfile {dockerfile} not found")
    for name, svc in opgate_services.items():
        env = svc.get("environment", {})
        if name != "demo-agent":
            check_opgate_args(f"compose {name}", svc.get("command", []), opgate)
        missing = variables - set(env)
        if missing:
            problem(f"compose {name}: opgate.toml needs {sorted(missing)}, not in its environment")
        for token in ("OPGATE_OPERATOR_TOKEN", "OPGATE_VIEWER_TOKEN", "OPGATE_AGENT_TOKEN"):
            default = re.search(r":-([^}]*)\}", str(env.get(token, "")))
            if default and len(default.group(1)) < 16:
                problem(f"compose {name}: the default {token} is shorter than 16 characters (refused)")
        sim_url = env.get("OPGATE_SIM_URL", "")
        host, port = sim_url.removeprefix("http://").split(":")
        sim_cmd = services.get(host, {}).get("command", [])
        if host not in services or f"0.0.0.0:{port}" not in sim_cmd:
            problem(f"compose {name}: OPGATE_SIM_URL {sim_url} is not where the sim service listens")
    api_ports = services["opgate-api"].get("ports", [])
    if f"{api_port}:{api_port}" not in api_ports:
        problem(f"compose opgate-api: publishes {api_ports}, the API listens on {api_port}")
    prometheus = yaml.safe_load((DEPLOY / "compose/prometheus.yml").read_text())
    for job in prometheus["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host, port = target.split(":")
            if host not in opgate_services:
                problem(f"prometheus: scrapes {host}, not an opgate service")
            if int(port) != metrics_port:
                problem(f"prometheus: scrapes port {port}, [metrics] listen is {metrics_port}")
    runs = {n for n, s in opgate_services.items() if (s.get("command") or [None])[0] == "run"}
    scraped = {t.split(":")[0] for j in prometheus["scrape_configs"] for t in j["static_configs"][0]["targets"]}
    if runs - scraped:
        problem(f"prometheus: does not scrape {sorted(runs - scraped)}")
    rules = yaml.safe_load((DEPLOY / "prometheus/opgate-alerts.yml").read_text())
    if not rules.get("groups"):
        problem("prometheus: the alert rules file has no groups")
    dash = DEPLOY / "grafana/opgate-dashboard.json"
    if not dash.exists():
        problem("grafana: the dashboard is missing")

    # ---- Kubernetes ----
    docs = [d for d in yaml.safe_load_all(Path(built).read_text()) if d]
    kinds = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    configmaps = {c["metadata"]["name"]: c for c in kinds.get("ConfigMap", [])}
    for cm in configmaps.values():
        if cm["data"].get("opgate.toml") != config_text:
            problem(f"kubernetes: ConfigMap {cm['metadata']['name']} is not deploy/opgate.toml")
    deployments = {d["metadata"]["name"]: d for d in kinds.get("Deployment", [])}
    for want in ("opgate-ingest", "opgate-dispatch", "opgate-api"):
        if want not in deployments:
            problem(f"kubernetes: no Deployment {want}")
    covered_roles = set()
    workloads = list(deployments.values()) + kinds.get("Job", [])
    for d in workloads:
        name = d["metadata"]["name"]
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod.get("initContainers", []) + pod["containers"]:
            where = f"kubernetes {name}/{c['name']}"
            if c["image"].startswith("opgate"):
                check_opgate_args(where, c.get("args", []), opgate)
                args = c.get("args", [])
                if args and args[0] == "run":
                    covered_roles |= set(args[args.index("--roles") + 1].split(","))
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                spec = c.get(probe)
                if not spec:
                    if c["image"].startswith("opgate") and d["kind"] == "Deployment" and name != "opgate-sim":
                        problem(f"{where}: no {probe}")
                    continue
                get = spec.get("httpGet") or spec.get("tcpSocket")
                port = get["port"]
                number = ports.get(port, port)
                if isinstance(port, str) and port not in ports:
                    problem(f"{where}: {probe} names port {port}, which the container does not declare")
                if spec.get("httpGet"):
                    if spec["httpGet"]["path"] not in ("/healthz", "/readyz"):
                        problem(f"{where}: {probe} on {spec['httpGet']['path']}")
                    if number not in (api_port, metrics_port):
                        problem(f"{where}: {probe} on port {number}: opgate serves probes on {api_port} and {metrics_port}")
            for mount in c.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problem(f"{where}: mounts unknown volume {mount['name']}")
                cm = volumes[mount["name"]].get("configMap", {}).get("name")
                if cm and cm not in configmaps:
                    problem(f"{where}: ConfigMap {cm} is not generated")
            secrets = [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
            if c["image"].startswith("opgate") and c["name"] != "sim" and secrets != ["opgate-secrets"]:
                problem(f"{where}: takes its environment from {secrets}, not opgate-secrets")
        sc = pod.get("securityContext", {})
        if not sc.get("runAsNonRoot"):
            problem(f"kubernetes {name}: not runAsNonRoot")
    if covered_roles != ROLES:
        problem(f"kubernetes: roles {sorted(ROLES - covered_roles)} run nowhere")
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    for pdb in kinds.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"]["matchLabels"]
        if not any(all(l.get(k) == v for k, v in sel.items()) for l in labels.values()):
            problem(f"kubernetes PDB {pdb['metadata']['name']}: selects no Deployment")
    for so in kinds.get("ScaledObject", []):
        target = so["spec"]["scaleTargetRef"]["name"]
        if target not in deployments:
            problem(f"kubernetes ScaledObject {so['metadata']['name']}: scales unknown {target}")
    for svc in kinds.get("Service", []):
        sel = svc["spec"]["selector"]
        matched = [n for n, l in labels.items() if all(l.get(k) == v for k, v in sel.items())]
        if not matched:
            problem(f"kubernetes Service {svc['metadata']['name']}: selects no Deployment")
    secret_doc = (DEPLOY / "README.md").read_text()
    for var in sorted(variables):
        if var not in secret_doc:
            problem(f"deploy/README.md: does not say where {var} comes from")

    # ---- Dockerfile ----
    dockerfile = (ROOT / "Dockerfile").read_text()
    rust_version = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["rust-version"]
    image = re.search(r"FROM rust:([0-9.]+)", dockerfile)
    if not image or tuple(map(int, image.group(1).split("."))) < tuple(map(int, rust_version.split("."))):
        problem(f"Dockerfile: the build image's Rust is older than rust-version {rust_version}")
    for source in re.findall(r"^COPY (?!--from)(\S+) ", dockerfile, re.M):
        if source != "." and not (ROOT / source).exists():
            problem(f"Dockerfile: COPY {source}, which does not exist")
    if "USER 10001" not in dockerfile or 'ENTRYPOINT ["opgate"]' not in dockerfile:
        problem("Dockerfile: must run as the non-root user 10001 with opgate as its entrypoint")

    for p in problems:
        print("deploy check:", p)
    print(f"deploy check: {len(problems)} problem(s) in {len(services)} compose services, "
          f"{len(docs)} Kubernetes objects, the Dockerfile and deploy/opgate.toml")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
