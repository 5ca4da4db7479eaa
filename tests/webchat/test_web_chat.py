"""The web chat page in a real browser against a real ``localllm serve`` (the store's SmolLM2 under two
names, an API key): the page asks for the key, a message streams its answer (the greedy answer the API
gives), stop ends the stream and the server's request, another model answers after a switch, and a
reload finds the conversations."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from api_server import batch_invariant_env, serving
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

KEY = "open-sesame"
FIRST, SECOND = "smol-first", "smol-second"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    from tiny_models import add_to_store

    from localllm.store import local

    home = tmp_path_factory.mktemp("webchat-home")
    before = os.environ.get("LOCALLLM_HOME")
    os.environ["LOCALLLM_HOME"] = str(home)
    try:
        add_to_store(FIRST, smollm2_path)
        local.copy(FIRST, SECOND)
    finally:
        if before is None:
            del os.environ["LOCALLLM_HOME"]
        else:
            os.environ["LOCALLLM_HOME"] = before
    env = {"LOCALLLM_HOME": str(home), **batch_invariant_env()}
    with serving(None, "--api-key", KEY, "--kv-cache-memory", "128MiB", env=env) as proc:
        yield proc


@pytest.fixture(scope="module")
def page(browser, server):
    """The chat page, its key given once (kept in the browser for the module's tests)."""
    browser.get(f"{server.url}/")
    dialog = browser.find_element(By.ID, "key-dialog")
    wait(browser, lambda d: dialog.get_attribute("open") is not None)  # /v1/models said 401
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "save-key").click()
    wait(browser, lambda d: len(Select(d.find_element(By.ID, "model")).options) == 2)
    return browser


def wait(driver, condition, timeout: float = 120):
    # (the page re-renders its messages as tokens arrive: an element found a moment ago may be gone)
    ignored = (StaleElementReferenceException, NoSuchElementException, IndexError)
    return WebDriverWait(driver, timeout, poll_frequency=0.02, ignored_exceptions=ignored).until(condition)


def answer_text(driver) -> str:
    """The last answer's text as the page shows it now (read in one step, while it re-renders)."""
    return driver.execute_script(
        "const m = [...document.querySelectorAll('#messages .message.assistant')].pop();"
        "return m ? m.querySelector('.content').innerText : '';")


def conversations(driver) -> list[dict]:
    return driver.execute_script("return JSON.parse(localStorage.getItem('localllm.chat.conversations')) || []")


def set_setting(driver, element_id: str, value) -> None:
    toggle = driver.find_element(By.ID, "settings-toggle")
    if not driver.find_element(By.ID, "settings").is_displayed():
        toggle.click()
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value), Keys.TAB)  # (the change event)


def streaming(driver) -> bool:
    return driver.find_element(By.ID, "stop").is_displayed()


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text, Keys.ENTER)


def api(server, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                         **kwargs)


def test_a_message_streams_the_models_greedy_answer(page, server):
    driver = page
    assert [o.text for o in Select(driver.find_element(By.ID, "model")).options] == [FIRST, SECOND]
    set_setting(driver, "temperature", 0)
    set_setting(driver, "max-tokens", 96)
    question = "Write a paragraph of five sentences about Paris."
    send(driver, question)
    wait(driver, streaming)
    partial: list[str] = []  # the answer as the page showed it while the stop button was up
    while streaming(driver):
        text = answer_text(driver)
        if text and (not partial or text != partial[-1]):
            partial.append(text)
        time.sleep(0.01)
    assert len(partial) >= 2, (partial, answer_text(driver), conversations(driver))  # it grew while it streamed
    conv = conversations(driver)[0]
    assert conv["model"] == FIRST and [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    shown = conv["messages"][1]["content"]
    body = {"model": FIRST, "temperature": 0, "top_p": 0.95, "max_tokens": 96,
            "messages": [{"role": "user", "content": question}]}
    expected = api(server, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert shown == expected
    assert answer_text(driver).strip()
    assert conv["title"] == question


def test_stop_ends_the_stream_and_the_servers_request(page, server):
    driver = page
    driver.find_element(By.ID, "new-chat").click()
    set_setting(driver, "max-tokens", 2000)
    send(driver, "Write a very long story about a dragon who learns to cook.")
    wait(driver, lambda d: len(answer_text(d)) > 20)
    driver.find_element(By.ID, "stop").click()
    wait(driver, lambda d: not streaming(d), timeout=10)
    assert driver.execute_script(
        "return [...document.querySelectorAll('#messages .message.assistant')].pop().querySelector('.status')"
        ".textContent") == "stopped"
    stopped = conversations(driver)[0]["messages"][-1]
    assert stopped["stopped"] and stopped["content"]
    time.sleep(1.0)
    assert conversations(driver)[0]["messages"][-1]["content"] == stopped["content"]  # nothing more arrived
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the server let the request go: nothing runs or waits
        models = api(server, "GET", "/api/ps").json()["models"]
        if all(m["running"] == 0 and m["waiting"] == 0 for m in models):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the stopped request still runs on the server: {models}")
    assert driver.find_element(By.ID, "send").is_displayed()


def test_switching_models_answers_with_the_other_model(page, server):
    driver = page
    driver.find_element(By.ID, "new-chat").click()
    set_setting(driver, "max-tokens", 24)
    Select(driver.find_element(By.ID, "model")).select_by_visible_text(SECOND)
    wait(driver, lambda d: d.find_element(By.ID, "model-status").text == "loads with the first message")
    send(driver, "Say hello.")
    wait(driver, streaming)
    wait(driver, lambda d: not streaming(d))
    role, errors = driver.execute_script(
        "const m = [...document.querySelectorAll('#messages .message.assistant')].pop();"
        "return [m.querySelector('.role').textContent, m.querySelectorAll('.error').length];")
    assert role == SECOND and errors == 0
    assert conversations(driver)[0]["model"] == SECOND
    assert SECOND in {m["name"] for m in api(server, "GET", "/api/ps").json()["models"]}


def test_a_reload_finds_the_conversations(page, server):
    driver = page
    before = conversations(driver)
    driver.refresh()
    wait(driver, lambda d: len(Select(d.find_element(By.ID, "model")).options) == 2)
    assert driver.find_element(By.ID, "key-dialog").get_attribute("open") is None  # the key was kept
    titles = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#conversations .title")]
    assert titles == [c["title"] for c in before] and len(titles) == 3
    shown = driver.find_elements(By.CSS_SELECTOR, "#messages .message")
    assert len(shown) == len(before[0]["messages"])
    driver.find_elements(By.CSS_SELECTOR, "#conversations .title")[-1].click()  # the first chat
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#messages .message.user .content")[0].text
         == "Write a paragraph of five sentences about Paris.")
    assert Select(driver.find_element(By.ID, "model")).first_selected_option.text == FIRST
