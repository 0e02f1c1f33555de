"""The chat page in a real headless Chromium: it loads offline, streams an answer, keeps the conversation, stops."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from mlxinfer.engine import SchedulerConfig
from mlxinfer.server import ModelSet, ServerSettings
from mlxinfer.server.uvicorn_host import BackgroundServer
from mlxinfer.ui.tray import icon_image
from tests.system_tools import require
from tests.test_server import metric

PAGE = Path(__file__).resolve().parents[1] / "mlxinfer" / "server" / "page"


@pytest.fixture(scope="module")
def page_server(smol):
    models = ModelSet()
    models.add(smol, SchedulerConfig(max_batch=4))
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    require("chromium", "chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=900,700"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # the network events: what each request got
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    yield driver
    driver.quit()


def wait_for(condition, timeout: float = 180, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out waiting for the page")


def send(browser, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def answers(browser) -> list:
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, ".message.assistant")


def test_the_page_ships_no_outside_resources():
    for name in ("index.html", "chat.js", "chat.css"):
        text = (PAGE / name).read_text()
        assert not re.search(r"https?://", text), f"{name} refers to another site"


def test_page_is_served_with_a_strict_content_security_policy(page_server):
    response = httpx.get(page_server.url + "/")
    assert response.status_code == 200 and "<textarea" in response.text
    assert "default-src 'self'" in response.headers["content-security-policy"]
    assert httpx.get(page_server.url + "/page/chat.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(page_server.url + "/page/..%2Fapp.py").status_code == 404


@pytest.fixture(scope="module")
def tiny_page_server(tiny_llama):
    models = ModelSet()
    models.add(tiny_llama, SchedulerConfig())
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running
    models.close()  # its scheduler; the shared model stays loaded


def test_the_favicon_is_the_tray_icon(tiny_page_server):
    from PIL import Image

    response = httpx.get(tiny_page_server.url + "/favicon.ico")
    assert response.status_code == 200 and response.headers["content-type"] == "image/x-icon"
    icon = Image.open(io.BytesIO(response.content))
    for size in (16, 32, 48):
        assert icon.ico.getimage((size, size)).convert("RGBA").tobytes() == icon_image(size).tobytes()
    assert '<link rel="icon" href="/favicon.ico">' in httpx.get(tiny_page_server.url + "/").text


def test_the_page_loads_with_no_failed_request(tiny_page_server, browser):
    from selenium.webdriver.common.by import By

    browser.get_log("performance")  # drop earlier pages' events
    browser.get(tiny_page_server.url + "/")
    wait_for(lambda: "llama_classic" in browser.find_element(By.ID, "model").text, timeout=30)
    statuses: dict[str, int] = {}

    def favicon_answered() -> bool:
        for entry in browser.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.responseReceived":
                response = message["params"]["response"]
                statuses[response["url"]] = response["status"]
        return tiny_page_server.url + "/favicon.ico" in statuses

    wait_for(favicon_answered, timeout=30)
    assert {url: status for url, status in statuses.items() if status >= 400} == {}


def test_chat_streams_an_answer_keeps_history_and_stops(page_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(page_server.url + "/")
    wait_for(lambda: "SmolLM2" in browser.find_element(By.ID, "model").text)
    assert "MiB" in browser.find_element(By.ID, "memory").text

    send(browser, "What is the capital of France?")
    first = wait_for(lambda: [a for a in answers(browser) if a.get_attribute("data-done")])[0]
    assert first.find_element(By.CLASS_NAME, "text").text == "The capital of France is Paris."
    stats = first.find_element(By.CLASS_NAME, "stats").text
    assert "tokens/s" in stats and "prompt tokens from the cache" in stats

    # The second turn sends the whole conversation: the first turn's tokens come from the prefix cache.
    send(browser, "And of Italy?")
    second = wait_for(lambda: len(answers(browser)) == 2 and answers(browser)[1].get_attribute("data-done"))
    assert second
    stats = answers(browser)[1].find_element(By.CLASS_NAME, "stats").text
    cached, prompt = map(int, re.search(r"(\d+) of (\d+) prompt tokens", stats).groups())
    assert cached > 30 and cached < prompt
    browser.save_screenshot(str(tmp_path / "chat.png"))
    assert (tmp_path / "chat.png").stat().st_size > 10_000

    # Stop: a long answer is cut, the server frees the place, the page is ready again.
    send(browser, "Count from 1 to 300, separated by commas.")
    wait_for(lambda: len(answers(browser)) == 3 and answers(browser)[2].text.strip(), timeout=120)
    browser.find_element(By.ID, "stop").click()
    third = wait_for(lambda: len(answers(browser)) == 3 and answers(browser)[2].get_attribute("data-done"))
    assert third
    assert "stopped" in answers(browser)[2].find_element(By.CLASS_NAME, "stats").text
    assert browser.find_element(By.ID, "send").is_displayed()
    wait_for(lambda: metric(page_server.url, "mlxinfer_running_requests") == 0, timeout=60)


@pytest.fixture(scope="module")
def thinking_page_server(tmp_path_factory):
    from tests.test_structured_server import THINKING_TEMPLATE, tiny_with_template

    models = ModelSet()
    models.add(tiny_with_template(tmp_path_factory.mktemp("thinking") / "thinking", THINKING_TEMPLATE))
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running
    models.close()


@pytest.mark.slow
def test_reasoning_streams_into_a_folded_thinking_block(thinking_page_server, browser):
    from selenium.webdriver.common.by import By

    browser.get(thinking_page_server.url + "/")
    wait_for(lambda: "thinking" in browser.find_element(By.ID, "model").text, timeout=30)
    send(browser, "Why is the sky blue?")
    answer = wait_for(lambda: [a for a in answers(browser) if a.get_attribute("data-done")])[0]
    block = answer.find_element(By.CSS_SELECTOR, "details.thinking")
    assert block.get_attribute("open") is None  # folded until opened
    assert block.find_element(By.TAG_NAME, "summary").text == "Thinking"
    # What the page showed is what the API answers for the same conversation (greedy, the page's temperature 0).
    question = [{"role": "user", "content": "Why is the sky blue?"}]
    expected = httpx.post(
        thinking_page_server.url + "/v1/chat/completions", json={"messages": question, "temperature": 0}, timeout=300
    ).json()["choices"][0]["message"]
    assert expected["reasoning_content"]
    assert block.find_element(By.CLASS_NAME, "reasoning").get_attribute("textContent") == expected["reasoning_content"]
    assert answer.find_element(By.CLASS_NAME, "text").get_attribute("textContent") == (expected["content"] or "")
    # The block sits above the answer's text.
    assert answer.find_elements(By.CSS_SELECTOR, ".thinking + .text")


@pytest.fixture(scope="module")
def vision_page_server():
    import mlxinfer
    from tests.conftest import TINY

    models = ModelSet()
    models.add(mlxinfer.load(TINY / "gemma3_vision"), SchedulerConfig())
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running
    models.close()


@pytest.mark.slow
def test_an_attached_and_a_dropped_image_are_previewed_and_asked_about(vision_page_server, browser, tmp_path):
    import mlx.core as mx
    from selenium.webdriver.common.by import By

    from tests.test_vision import IMAGES, MODEL

    tokens = mx.load(str(MODEL / "golden_image.safetensors"))["portrait.greedy"].tolist()
    expected = mlxinfer_tokenizer().decode(tokens)
    browser.get(vision_page_server.url + "/")
    wait_for(lambda: "gemma3_vision" in browser.find_element(By.ID, "model").text, timeout=30)
    browser.execute_script("document.getElementById('image-file').hidden = false")
    browser.find_element(By.ID, "image-file").send_keys(str(IMAGES / "hopper.jpg"))
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#attachments img"), timeout=30)
    # The preview is drawn (the page's content security policy lets it show data: images, nothing else).
    wait_for(lambda: browser.execute_script("return document.querySelector('#attachments img').naturalWidth"))
    browser.execute_script("document.getElementById('image-file').hidden = true")
    send(browser, "Who is this?")  # the golden case: the image, then the question, answered greedily
    first = wait_for(lambda: [a for a in answers(browser) if a.get_attribute("data-done")])[0]
    # The page sets no max_tokens: its answer runs on past the 8 greedy tokens transformers gave.
    assert first.find_element(By.CLASS_NAME, "text").text.startswith(expected.strip())
    assert browser.find_elements(By.CSS_SELECTOR, ".message.user img")
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img")  # sent with that message only
    # A dropped file is read the same way; the server's refusal of a non-image shows in the status line.
    browser.execute_script(
        """const drop = (name, type, bytes) => {
             const data = new DataTransfer();
             data.items.add(new File([bytes], name, { type }));
             document.dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true }));
           };
           drop("notes.txt", "text/plain", "hello");
           drop("pixel.png", "image/png", Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0)));""",
        base64_png(),
    )
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#attachments img")) == 1, timeout=30)
    assert "notes.txt is not a PNG" in browser.find_element(By.ID, "status").text
    # A pasted image joins it (Ctrl+V of a screenshot into the message box).
    browser.execute_script(
        """const data = new DataTransfer();
           data.items.add(new File([Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0))], "shot.png",
                                   { type: "image/png" }));
           document.getElementById("input").dispatchEvent(new ClipboardEvent("paste", { clipboardData: data,
                                                                                   bubbles: true }));""",
        base64_png(),
    )
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#attachments img")) == 2, timeout=30)
    # A phone-sized photo (3000 x 2250, 7 MB: its data: URL alone would pass the server's 4 MiB body) is sent as a
    # 2048-pixel JPEG, and the message with all three images is answered.
    import numpy as np
    from PIL import Image

    photo = tmp_path / "photo.jpg"
    noise = np.random.default_rng(0).integers(0, 256, (2250, 3000, 3), dtype=np.uint8)
    Image.fromarray(noise).save(photo, quality=95)
    assert photo.stat().st_size > 4 << 20
    browser.execute_script("document.getElementById('image-file').hidden = false")
    browser.find_element(By.ID, "image-file").send_keys(str(photo))
    browser.execute_script("document.getElementById('image-file').hidden = true")
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#attachments img")) == 3, timeout=30)
    sent = browser.execute_script("return attached.map((url) => [url.slice(0, 15), url.length])")
    assert sent[:2] == [["data:image/png;", len(base64_png()) + 22]] * 2  # small ones go as they are
    assert sent[2][0] == "data:image/jpeg" and sent[2][1] < 4 << 20
    third = browser.find_elements(By.CSS_SELECTOR, "#attachments img")[2]
    assert wait_for(lambda: browser.execute_script("return arguments[0].naturalWidth", third)) == 2048
    send(browser, "And these?")
    wait_for(lambda: len([a for a in answers(browser) if a.get_attribute("data-done")]) == 2)
    assert not browser.find_element(By.ID, "status").text.strip()


def mlxinfer_tokenizer():
    from mlxinfer.models import load_tokenizer
    from tests.conftest import TINY

    return load_tokenizer(TINY / "gemma3_vision")


def base64_png() -> str:
    import base64

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2, 2), "blue").save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()
