"""docs/operations.md's KubeRay RayCluster, validated against KubeRay's RayCluster CRD schema
(`../shared/k8s/ray.io_rayclusters.yaml` beside the repository: read from there, never copied in;
skipped where it is absent, as on a clean clone) with a JSON-schema validator, unknown fields
rejected as `kubectl --validate=strict` does (every object schema that lists its properties, and
does not say it keeps unknown fields, gets additionalProperties false); a misspelt field fails it.
The manifest's gateway binds 0.0.0.0 with its API key from a Secret through the environment, its
probes are liveness /health and readiness /health/ready, and its `pdserve launch` command parses."""
import copy
import pathlib
import re

import pytest

from pdserve.gateway.config import API_KEY_ENV, check_http_bind
from pdserve_client.keys import InsecureBindError

jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main_checkout(root: pathlib.Path) -> pathlib.Path:
    """The repository's main checkout: root itself, or for a git worktree (.git a file naming
    MAIN/.git/worktrees/NAME) the checkout it was added from."""
    dot_git = root / ".git"
    if dot_git.is_file():
        gitdir = pathlib.Path(dot_git.read_text().split("gitdir:", 1)[1].strip())
        if gitdir.parent.name == "worktrees":
            return gitdir.parents[2]
    return root


CRD = main_checkout(ROOT).parent / "shared" / "k8s" / "ray.io_rayclusters.yaml"


def strict(schema):
    """The schema with unknown fields rejected wherever an object lists its properties (kubectl
    --validate=strict), except where it keeps unknown fields (x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in schema and isinstance(schema["properties"], dict) and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator():
    if not CRD.is_file():
        pytest.skip(f"KubeRay's RayCluster CRD is not at {CRD} (reference data beside the repository, absent on a clean clone)")
    crd = yaml.safe_load(CRD.read_text())
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(strict(v1["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def manifest():
    text = (ROOT / "docs" / "operations.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kind: RayCluster" in b]
    return yaml.safe_load(block)


def problems(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_the_manifest_validates_against_the_crd_strictly(validator, manifest):
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    assert problems(validator, manifest) == []


@pytest.mark.parametrize("where, wrong", [
    (("spec",), ("enableInTreeAutoscaling", "enableInTreeAutoscaler")),
    (("spec", "headGroupSpec"), ("rayStartParams", "rayStartParam")),
    (("spec", "headGroupSpec", "template", "spec", "containers", 1), ("readinessProbe", "readynessProbe")),
    (("spec", "workerGroupSpecs", 0), ("maxReplicas", "maxReplica")),
])
def test_a_misspelt_field_fails_it(validator, manifest, where, wrong):
    doc = copy.deepcopy(manifest)
    node = doc
    for key in where:
        node = node[key]
    node[wrong[1]] = node.pop(wrong[0])
    found = problems(validator, doc)
    assert any(wrong[1] in p for p in found), found


def test_a_wrong_type_fails_it(validator, manifest):
    doc = copy.deepcopy(manifest)
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = "one"
    assert problems(validator, doc)


def test_the_gateway_binds_everywhere_only_with_its_key_from_a_secret(manifest):
    from pdserve.cli import main

    [pd] = [c for c in manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if "command" in c]
    command = pd["command"]
    assert command[:2] == ["pdserve", "launch"] and "--api-key" not in command  # never on the command line (ps, Ray's job record)
    main.commands["launch"].make_context("pdserve launch", command[2:])  # a flag it does not take raises
    host = command[command.index("--http-host") + 1]
    [key] = [e for e in pd["env"] if e["name"] == API_KEY_ENV]
    assert set(key["valueFrom"]) == {"secretKeyRef"}
    check_http_bind(host, "from the secret")
    with pytest.raises(InsecureBindError):
        check_http_bind(host, None)  # without it the gateway would not start
    assert pd["livenessProbe"]["httpGet"]["path"] == "/health" and pd["readinessProbe"]["httpGet"]["path"] == "/health/ready"
