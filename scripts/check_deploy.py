#!/usr/bin/python3
"""Checks deploy/ (Kubernetes manifests, KServe objects, Prometheus and prometheus-adapter config, Grafana
dashboard) without a cluster. Debian python3-yaml only.

What it checks (no kubeconform/kubeval in Debian 12, so this is a small schema check, not the full
Kubernetes OpenAPI validation):
  - every YAML document parses; apiVersion/kind is one of the kinds used here (a typo in either fails);
  - per kind, the required fields and their types, and the allowed keys of containers, pod specs and probes
    (typos such as "readinessprobe" fail); DNS-1123 names, port numbers and names, resource quantities;
    one handler per probe;
  - cross references: Service/PDB/ServiceMonitor selectors match the Deployment's pod labels, named target
    ports exist, the HPA targets the Deployment and its metric is the prometheus-adapter rule's, the
    InferenceService's runtime and model format exist, kustomization resources and patches exist;
  - mita-server flags in container args exist in server/main.cc; terminationGracePeriodSeconds covers the
    preStop sleep plus --drain_timeout_s;
  - every metric named in the Grafana dashboard, the HPA, the adapter rule and the Prometheus config is a
    series of the metrics table of docs/metrics.md (histograms with _bucket/_sum/_count), and the dashboard has
    the panels the docs promise.
Usage: scripts/check_deploy.py [REPO_ROOT]. Prints what it checked; exit 1 on the first list of problems.
"""
import glob
import json
import os
import re
import sys

import yaml

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
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
    source = open(os.path.join(ROOT, "server", "main.cc"), encoding="utf-8").read()
    return set(re.findall(r"ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)", source))


FLAGS = server_flags()
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")
KINDS = {
    ("apps/v1", "Deployment"), ("v1", "Service"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"), ("policy/v1", "PodDisruptionBudget"),
    ("serving.kserve.io/v1alpha1", "ServingRuntime"), ("serving.kserve.io/v1beta1", "InferenceService"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
}
CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "args", "command", "ports", "env", "envFrom", "resources",
                  "startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "securityContext",
                  "volumeMounts", "workingDir"}
POD_KEYS = {"containers", "initContainers", "terminationGracePeriodSeconds", "securityContext", "nodeSelector",
            "tolerations", "affinity", "topologySpreadConstraints", "volumes", "serviceAccountName",
            "priorityClassName"}
PROBE_KEYS = {"exec", "httpGet", "tcpSocket", "grpc", "initialDelaySeconds", "periodSeconds", "timeoutSeconds",
              "successThreshold", "failureThreshold", "terminationGracePeriodSeconds"}
PROBE_HANDLERS = {"exec", "httpGet", "tcpSocket", "grpc"}


def get(obj, path, where, kind=None):
    """The value at dotted `path`, or None after recording a problem when it is missing or of the wrong type."""
    value = obj
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            problem(where, f"missing required field {path}")
            return None
        value = value[key]
    if kind is not None and not isinstance(value, kind):
        problem(where, f"{path} must be {kind.__name__ if isinstance(kind, type) else kind}")
        return None
    return value


def check_keys(where, what, obj, allowed):
    for key in obj:
        if key not in allowed:
            problem(where, f"{what}: unknown field '{key}'")


def check_resources(where, name, resources):
    for section in ("requests", "limits"):
        for resource, quantity in (resources.get(section) or {}).items():
            if not QUANTITY.match(str(quantity)):
                problem(where, f"container {name}: {section}.{resource} '{quantity}' is not a quantity")
    gpu_request = (resources.get("requests") or {}).get("nvidia.com/gpu")
    gpu_limit = (resources.get("limits") or {}).get("nvidia.com/gpu")
    if gpu_request is not None and gpu_request != gpu_limit:
        problem(where, f"container {name}: nvidia.com/gpu requests must equal limits")


def check_container(where, container, partial=False):
    if not isinstance(container, dict):
        problem(where, "a container must be a mapping")
        return {}
    name = container.get("name", "?")
    check_keys(where, f"container {name}", container, CONTAINER_KEYS)
    for field in ("name",) if partial else ("name", "image"):
        get(container, field, where, str)
    ports = {}
    for port in container.get("ports", []):
        number = get(port, "containerPort", where, int)
        if number is not None and not 0 < number < 65536:
            problem(where, f"container {name}: containerPort {number} out of range")
        if "name" in port:
            if not DNS_LABEL.match(port["name"]) or len(port["name"]) > 15:
                problem(where, f"container {name}: port name '{port['name']}' is not an IANA service name")
            ports[port["name"]] = number
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(probe_name)
        if probe is None:
            continue
        check_keys(where, f"container {name} {probe_name}", probe, PROBE_KEYS)
        handlers = PROBE_HANDLERS & set(probe)
        if len(handlers) != 1:
            problem(where, f"container {name} {probe_name}: exactly one handler of {sorted(PROBE_HANDLERS)}")
        if "grpc" in probe and not isinstance(probe["grpc"].get("port"), int):
            problem(where, f"container {name} {probe_name}: grpc.port must be an integer (named ports are not "
                           "allowed for gRPC probes)")
    check_resources(where, name, container.get("resources", {}))
    for arg in container.get("args", []):
        match = re.match(r"^--([a-z_]+)(=|$)", str(arg))
        if match and match.group(1) not in FLAGS:
            problem(where, f"container {name}: mita-server has no flag --{match.group(1)}")
    return ports


def drain_seconds(container):
    for arg in container.get("args", []):
        match = re.match(r"^--drain_timeout_s=(\d+)$", str(arg))
        if match:
            return int(match.group(1))
    return 20  # the flag's default in server/main.cc


def pre_stop_seconds(container):
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command") or []
    return int(command[1]) if len(command) == 2 and command[0] == "sleep" else 0


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def load_documents():
    documents = []
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy", "kubernetes", "**", "*.yaml"), recursive=True)):
        if os.sep + "prometheus-adapter" + os.sep in path:
            continue  # Helm values, checked below
        try:
            for document in yaml.safe_load_all(open(path, encoding="utf-8")):
                if document is not None:
                    documents.append((path, document))
        except yaml.YAMLError as error:
            problem(path, f"YAML: {error}")
    return documents


def check_kubernetes():
    documents = load_documents()
    by_kind = {}
    for path, document in documents:
        key = (document.get("apiVersion"), document.get("kind"))
        if key not in KINDS:
            problem(path, f"unknown apiVersion/kind {key}")
            continue
        if key[1] != "Kustomization":
            name = get(document, "metadata.name", path, str)
            if name is not None and not DNS_LABEL.match(name):
                problem(path, f"metadata.name '{name}' is not a DNS-1123 label")
        by_kind.setdefault(key[1], []).append((path, document))
        checked.append(f"{os.path.relpath(path, ROOT)}: {key[1]} {document.get('metadata', {}).get('name', '')}")

    deployments, ports_of = {}, {}
    for path, deployment in by_kind.get("Deployment", []):
        name = deployment["metadata"]["name"]
        is_patch = "selector" not in deployment.get("spec", {})  # a strategic merge patch (gpu/)
        pod = get(deployment, "spec.template.spec", path, dict) or {}
        check_keys(path, "pod spec", pod, POD_KEYS)
        containers = get(deployment, "spec.template.spec.containers", path, list) or []
        ports = {}
        for container in containers:
            ports.update(check_container(path, container, partial=is_patch))
        if is_patch:
            if name not in {d["metadata"]["name"] for _, d in by_kind["Deployment"] if d is not deployment}:
                problem(path, f"patch of Deployment {name}, which no manifest defines")
            continue
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
            for probe in ("readinessProbe", "livenessProbe"):
                if "grpc" not in container.get(probe, {}):
                    problem(path, f"container {container.get('name')}: {probe} must use the gRPC health service")
        deployments[name] = labels
        ports_of[name] = ports

    services = {}
    for path, service in by_kind.get("Service", []):
        selector = get(service, "spec.selector", path, dict) or {}
        targets = [d for d, labels in deployments.items() if matches(selector, labels)]
        if not targets:
            problem(path, "spec.selector matches no Deployment's pods")
        for port in get(service, "spec.ports", path, list) or []:
            get(port, "port", path, int)
            target = port.get("targetPort")
            if isinstance(target, str) and not any(target in ports_of[d] for d in targets):
                problem(path, f"targetPort '{target}' is no named container port of {targets}")
        services[service["metadata"]["name"]] = service
    grpc_services = [s for s in services.values() if any(p.get("name") == "grpc" for p in s["spec"]["ports"])]
    if not grpc_services or any(s["spec"].get("clusterIP") != "None" for s in grpc_services):
        problem(os.path.join(ROOT, "deploy/kubernetes"), "the gRPC Service must be headless (clusterIP: None) "
                                                         "for client-side load balancing")

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
        minimum, maximum = hpa["spec"].get("minReplicas", 1), get(hpa, "spec.maxReplicas", path, int)
        if maximum is not None and not 1 <= minimum <= maximum:
            problem(path, "need 1 <= minReplicas <= maxReplicas")
        for metric in get(hpa, "spec.metrics", path, list) or []:
            if metric.get("type") == "Pods":
                name = get(metric, "pods.metric.name", path, str)
                get(metric, "pods.target.averageValue", path)
                hpa_metrics.add(name)
                check_metric_names(path, name or "")

    for path, pdb in by_kind.get("PodDisruptionBudget", []):
        if ("minAvailable" in pdb["spec"]) == ("maxUnavailable" in pdb["spec"]):
            problem(path, "set exactly one of minAvailable and maxUnavailable")
        selector = get(pdb, "spec.selector.matchLabels", path, dict) or {}
        if not any(matches(selector, labels) for labels in deployments.values()):
            problem(path, "spec.selector matches no Deployment's pods")

    runtimes = {}
    for path, runtime in by_kind.get("ServingRuntime", []):
        formats = get(runtime, "spec.supportedModelFormats", path, list) or []
        protocols = get(runtime, "spec.protocolVersions", path, list) or []
        if not set(protocols) <= {"v1", "v2", "grpc-v1", "grpc-v2"}:
            problem(path, f"protocolVersions {protocols}")
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

    for path, kustomization in by_kind.get("Kustomization", []):
        base = os.path.dirname(path)
        for resource in kustomization.get("resources", []):
            if not os.path.exists(os.path.join(base, resource)):
                problem(path, f"resource {resource} does not exist")
        for patch in kustomization.get("patches", []):
            if not os.path.exists(os.path.join(base, patch.get("path", ""))):
                problem(path, f"patch {patch} does not exist")

    # prometheus-adapter rule -> the HPA's metric.
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
        get(job, "job_name", path, str)
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


def main():
    if len(METRICS) < 10:
        problem(os.path.join(ROOT, "docs", "metrics.md"), "metrics table not found")
    check_kubernetes()
    check_prometheus()
    check_grafana()
    for line in checked:
        print("checked", line)
    if problems:
        print(f"{len(problems)} problem(s):")
        for line in problems:
            print("  " + line)
        return 1
    print(f"deploy/ OK ({len(checked)} objects and files; metric names against {len(METRICS)} documented series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
