"""What is tested is what is shipped: the container cluster test's compose file runs the
images as the manifests run them.

usage: check_containers.py RENDERED_HA.yaml CLUSTER_COMPOSE.yaml DOCKERFILE

For each agentlog workload of the rendered `ha` overlay (the store, the runners, the web
view) and the compose services that stand for it (testkit/containers/cluster.yaml), it
fails on any difference in:

- the image (its repository; the tag is the test's);
- the user: the compose service sets none, so the image's USER (the Dockerfile's stage)
  runs, and it must be the pod's runAsUser:runAsGroup;
- the arguments, exactly;
- the environment: the same names with the same values (ConfigMaps resolved), except the
  differences the compose file's head states (ALLOWED below) and values from a Secret
  (the test's own, standing for the Secret);
- the mounts: the same paths, read-only where the pod's are; an emptyDir is the container's
  own, new with it: a tmpfs or an anonymous volume;
- the probes: each probe of the pod is a label io.agentlog.probe.<kind> on the service
  (`grpc PORT [SERVICE]`, `tcp PORT`, `http PORT PATH`), so the test asks what the kubelet
  asks;
- the security settings: a read-only root filesystem, every capability dropped,
  no-new-privileges (allowPrivilegeEscalation: false), the engine's default seccomp profile
  (RuntimeDefault), nothing privileged;
- the grace period: stop_grace_period is terminationGracePeriodSeconds.
"""

import re
import sys

import yaml

# Environment the test sets differently, and why (the compose file's head says the same).
ALLOWED = {
    # A Secret in the cluster (the operator's -rw Service); the test's database hosts.
    "AGENTLOG_DATABASE_URL": "value",
    # The pod's name in the cluster.
    "AGENTLOG_RUNNER_ID": "value",
    # 6 s instead of 30 s, so that a runner cut off for 20 s is taken over within the cut.
    "AGENTLOG_LEASE_TTL_MS": "value",
    # The model stand-in.
    "ANTHROPIC_BASE_URL": "extra",
}
# Which compose services stand for which workload.
SERVICES = {"event-store": ["store-a", "store-b"], "runner": ["runner-1", "runner-2", "runner-3"],
            "web": ["web"]}
STAGE_OF_IMAGE = {"agentlog/event-store": "event-store", "agentlog/runner": "runner",
                  "agentlog/web": "web"}

problems = []


def fail(msg):
    problems.append(msg)


def stage_users(dockerfile):
    """The last USER of each stage, by stage name."""
    users, stage = {}, None
    for line in open(dockerfile):
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            stage = m.group(1)
            continue
        m = re.match(r"USER\s+(\S+)", line)
        if m and stage:
            users[stage] = m.group(1)
    return users


FROM_SECRET = "<from secretKeyRef>"


def pod_env(container, configmaps):
    env = {}
    for ref in container.get("envFrom", []):
        env.update(configmaps.get(ref.get("configMapRef", {}).get("name"), {}))
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", "<from " + ",".join(e.get("valueFrom", {})) + ">")
    return env


def compose_env(service):
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: None if v is None else str(v) for k, v in env.items()}


def pod_mounts(pod, container):
    kinds = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        kind = "emptyDir" if "emptyDir" in kinds.get(m["name"], {}) else "volume"
        mounts[m["mountPath"]] = (kind, bool(m.get("readOnly")))
    return mounts


def compose_mounts(service):
    """An anonymous volume (a bare path) and a tmpfs are the container's own, new with it
    (the test replaces a container as a new pod, with new anonymous volumes): an emptyDir."""
    mounts = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        if len(parts) == 1:
            mounts[parts[0]] = ("emptyDir", False)
            continue
        mounts[parts[1]] = ("volume", len(parts) > 2 and "ro" in parts[2].split(","))
    for t in service.get("tmpfs", []):
        mounts[t.split(":")[0]] = ("emptyDir", False)
    return mounts


def pod_probes(container):
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    probes = {}
    for kind in ("startup", "readiness", "liveness"):
        p = container.get(f"{kind}Probe")
        if not p:
            continue
        if "grpc" in p:
            words = ["grpc", str(p["grpc"]["port"])]
            if p["grpc"].get("service"):
                words.append(p["grpc"]["service"])
        elif "tcpSocket" in p:
            words = ["tcp", str(p["tcpSocket"]["port"])]
        elif "httpGet" in p and p["httpGet"].get("scheme", "HTTP") == "HTTP":
            port = p["httpGet"]["port"]
            words = ["http", str(ports.get(port, port)), p["httpGet"].get("path", "/")]
        else:
            words = ["unsupported:" + ",".join(p)]
        probes[kind] = " ".join(words)
    return probes


def compose_probes(service):
    labels = service.get("labels", {})
    if isinstance(labels, list):
        labels = dict(item.split("=", 1) for item in labels)
    return {k[len("io.agentlog.probe."):]: v for k, v in labels.items()
            if k.startswith("io.agentlog.probe.")}


def seconds(text):
    m = re.fullmatch(r"(\d+)s", str(text))
    return int(m.group(1)) if m else None


def compare(workload, pod, container, name, service, configmaps, users):
    where = f"{workload} vs compose service {name}"
    image = container["image"].split("@")[0].rsplit(":", 1)[0]
    compose_image = service.get("image", "").rsplit(":", 1)[0]
    if image != compose_image:
        fail(f"{where}: image {image} != {compose_image}")
    if "user" in service:
        fail(f"{where}: sets user {service['user']!r}; the image's own user must run")
    ctx = {**pod["spec"].get("securityContext", {}), **container.get("securityContext", {})}
    want_user = f"{ctx.get('runAsUser')}:{ctx.get('runAsGroup')}"
    have_user = users.get(STAGE_OF_IMAGE.get(image, ""))
    if have_user != want_user:
        fail(f"{where}: the image's USER is {have_user}, the pod runs as {want_user}")
    if container.get("args", []) != service.get("command", []):
        fail(f"{where}: arguments differ:\n  manifest {container.get('args', [])}\n  compose  {service.get('command', [])}")
    want_env, have_env = pod_env(container, configmaps), compose_env(service)
    for key in sorted(set(want_env) | set(have_env)):
        allowed = ALLOWED.get(key)
        if key not in have_env:
            fail(f"{where}: env {key} is set by the manifest, not by the test")
        elif key not in want_env:
            if allowed != "extra":
                fail(f"{where}: env {key} is set by the test, not by the manifest")
        elif want_env[key] != have_env[key] and allowed != "value" and want_env[key] != FROM_SECRET:
            fail(f"{where}: env {key} is {want_env[key]!r} in the manifest, {have_env[key]!r} in the test")
    if pod_mounts(pod, container) != compose_mounts(service):
        fail(f"{where}: mounts differ:\n  manifest {pod_mounts(pod, container)}\n  compose  {compose_mounts(service)}")
    if pod_probes(container) != compose_probes(service):
        fail(f"{where}: probes differ:\n  manifest {pod_probes(container)}\n  compose  {compose_probes(service)}")
    if ctx.get("readOnlyRootFilesystem") is not True or service.get("read_only") is not True:
        fail(f"{where}: a read-only root filesystem on both sides")
    if (ctx.get("capabilities", {}).get("drop") != ["ALL"]) or service.get("cap_drop") != ["ALL"]:
        fail(f"{where}: every capability dropped on both sides")
    security_opt = service.get("security_opt", [])
    if ctx.get("allowPrivilegeEscalation") is not False or "no-new-privileges:true" not in security_opt:
        fail(f"{where}: no privilege escalation (no-new-privileges) on both sides")
    seccomp = ctx.get("seccompProfile", {}).get("type")
    if seccomp != "RuntimeDefault" or any(o.startswith("seccomp") for o in security_opt):
        fail(f"{where}: the runtime's default seccomp profile on both sides")
    if ctx.get("privileged") or service.get("privileged") or service.get("cap_add"):
        fail(f"{where}: privileged or capabilities added")
    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if seconds(service.get("stop_grace_period", "10s")) != grace:
        fail(f"{where}: stop_grace_period {service.get('stop_grace_period')} != terminationGracePeriodSeconds {grace}")


def main(rendered, compose_file, dockerfile):
    docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    compose = yaml.safe_load(open(compose_file))["services"]
    users = stage_users(dockerfile)
    seen = set()
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = doc["spec"]["template"]
        for container in pod["spec"]["containers"]:
            workload = doc["metadata"]["name"]
            names = SERVICES.get(workload)
            if names is None:
                fail(f"{doc['kind']}/{workload}: no compose service stands for it")
                continue
            seen.add(workload)
            for name in names:
                if name not in compose:
                    fail(f"{compose_file}: no service {name} (for {workload})")
                    continue
                compare(f"{doc['kind']}/{workload}", pod, container, name, compose[name],
                        configmaps, users)
    for workload in set(SERVICES) - seen:
        fail(f"{rendered}: no workload {workload}")
    for p in problems:
        print(f"MISMATCH {compose_file}: {p}")
    if problems:
        sys.exit(1)
    print(f"{compose_file}: runs the images as {rendered} does (images, users, arguments, "
          "environment, mounts, probes, security settings, grace periods)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
