"""What the web chat page does with a model's answer, whatever it holds: an OpenAI-shaped stream from a
scripted server (the package's page, a fixed hostile answer with reasoning and a tool call) into a real
browser. Script in the answer never runs, as streamed and as reloaded from the browser's storage;
code is highlighted, reasoning folded, tool calls shown; images attach where the model has vision; the
page's requests carry its token and the interactive priority."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from localllm.api.guard import CHAT_PAGE_HEADER
from localllm.api.webchat import add_web_chat
from localllm.config.engine import INTERACTIVE_PRIORITY

REASONING = "First, think <b onmouseover=\"window.__pwned='reasoning'\">hard</b>."
ANSWER = """Here is code:

```python
print("hi")
```

<script>window.__pwned = 'script'</script>
<img src="x" onerror="window.__pwned = 'img'">
<svg onload="window.__pwned = 'svg'"></svg>
<iframe src="javascript:window.__pwned = 'iframe'"></iframe>
[click me](javascript:window.__pwned='link')
<a href="javascript:window.__pwned='anchor'">anchor</a>
<style>body { display: none }</style>
![tracker](http://127.0.0.1:9/track.png)

**bold** and `code`."""
TOOL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def _chunk(delta: dict, finish: str | None = None) -> str:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "scripted",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def scripted_app(requests: list[dict]) -> FastAPI:
    app = FastAPI()
    add_web_chat(app)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.get("/api/ps")
    def ps() -> dict:
        return {"models": []}

    @app.post("/api/show")
    def show() -> dict:
        return {"capabilities": ["completion", "vision"]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        requests.append({"body": await request.json(), "headers": dict(request.headers),
                         "token": app.state.chat_page_token})

        async def stream():
            yield _chunk({"role": "assistant", "reasoning_content": REASONING[:12]})
            yield _chunk({"reasoning_content": REASONING[12:]})
            for i in range(0, len(ANSWER), 17):  # split anywhere, tags included
                await asyncio.sleep(0.005)
                yield _chunk({"content": ANSWER[i : i + 17]})
            call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": TOOL["name"], "arguments": ""}}
            yield _chunk({"tool_calls": [call]})
            yield _chunk({"tool_calls": [{"index": 0, "function": {"arguments": TOOL["arguments"]}}]}, "tool_calls")
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def scripted():
    requests: list[dict] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(scripted_app(requests), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{port}", requests
    server.should_exit = True
    thread.join(10)


def wait(driver, condition, timeout: float = 30):
    # (the page re-renders its messages as tokens arrive: an element found a moment ago may be gone)
    ignored = (StaleElementReferenceException, NoSuchElementException, IndexError)
    return WebDriverWait(driver, timeout, poll_frequency=0.02, ignored_exceptions=ignored).until(condition)


def click(driver, selector: str) -> None:
    """Click the element ``selector`` names once the page has it (found again if it was re-rendered)."""

    def clicked(d) -> bool:
        d.find_element(By.CSS_SELECTOR, selector).click()
        return True

    wait(driver, clicked)


def assert_rendered_safely(driver) -> None:
    messages = driver.find_element(By.ID, "messages")
    assert driver.execute_script("return window.__pwned") is None
    assert not messages.find_elements(By.CSS_SELECTOR, "script, iframe, style, svg")
    for element in messages.find_elements(By.CSS_SELECTOR, "*"):
        for attribute in ("onerror", "onload", "onmouseover", "style"):
            assert element.get_dom_attribute(attribute) is None, (element.tag_name, attribute)
    for link in messages.find_elements(By.CSS_SELECTOR, "a"):
        assert not (link.get_attribute("href") or "").lower().startswith("javascript:"), link.get_attribute("href")
        assert link.get_attribute("rel") == "noopener noreferrer"
    answer = messages.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]
    assert answer.find_element(By.CSS_SELECTOR, "pre code.hljs")  # highlighted
    assert answer.find_element(By.CSS_SELECTOR, ".content strong").text == "bold"
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert driver.execute_script("return arguments[0].querySelector('.reasoning-text').textContent", reasoning) \
        == REASONING  # as text: its markup is shown, not made
    call = answer.find_element(By.CSS_SELECTOR, "details.tool-call")
    assert TOOL["name"] in call.text
    assert driver.execute_script("return arguments[0].querySelector('pre').textContent", call) == TOOL["arguments"]


def test_a_hostile_answer_runs_no_script_streamed_or_reloaded(browser, scripted, tmp_path):
    url, requests = scripted
    driver = browser
    driver.get(f"{url}/")
    wait(driver, lambda d: d.find_element(By.ID, "model").get_attribute("value") == "scripted")
    wait(driver, lambda d: d.find_element(By.ID, "attach").is_displayed())  # the model has vision
    image = tmp_path / "dot.png"
    from PIL import Image

    Image.new("RGB", (2, 2), (255, 0, 0)).save(image)
    driver.execute_script("document.getElementById('image-input').hidden = false")
    driver.find_element(By.ID, "image-input").send_keys(str(image))
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#attachments img"))
    driver.find_element(By.ID, "prompt").send_keys("Show me everything.", Keys.ENTER)
    wait(driver, lambda d: d.find_element(By.ID, "send").is_displayed() and d.find_elements(
        By.CSS_SELECTOR, "#messages .message.assistant details.tool-call"))
    assert_rendered_safely(driver)

    sent = requests[-1]
    assert sent["headers"][CHAT_PAGE_HEADER] == sent["token"]
    body = sent["body"]
    assert body["stream"] is True and body["priority"] == INTERACTIVE_PRIORITY
    assert body["context_overflow"] == "truncate-middle"
    text, picture = body["messages"][-1]["content"]
    assert text == {"type": "text", "text": "Show me everything."}
    assert picture["type"] == "image_url" and picture["image_url"]["url"].startswith("data:image/png;base64,")

    driver.refresh()  # the same answer, rendered again from the browser's storage
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant details.tool-call"))
    assert_rendered_safely(driver)
    stored = driver.execute_script("return JSON.parse(localStorage.getItem('localllm.chat.conversations'))")
    assert stored[0]["messages"][-1]["content"] == ANSWER  # kept as the model sent it; made safe when shown
    assert stored[0]["messages"][-1]["tool_calls"][0]["function"] == TOOL


def test_regenerate_and_edit_resend_replace_the_answer(browser, scripted):
    url, requests = scripted
    driver = browser
    driver.get(f"{url}/")
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant button.regenerate"))
    count = len(requests)
    click(driver, "#messages .message.assistant button.regenerate")
    wait(driver, lambda d: len(requests) == count + 1 and d.find_element(By.ID, "send").is_displayed())
    conv = driver.execute_script("return JSON.parse(localStorage.getItem('localllm.chat.conversations'))")[0]
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]  # replaced, not added
    assert [m["role"] for m in requests[-1]["body"]["messages"]] == ["user"]

    click(driver, "#messages .message.user button.edit")
    assert driver.find_element(By.ID, "editing").is_displayed()
    box = driver.find_element(By.ID, "prompt")
    assert box.get_attribute("value") == "Show me everything."
    box.clear()
    box.send_keys("Show me less.", Keys.ENTER)
    wait(driver, lambda d: len(requests) == count + 2 and d.find_element(By.ID, "send").is_displayed())
    conv = driver.execute_script("return JSON.parse(localStorage.getItem('localllm.chat.conversations'))")[0]
    assert [(m["role"], m["content"] if m["role"] == "user" else "") for m in conv["messages"]] == [
        ("user", "Show me less."), ("assistant", "")]
    assert requests[-1]["body"]["messages"][-1]["content"] == "Show me less."
