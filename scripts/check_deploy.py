#!/usr/bin/python3
"""Checks deploy/ (Kubernetes manifests, KServe objects, Prometheus and prometheus-adapter config, Grafana
dashboard, Dockerfiles) without a cluster. Debian python3-yaml, and the tools of scripts/install_deploy_check.sh.

  1. kubernetes-validate (pinned in scripts/deploy-check-requirements.txt) --strict against Kubernetes
     KUBERNETES_VERSION: every object of a built-in kind of the base (deploy/kubernetes) and of the overlays as
     kustomize renders them (deploy/kubernetes/gpu, deploy/kubernetes/repository: each patch merged into the base
     Deployment here, containers and volumes by name, the way a strategic merge patch does). Not validated by a schema: the CRDs' objects (KServe's
     ServingRuntime and InferenceService, the Prometheus operator's ServiceMonitor), whose schemas come with those
     operators' release manifests (not in any package this project installs; KServe's CRDs alone are megabytes of
     OpenAPI) and Kustomization files (kustomize's own config). Their fields are checked by the cross references
     below.
  2. checkov (pinned likewise) with its Kubernetes and Dockerfile checks on deploy/, the overlays rendered: every
     finding must be fixed or skipped in the manifest (a checkov.io/skipN annotation, or a Dockerfile's
     "# checkov:skip=ID: reason" comment) with its reason.
  3. What no tool checks, the cross references: Service/PDB/ServiceMonitor selectors match the Deployment's pod
     labels, named target ports exist, the gRPC Service is headless, the HPA targets the Deployment and its metric
     is the prometheus-adapter rule's, the InferenceService's runtime and model format exist, the KServe runtime's
     h2c port, kustomization resources and patches exist, the ConfigMaps pods mount (the client policy) exist and are
     mounted; container args are real mita-server flags
     (server/process/main.cc); terminationGracePeriodSeconds covers preStop plus --drain_timeout_s; readiness and liveness
     use the gRPC health service, liveness on the server's liveness name (server/frontend/health_service.h); every metric
     named in the Grafana dashboard, the HPA, the adapter rule and the Prometheus config is a series of
     docs/metrics.md (histograms with _bucket/_sum/_count), and the dashboard has the panels the docs promise.
Without the tools (/opt/mita/deploy-check; DEPLOY_CHECK_BIN elsewhere) only 3 runs, and the exit status is 77
(ctest: skipped), or 1 when CI is set.
Usage: scripts/check_deploy.py [REPO_ROOT]. Prints what it checked; exit 1 on problems.
"""
import copy
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
TOOLS = os.environ.get("DEPLOY_CHECK_BIN", "/opt/mita/deploy-check/bin")
KUBERNETES_VERSION = "1.33.0"
# Kinds of the CRDs used here (no schema validation, see the docstring) and kustomize's config.
NOT_BUILT_IN = {"ServiceMonitor", "ServingRuntime", "InferenceService", "Kustomization"}
problems = []
checked = []


def problem(where, message):
    problems.append(f"{os.path.relpath(where, ROOT)}: {message}")


def documented_metrics():
    """name -> (type, labels) from the metrics table of docs/metrics.md (the table metrics_docs_test checks)."""
    table, inside = {}, False
    for line in open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8"):
        if line.startswith("| name | type | labels | meaning |"):
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                break
            if line.startswith("|---"):
                continue
            cells = [c.strip() for c in line.split("|")]
            table[cells[1].strip("`")] = (cells[2], {l.strip() for l in cells[3].split(",") if l.strip()})
    return table


METRICS = documented_metrics()


def check_metric_names(where, text):
    for name in set(re.findall(r"\bmita_[a-z0-9_]+", text)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in METRICS or (base in METRICS and METRICS[base][0] == "histogram"):
            continue
        problem(where, f"metric {name} is not a series of the docs/metrics.md table")


def server_flags():
    source = open(os.path.join(ROOT, "server", "process", "main.cc"), encoding="utf-8").read()
    return set(re.findall(r"ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)", source))


def liveness_service():
    source = open(os.path.join(ROOT, "server", "frontend", "health_service.h"), encoding="utf-8").read()
    return re.search(r'kLivenessService\[\] = "([^"]*)"', source).group(1)


FLAGS = server_flags()
LIVENESS = liveness_service()


def get(obj, path, where, kind=None):
    """The value at dotted `path`, or None after recording a problem when it is missing or of the wrong type."""
    value = obj
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            problem(where, f"missing required field {path}")
            return None
        value = value[key]
    if kind is not None and not isinstance(value, kind):
        problem(where, f"{path} must be {kind.__name__}")
        return None
    return value


def check_container(where, container):
    """Flags against the server; returns the container's named ports."""
    name = container.get("name", "?")
    for arg in container.get("args", []):
        match = re.match(r"^--([a-z_]+)(=|$)", str(arg))
        if match and match.group(1) not in FLAGS:
            problem(where, f"container {name}: mita-server has no flag --{match.group(1)}")
    return {port["name"]: port.get("containerPort") for port in container.get("ports", []) if "name" in port}


def drain_seconds(container):
    for arg in container.get("args", []):
        match = re.match(r"^--drain_timeout_s=(\d+)$", str(arg))
        if match:
            return int(match.group(1))
    return 20  # the flag's default in server/process/main.cc


def pre_stop_seconds(container):
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command") or []
    return int(command[1]) if len(command) == 2 and command[0] == "sleep" else 0


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def merge(base, patch):
    """A strategic merge patch as kustomize applies this one: mappings merged, containers merged by name, other
    lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if key == "containers" and isinstance(value, list) and isinstance(base.get(key), list):
                by_name = {c.get("name"): c for c in base[key]}
                merged[key] = [merge(by_name[c.get("name")], c) if c.get("name") in by_name else c for c in value]
                merged[key] += [c for c in base[key] if c.get("name") not in {p.get("name") for p in value}]
            else:
                merged[key] = merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(patch)


def load(path):
    try:
        return [d for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d is not None]
    except yaml.YAMLError as error:
        problem(path, f"YAML: {error}")
        return []


def render(folder):
    """The objects `kubectl apply -k folder` would apply, as (source file, object): resources in order, then the
    patches merged into the objects of the same kind and name."""
    kustomization_path = os.path.join(folder, "kustomization.yaml")
    kustomization = (load(kustomization_path) or [{}])[0]
    objects = []
    for resource in kustomization.get("resources", []):
        path = os.path.normpath(os.path.join(folder, resource))
        if not os.path.exists(path):
            problem(kustomization_path, f"resource {resource} does not exist")
        elif os.path.isdir(path):
            objects += render(path)
        else:
            objects += [(path, document) for document in load(path)]
    for patch in kustomization.get("patches", []):
        path = os.path.join(folder, patch.get("path", ""))
        if not os.path.isfile(path):
            problem(kustomization_path, f"patch {patch} does not exist")
            continue
        for document in load(path):
            targets = [i for i, (_, o) in enumerate(objects)
                       if o.get("kind") == document.get("kind") and
                       o.get("metadata", {}).get("name") == document.get("metadata", {}).get("name")]
            if not targets:
                problem(path, f"patches {document.get('kind')} {document.get('metadata', {}).get('name')}, which "
                              "no resource defines")
            for i in targets:
                objects[i] = (path, merge(objects[i][1], document))
    return objects


def check_references(objects, where_name):
    """The cross references of one rendered kustomization (plus the KServe objects when given)."""
    by_kind = {}
    for path, document in objects:
        by_kind.setdefault(document.get("kind"), []).append((path, document))
        checked.append(f"{where_name}: {os.path.relpath(path, ROOT)}: {document.get('kind')} "
                       f"{document.get('metadata', {}).get('name', '')}")

    deployments, ports_of = {}, {}
    for path, deployment in by_kind.get("Deployment", []):
        name = deployment["metadata"]["name"]
        pod = get(deployment, "spec.template.spec", path, dict) or {}
        containers = get(deployment, "spec.template.spec.containers", path, list) or []
        ports = {}
        for container in containers:
            ports.update(check_container(path, container))
        selector = get(deployment, "spec.selector.matchLabels", path, dict) or {}
        labels = get(deployment, "spec.template.metadata.labels", path, dict) or {}
        if not matches(selector, labels):
            problem(path, "spec.selector.matchLabels does not match the pod template labels")
        grace = pod.get("terminationGracePeriodSeconds", 30)
        for container in containers:
            needed = drain_seconds(container) + pre_stop_seconds(container)
            if grace < needed:
                problem(path, f"terminationGracePeriodSeconds {grace} < preStop {pre_stop_seconds(container)} s + "
                              f"--drain_timeout_s {drain_seconds(container)} s")
            for probe, service in (("readinessProbe", ""), ("livenessProbe", LIVENESS)):
                handler = (container.get(probe) or {}).get("grpc")
                if handler is None:
                    problem(path, f"container {container.get('name')}: {probe} must use the gRPC health service")
                elif handler.get("service", "") != service:
                    problem(path, f"container {container.get('name')}: {probe} must ask for the health of "
                                  f"'{service}' (server/frontend/health_service.h), not '{handler.get('service', '')}'")
        deployments[name] = labels
        ports_of[name] = ports

    # Every ConfigMap a pod mounts (the client policy) is among the objects, and is mounted by some container.
    config_maps = {document["metadata"]["name"] for _, document in by_kind.get("ConfigMap", [])}
    for path, deployment in by_kind.get("Deployment", []):
        pod = get(deployment, "spec.template.spec", path, dict) or {}
        mounted = {mount.get("name") for container in pod.get("containers", [])
                   for mount in container.get("volumeMounts", [])}
        for volume in pod.get("volumes", []):
            config_map = (volume.get("configMap") or {}).get("name")
            if config_map is not None and config_map not in config_maps:
                problem(path, f"volume {volume.get('name')} mounts ConfigMap {config_map}, which is not applied")
            if volume.get("name") not in mounted:
                problem(path, f"volume {volume.get('name')} is mounted by no container")

    services = {}
    for path, service in by_kind.get("Service", []):
        selector = get(service, "spec.selector", path, dict) or {}
        targets = [d for d, labels in deployments.items() if matches(selector, labels)]
        if not targets:
            problem(path, "spec.selector matches no Deployment's pods")
        for port in get(service, "spec.ports", path, list) or []:
            target = port.get("targetPort")
            if isinstance(target, str) and not any(target in ports_of[d] for d in targets):
                problem(path, f"targetPort '{target}' is no named container port of {targets}")
        services[service["metadata"]["name"]] = service
    grpc_services = [s for s in services.values() if any(p.get("name") == "grpc" for p in s["spec"]["ports"])]
    if deployments and (not grpc_services or any(s["spec"].get("clusterIP") != "None" for s in grpc_services)):
        problem(os.path.join(ROOT, "deploy/kubernetes"), "the gRPC Service must be headless (clusterIP: None) "
                                                         "for client-side load balancing")

    for path, policy in by_kind.get("NetworkPolicy", []):
        selector = get(policy, "spec.podSelector.matchLabels", path, dict) or {}
        if not any(matches(selector, labels) for labels in deployments.values()):
            problem(path, "spec.podSelector matches no Deployment's pods")
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port.get("port"), str) and not any(port["port"] in p for p in ports_of.values()):
                    problem(path, f"port '{port['port']}' is no named container port")

    for path, monitor in by_kind.get("ServiceMonitor", []):
        selector = get(monitor, "spec.selector.matchLabels", path, dict) or {}
        selected = [s for s in services.values() if matches(selector, s["metadata"].get("labels", {}))]
        if not selected:
            problem(path, "spec.selector matches no Service")
        for endpoint in get(monitor, "spec.endpoints", path, list) or []:
            if not any(endpoint.get("port") == p.get("name") for s in selected for p in s["spec"]["ports"]):
                problem(path, f"endpoint port '{endpoint.get('port')}' is not a port name of the selected Service")

    hpa_metrics = set()
    for path, hpa in by_kind.get("HorizontalPodAutoscaler", []):
        target = get(hpa, "spec.scaleTargetRef", path, dict) or {}
        if target.get("kind") != "Deployment" or target.get("name") not in deployments:
            problem(path, f"scaleTargetRef {target} is not a Deployment defined here")
        for metric in hpa["spec"].get("metrics", []):
            if metric.get("type") == "Pods":
                name = get(metric, "pods.metric.name", path, str)
                hpa_metrics.add(name)
                check_metric_names(path, name or "")

    for path, pdb in by_kind.get("PodDisruptionBudget", []):
        selector = get(pdb, "spec.selector.matchLabels", path, dict) or {}
        if not any(matches(selector, labels) for labels in deployments.values()):
            problem(path, "spec.selector matches no Deployment's pods")

    runtimes = {}
    for path, runtime in by_kind.get("ServingRuntime", []):
        formats = get(runtime, "spec.supportedModelFormats", path, list) or []
        protocols = get(runtime, "spec.protocolVersions", path, list) or []
        containers = get(runtime, "spec.containers", path, list) or []
        for container in containers:
            ports = check_container(path, container)
            if "grpc-v2" in protocols and "h2c" not in ports:
                problem(path, "a grpc-v2 runtime needs a container port named h2c")
        if not any(c.get("name") == "kserve-container" for c in containers):
            problem(path, "the serving container must be named kserve-container")
        runtimes[runtime["metadata"]["name"]] = {f.get("name") for f in formats}
    for path, service in by_kind.get("InferenceService", []):
        model = get(service, "spec.predictor.model", path, dict) or {}
        runtime = model.get("runtime")
        if runtime not in runtimes:
            problem(path, f"runtime '{runtime}' is no ServingRuntime defined here")
        elif get(model, "modelFormat.name", path, str) not in runtimes[runtime]:
            problem(path, "modelFormat.name is not supported by the runtime")
        if model.get("protocolVersion") not in ("v2", "grpc-v2"):
            problem(path, "protocolVersion must be the Open Inference Protocol (v2 or grpc-v2)")
    return hpa_metrics


def check_adapter(hpa_metrics):
    """prometheus-adapter rule -> the HPA's metric."""
    values_path = os.path.join(ROOT, "deploy/kubernetes/prometheus-adapter/values.yaml")
    values = yaml.safe_load(open(values_path, encoding="utf-8"))
    rules = get(values, "rules.custom", values_path, list) or []
    exposed = set()
    for rule in rules:
        check_metric_names(values_path, get(rule, "seriesQuery", values_path, str) or "")
        exposed.add((rule.get("name") or {}).get("as"))
        for label in ("namespace", "pod"):
            if label not in ((rule.get("resources") or {}).get("overrides") or {}):
                problem(values_path, f"rule does not map the {label} label to its resource")
    for metric in hpa_metrics - exposed:
        problem(values_path, f"no rule exposes the HPA metric {metric}")
    checked.append(f"{os.path.relpath(values_path, ROOT)}: {len(rules)} prometheus-adapter rule(s)")


def check_prometheus():
    path = os.path.join(ROOT, "deploy/prometheus/prometheus.yml")
    config = yaml.safe_load(open(path, encoding="utf-8"))
    jobs = get(config, "scrape_configs", path, list) or []
    for job in jobs:
        if "static_configs" not in job and "kubernetes_sd_configs" not in job:
            problem(path, f"job {job.get('job_name')}: no targets")
    check_metric_names(path, open(path, encoding="utf-8").read())
    checked.append(f"{os.path.relpath(path, ROOT)}: {len(jobs)} scrape jobs")


def check_grafana():
    path = os.path.join(ROOT, "deploy/grafana/mita-serve-dashboard.json")
    dashboard = json.load(open(path, encoding="utf-8"))
    panels = get(dashboard, "panels", path, list) or []
    titles = " | ".join(p.get("title", "") for p in panels)
    for wanted in ("Request rate", "Latency quantiles", "Queue depth", "Batch size", "Budget mix",
                   "Expert load imbalance per layer", "Pruned-key fraction per layer"):
        if wanted not in titles:
            problem(path, f"no panel '{wanted}'")
    ids = [p.get("id") for p in panels]
    if len(set(ids)) != len(ids):
        problem(path, "panel ids are not unique")
    expressions = 0
    for panel in panels:
        targets = panel.get("targets") or []
        if not targets:
            problem(path, f"panel '{panel.get('title')}' has no query")
        for target in targets:
            expr = get(target, "expr", path, str) or ""
            expressions += 1
            if expr.count("(") != expr.count(")"):
                problem(path, f"unbalanced parentheses in {expr}")
            check_metric_names(path, expr)
    checked.append(f"{os.path.relpath(path, ROOT)}: {len(panels)} panels, {expressions} queries")


# The overlays of deploy/kubernetes: (folder, its patch of the base Deployment).
OVERLAYS = (("gpu", "deployment-gpu.yaml"), ("repository", "deployment-repository.yaml"))


def run_tools(base, overlays):
    """kubernetes-validate and checkov on the rendered objects (a copy of deploy/ with each overlay's patch
    rendered)."""
    work = tempfile.mkdtemp(prefix="mita_deploy_check_")
    try:
        # 1. kubernetes-validate: each built-in object in its own file, named after where it comes from.
        files, names = [], {}
        for overlay, objects in (("base", base), *overlays.items()):
            for index, (path, document) in enumerate(objects):
                if document.get("kind") in NOT_BUILT_IN:
                    continue
                file = os.path.join(work, f"{overlay}-{index}-{document['kind'].lower()}.yaml")
                with open(file, "w", encoding="utf-8") as out:
                    yaml.safe_dump(document, out, sort_keys=False)
                files.append(file)
                names[file] = f"{overlay} overlay: {os.path.relpath(path, ROOT)} {document['kind']}"
        result = subprocess.run([os.path.join(TOOLS, "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION]
                                + files, capture_output=True, text=True)
        report = result.stdout + result.stderr
        for file, name in names.items():
            report = report.replace(file, name)
        print(report.rstrip())
        if result.returncode != 0 or "ERROR" in report or "WARN" in report:
            problem(os.path.join(ROOT, "deploy/kubernetes"),
                    f"kubernetes-validate {KUBERNETES_VERSION} --strict failed (above)")
        checked.append(f"kubernetes-validate --strict -k {KUBERNETES_VERSION}: {len(files)} objects")

        # 2. checkov on a copy of deploy/ whose overlay patches are the Deployments they render to.
        copy_root = os.path.join(work, "deploy")
        shutil.copytree(os.path.join(ROOT, "deploy"), copy_root)
        for overlay, patch_name in OVERLAYS:
            patch = os.path.join(copy_root, "kubernetes", overlay, patch_name)
            rendered = [document for path, document in overlays[overlay] if document.get("kind") == "Deployment"]
            with open(patch, "w", encoding="utf-8") as out:
                out.write(f"# deploy/kubernetes/{overlay} rendered: the base Deployment with {patch_name} merged\n")
                yaml.safe_dump_all(rendered, out, sort_keys=False)
        result = subprocess.run([os.path.join(TOOLS, "checkov"), "-d", copy_root, "--framework", "kubernetes",
                                 "dockerfile", "--skip-download", "--compact", "--quiet"],
                                capture_output=True, text=True, cwd=work)
        report = (result.stdout + result.stderr).replace(copy_root, "deploy")
        print(report.rstrip() if report.strip() else "checkov: no finding")
        if result.returncode != 0:
            problem(os.path.join(ROOT, "deploy"), "checkov found problems (above): fix them, or skip each with its "
                                                  "reason in the manifest")
        summary = subprocess.run([os.path.join(TOOLS, "checkov"), "-d", copy_root, "--framework", "kubernetes",
                                  "dockerfile", "--skip-download", "--compact", "-o", "json"],
                                 capture_output=True, text=True, cwd=work)
        for entry in json.loads(summary.stdout or "[]") if summary.stdout.strip().startswith("[") else \
                [json.loads(summary.stdout or "{}")]:
            counts = entry.get("summary", {})
            checked.append(f"checkov {entry.get('check_type')}: {counts.get('passed')} passed, "
                           f"{counts.get('failed')} failed, {counts.get('skipped')} skipped (with their reasons)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    if len(METRICS) < 10:
        problem(os.path.join(ROOT, "docs", "metrics.md"), "metrics table not found")
    base = render(os.path.join(ROOT, "deploy", "kubernetes"))
    overlays = {overlay: render(os.path.join(ROOT, "deploy", "kubernetes", overlay)) for overlay, _ in OVERLAYS}
    kserve = [(path, document) for path in sorted(glob.glob(os.path.join(ROOT, "deploy/kubernetes/kserve/*.yaml")))
              for document in load(path)]
    hpa_metrics = check_references(base, "base") | check_references(kserve, "kserve")
    for overlay, objects in overlays.items():
        hpa_metrics |= check_references(objects, overlay)
    check_adapter(hpa_metrics)
    check_prometheus()
    check_grafana()
    tools = all(os.access(os.path.join(TOOLS, t), os.X_OK) for t in ("kubernetes-validate", "checkov"))
    if tools:
        run_tools(base, overlays)
    for line in checked:
        print("checked", line)
    if problems:
        print(f"{len(problems)} problem(s):")
        for line in problems:
            print("  " + line)
        return 1
    if not tools:
        print(f"kubernetes-validate and checkov are not in {TOOLS} (scripts/install_deploy_check.sh): only the cross "
              "references were checked")
        return 1 if os.environ.get("CI") else 77
    print(f"deploy/ OK ({len(checked)} objects and files; metric names against {len(METRICS)} documented series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
