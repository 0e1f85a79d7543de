"""The fleet kit in deploy/ is valid for the tools that will read it: Kubernetes
manifests against the Kubernetes schemas (kubernetes-validate, strict), the pieces of
them that must agree with each other and with gpuguard (labels, ports, mounts, the config
itself); the Prometheus configs with promtool; the Alertmanager config and its routing
with amtool."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_harness import REPO
from gpuguard.config import load_config

pytestmark = [pytest.mark.slow]  # registered in pyproject.toml


K8S = REPO / "deploy" / "kubernetes"
PROM = REPO / "deploy" / "prometheus"
AM = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
ALERTS = REPO / "grafana" / "alerts.yml"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_manifests_pass_the_kubernetes_schemas_strictly(tmp_path):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (pip install kubernetes-validate)")
    checked = []
    for path in manifests():
        for doc in docs(path.name):
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: no schema in kubernetes-validate (checked below by hand)
            kv.validate(doc, kv.latest_version(), strict=True)
            checked.append(doc["kind"])
    assert sorted(checked) == ["ConfigMap", "DaemonSet", "Namespace", "Secret"]
    # the check can fail: a misspelt field is refused in strict mode
    ds = docs("daemonset.yaml")[0]
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, kv.latest_version(), strict=True)


def test_daemonset_agrees_with_its_config_its_secret_and_the_pod_monitor(tmp_path):
    ds = docs("daemonset.yaml")[0]
    pod = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (c,) = pod["containers"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts.keys() == volumes.keys()
    # what the daemon needs from the node
    assert pod["hostPID"] and pod["hostNetwork"] and c["securityContext"]["privileged"]
    assert volumes["sys"]["hostPath"]["path"] == "/sys" and mounts["sys"]["mountPath"] == "/host/sys"
    assert volumes["kmsg"]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"} and mounts["kmsg"]["readOnly"]
    assert volumes["state"]["hostPath"]["path"] == "/var/lib/gpuguard"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert "nvidia.com/gpu.present" in keys and any("1002" in k for k in keys)  # NVIDIA and AMD nodes

    # the config in the ConfigMap is a valid gpuguard config and matches the mounts
    cm = docs("configmap.yaml")[0]
    cfg_file = tmp_path / "gpuguard.yaml"
    cfg_file.write_text(cm["data"]["gpuguard.yaml"])
    cfg = load_config(cfg_file)
    assert c["args"] == ["run", "--config", f"{mounts['config']['mountPath']}/gpuguard.yaml"]
    assert cfg.sysfs_root == "/host" and mounts["sys"]["mountPath"] == cfg.sysfs_root + "/sys"
    assert cfg.state_dir == mounts["state"]["mountPath"] and cfg.kernel.kmsg_path == mounts["kmsg"]["mountPath"]
    assert cfg.listen.port == c["ports"][0]["containerPort"] and not cfg.api.open_reads
    # the token file is a regular file (subPath): gpuguard opens it with O_NOFOLLOW
    assert cfg.api.token_file == mounts["tokens"]["mountPath"] and mounts["tokens"]["subPath"] == "api-tokens"
    assert volumes["tokens"]["secret"]["defaultMode"] == 0o400
    secret = docs("secret.example.yaml")[0]
    assert volumes["tokens"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert yaml.safe_load(secret["stringData"]["api-tokens"]).keys() == {"prometheus", "admin"}

    pm = docs("podmonitor.yaml")[0]
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == c["ports"][0]["name"] and ep["path"] == "/metrics"
    cred = ep["authorization"]["credentials"]
    assert cred["name"] == secret["metadata"]["name"] and cred["key"] in secret["stringData"]
    assert {"targetLabel": "job", "replacement": "gpuguard"} in ep["relabelings"]  # alerts.yml: up{job="gpuguard"}
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}  # /healthz needs no token

    ns = docs("namespace.yaml")[0]["metadata"]["name"]
    assert {d["metadata"].get("namespace") for p in manifests() for d in docs(p.name) if d["kind"] != "Namespace"} == {ns}


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(p.name for p in manifests())
    if shutil.which("kubectl"):
        r = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert len([d for d in yaml.safe_load_all(r.stdout) if d]) == 5


def test_containerfile_copies_what_exists_and_is_the_daemonsets_image():
    text = (REPO / "deploy" / "Containerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), f"Containerfile copies {src}, which is not in the repository"
    assert 'CMD ["run", "--config", "/etc/gpuguard/gpuguard.yaml"]' in text
    assert "# built from deploy/Containerfile" in (K8S / "daemonset.yaml").read_text()


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package: prometheus)")
needs_amtool = pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool not installed (Debian package: prometheus-alertmanager)")


@needs_promtool
@pytest.mark.parametrize("name", ["prometheus.yml", "federation.yml"])
def test_prometheus_configs_pass_promtool(name, tmp_path):
    # the example paths point at where files go on a server; point them here
    text = (PROM / name).read_text()
    text = text.replace("/etc/prometheus/gpuguard/alerts.yml", str(ALERTS))
    text = text.replace("/etc/prometheus/gpuguard-token", str(tmp_path / "token"))
    (tmp_path / "token").write_text("x" * 64)
    (tmp_path / name).write_text(text)
    r = subprocess.run(["promtool", "check", "config", str(tmp_path / name)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    if name == "prometheus.yml":
        assert "SUCCESS: 1 rule files found" in r.stdout + r.stderr
    targets = yaml.safe_load((PROM / "targets" / "gpu-hosts.yml").read_text())
    assert all(t.endswith(":9436") for group in targets for t in group["targets"])


@needs_amtool
def test_alertmanager_config_and_routing():
    r = subprocess.run(["amtool", "check-config", str(AM)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    def route(**labels) -> str:
        r = subprocess.run(["amtool", "config", "routes", "test", f"--config.file={AM}",
                            *(f"{k}={v}" for k, v in labels.items())], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    # every alert gpuguard ships reaches the receiver for its severity
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    receiver = {"critical": "gpuguard-oncall", "warning": "gpuguard-chat", "info": "gpuguard-tickets"}
    assert {r["labels"]["severity"] for r in rules} <= receiver.keys()
    for rule in rules:
        assert route(alertname=rule["alert"], severity=rule["labels"]["severity"]) == receiver[rule["labels"]["severity"]], rule["alert"]
