"""The web chat's screenshots in docs/ (``docs/web-chat-wide.png``, ``docs/web-chat-narrow.png``): a real
``localllm serve`` of the default model, one greedy answer, the page in the system's headless Chromium
at two widths.

    python bench/web_chat_screenshots.py [--model PATH]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from api_server import serving  # noqa: E402
from default_model import smollm2_file  # noqa: E402

QUESTION = "Write a short Python function that checks whether a word is a palindrome, and explain it."
WIDTHS = {"wide": (1280, 820), "narrow": (420, 860)}


def browser(width: int, height: int):
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("google-chrome")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))


def main() -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    args = ap.parse_args()
    model = args.model or smollm2_file()
    with serving(model, "--served-model-name", "smollm2:135m", "--kv-cache-memory", "128MiB") as proc:
        for name, (width, height) in WIDTHS.items():
            driver = browser(width, height)
            try:
                driver.get(f"{proc.url}/")
                wait = WebDriverWait(driver, 300, poll_frequency=0.1)
                wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))
                driver.execute_script("localStorage.setItem('localllm.chat.settings', JSON.stringify("
                                      "{system: '', temperature: 0, top_p: 1, max_tokens: 300}))")
                driver.refresh()
                wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))
                driver.find_element(By.ID, "prompt").send_keys(QUESTION, Keys.ENTER)
                wait.until(lambda d: d.find_element(By.ID, "stop").is_displayed())
                wait.until(lambda d: d.find_element(By.ID, "send").is_displayed())
                out = ROOT / "docs" / f"web-chat-{name}.png"
                driver.save_screenshot(str(out))
                print(f"wrote {out.relative_to(ROOT)} ({width}x{height})")
            finally:
                driver.quit()


if __name__ == "__main__":
    main()
