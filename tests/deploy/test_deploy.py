"""deploy/kubernetes/: every manifest valid against its schema, and the manifests consistent with each
other and with ``localllm serve`` (no cluster runs here).

Deployment and Service are validated against Kubernetes' own OpenAPI schemas (``kubernetes-validate``,
strict: an unknown field fails); InferencePool and HTTPRoute against the schemas in
deploy/kubernetes/schemas/, written from the Inference Extension's and the Gateway API's v1 references.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml

from localllm.cli import app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33"
CRD_SCHEMAS = {"InferencePool": "inferencepool-v1.json", "HTTPRoute": "httproute-v1.json"}


def _documents() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by_kind() -> dict[str, dict]:
    return {d["kind"]: d for d in _documents()}


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_against_its_schema(doc):
    if doc["kind"] in CRD_SCHEMAS:
        schema = json.loads((DEPLOY / "schemas" / CRD_SCHEMAS[doc["kind"]]).read_text())
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schemas_catch_what_a_cluster_would_refuse():
    """The checks above can fail: a misspelt field, a port out of range and a missing picker are refused."""
    kinds = _by_kind()
    deployment = json.loads(json.dumps(kinds["Deployment"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    schema = json.loads((DEPLOY / "schemas" / CRD_SCHEMAS["InferencePool"]).read_text())
    pool = json.loads(json.dumps(kinds["InferencePool"]))
    pool["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, schema)
    del pool["spec"]["endpointPickerRef"]
    pool["spec"]["targetPorts"] = [{"number": 8000}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, schema)


def test_pool_service_and_pods_agree():
    kinds = _by_kind()
    pod = kinds["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    labels = pod["metadata"]["labels"]
    assert kinds["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert kinds["Service"]["spec"]["selector"].items() <= labels.items()
    assert kinds["InferencePool"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert [p["number"] for p in kinds["InferencePool"]["spec"]["targetPorts"]] == [port]
    args = container["args"]
    assert args[args.index("--port") + 1] == str(port) and args[args.index("--host") + 1] == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    backend = kinds["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", kinds["InferencePool"]["metadata"]["name"])


def test_the_container_runs_a_serve_command_localllm_accepts():
    kinds = _by_kind()
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    command = typer.main.get_command(app)
    args = container["args"]
    serve = command.get_command(None, args[0])
    ctx = serve.make_context(args[0], list(args[1:]))  # raises on an unknown flag or a bad value
    assert ctx.params["port"] == 8000 and ctx.params["model"]
    from localllm.config.settings import SETTINGS

    env_settings = {s.env for s in SETTINGS}
    assert {e["name"] for e in container["env"]} <= env_settings  # each variable is a setting localllm reads
