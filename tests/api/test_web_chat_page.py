"""The web chat page as the server serves it: the page at ``/`` and its files under ``/ui/`` (public,
with a content security policy that lets only the package's own scripts run), nothing else from the
package, ``--no-web-ui``, and the vendored libraries as their manifest pins them. The page itself is
driven in a browser by tests/webchat/."""

from __future__ import annotations

import hashlib
import re
from importlib import resources

import httpx
import pytest

from localllm.api.webchat import CONTENT_SECURITY_POLICY, asset_names, vendored


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("page") / "tiny.gguf")


def _app(model, **flags):
    from localllm.api.launch import build_pool, server_app
    from localllm.config.settings import load_settings

    settings = load_settings({"model": str(model), "served_model_name": "tiny", "kv_cache_memory": "16MiB",
                              "threads": 1, **flags})
    pool, _ = build_pool(settings)
    return server_app(settings, pool), pool


async def _get(app, *paths: str, headers: dict | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        return [await http.get(p, headers=headers) for p in paths]


def _serve(model, paths, headers=None, **flags) -> list[httpx.Response]:
    import asyncio

    app, pool = _app(model, **flags)
    try:
        return asyncio.run(_get(app, *paths, headers=headers))
    finally:
        pool.shutdown(0)


def test_the_page_and_its_files_are_public_and_locked_to_their_origin(model):
    page, script, marked, models = _serve(model, ["/", "/ui/chat.js", "/ui/vendor/marked.umd.js", "/v1/models"],
                                          api_key="sesame")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"
    token = re.search(r'name="localllm-chat-page-token" content="([^"]+)"', page.text)[1]
    assert len(token) >= 32 and "{{" not in page.text
    assert re.search(r'name="localllm-interactive-priority" content="-1"', page.text)
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "DOMPurify.sanitize" in script.text  # model output is sanitized before it reaches the page
    assert marked.status_code == 200 and "marked" in marked.text[:200]
    assert models.status_code == 401  # the API still needs the key the page asks for
    # every script and style the page names is one the server serves
    for src in re.findall(r'(?:src|href)="/ui/([^"?]+)', page.text):
        assert src in asset_names(), src


def test_nothing_else_of_the_package_is_served(model):
    paths = ["/ui/../__init__.py", "/ui/vendor/manifest.json", "/ui/vendor/marked.LICENSE", "/ui/index.html",
             "/ui/%2e%2e/__init__.py", "/ui/nothing.js"]
    assert [r.status_code for r in _serve(model, paths)] == [404] * len(paths)


def test_no_web_ui_turns_the_page_off(model):
    page, script, health = _serve(model, ["/", "/ui/chat.js", "/health"], web_ui=False)
    assert page.status_code == 404 and script.status_code == 404 and health.status_code == 200


def test_vendored_libraries_are_the_pinned_files_with_their_licences():
    vendor = resources.files("localllm.api.webchat") / "static" / "vendor"
    files = vendored()
    assert {f["package"] for f in files} == {"marked", "dompurify", "@highlightjs/cdn-assets"}
    for entry in files:
        assert hashlib.sha256((vendor / entry["file"]).read_bytes()).hexdigest() == entry["sha256"], entry["file"]
        assert re.fullmatch(r"\d+\.\d+\.\d+", entry["version"])
        licence = (vendor / entry["licence_file"]).read_text()
        assert any(word in licence for word in ("MIT", "Apache License", "BSD")), entry["licence_file"]
