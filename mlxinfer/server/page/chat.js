// The chat page: streams answers from /v1/chat/completions, keeps the conversation, shows what each answer cost.
"use strict";

const $ = (id) => document.getElementById(id);
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"]; // what the server reads
const MAX_IMAGE_BYTES = 32 * 2 ** 20; // the server's limit per image
// A photo larger than this (a side, or a file) is drawn smaller and sent as JPEG: every model here reads images at
// most 2048 pixels a side (Gemma 3: 896, Mistral 3: 1540), and a phone photo's data: URL alone would pass the
// server's 4 MiB request body (the conversation sends its images again with each message).
const MAX_SIDE = 2048;
const KEEP_BYTES = 2 ** 20;
let history = [];
let attached = []; // data: URLs of the images the next message carries
let modelId = null;
let controller = null;
let apiKey = sessionStorage.getItem("mlxinfer-api-key");

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

function mib(bytes) {
  return `${(bytes / 2 ** 20).toFixed(0)} MiB`;
}

async function refreshStatus() {
  try {
    const response = await fetch("/health", { headers: headers() });
    if (response.status === 401) {
      $("model").textContent = "this server needs its API key (asked for when you send a message)";
      return;
    }
    const health = await response.json();
    const model = health.models[0];
    modelId = model ? model.id : null;
    $("model").textContent = modelId || "no model loaded";
    $("memory").textContent = `memory in use ${mib(health.memory_in_use_bytes)}`;
  } catch (error) {
    $("model").textContent = "server unreachable";
  }
}

function bubble(role, text, images = []) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  if (images.length) {
    const strip = document.createElement("div");
    strip.className = "images";
    for (const url of images) strip.appendChild(thumbnail(url));
    div.appendChild(strip);
  }
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// The model's reasoning (reasoning_content), folded above the answer; made when the first of it arrives.
function thinkingOf(div) {
  let block = div.querySelector(".thinking");
  if (!block) {
    block = document.createElement("details");
    block.className = "thinking";
    const summary = document.createElement("summary");
    summary.textContent = "Thinking";
    const reasoning = document.createElement("div");
    reasoning.className = "reasoning";
    block.append(summary, reasoning);
    div.insertBefore(block, div.querySelector(".text"));
  }
  return block.querySelector(".reasoning");
}

function showStats(div, usage, times, stopped) {
  const stats = document.createElement("span");
  stats.className = "stats";
  const parts = [];
  if (usage) {
    const tokens = usage.completion_tokens;
    const seconds = times.last && times.first && times.last > times.first ? (times.last - times.first) / 1000 : 0;
    if (seconds > 0 && tokens > 1) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
    parts.push(`${tokens} tokens`);
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens from the cache`);
  }
  if (times.first) parts.push(`first token after ${((times.first - times.start) / 1000).toFixed(2)} s`);
  if (stopped) parts.push("stopped");
  stats.textContent = parts.join(" · ");
  div.appendChild(stats);
}

async function* serverEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

function thumbnail(url) {
  const img = document.createElement("img");
  img.src = url;
  img.alt = "attached image";
  return img;
}

// Images are read here into data: URLs, the only image form the server takes from a page.
function attach(files) {
  for (const file of files) {
    if (!IMAGE_TYPES.includes(file.type)) {
      $("status").textContent = `${file.name || "that file"} is not a PNG, JPEG, WebP, GIF or BMP image`;
      continue;
    }
    if (file.size > MAX_IMAGE_BYTES) {
      $("status").textContent = `${file.name} is more than 32 MiB`;
      continue;
    }
    const reader = new FileReader();
    reader.onload = async () => {
      attached.push(await fitted(reader.result, file.size));
      showAttached();
    };
    reader.readAsDataURL(file);
  }
}

// The image as sent: as it is when small, else at most MAX_SIDE a side as a JPEG, transparency on white (as the
// server composites it). One the browser cannot draw goes as it is, for the server to name what is wrong with it.
function fitted(url, bytes) {
  return new Promise((resolve) => {
    const img = new Image();
    img.onload = () => {
      const scale = Math.min(1, MAX_SIDE / Math.max(img.naturalWidth, img.naturalHeight));
      if (scale === 1 && bytes <= KEEP_BYTES) return resolve(url);
      const canvas = document.createElement("canvas");
      canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
      canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
      const context = canvas.getContext("2d");
      context.fillStyle = "#fff";
      context.fillRect(0, 0, canvas.width, canvas.height);
      context.drawImage(img, 0, 0, canvas.width, canvas.height);
      resolve(canvas.toDataURL("image/jpeg", 0.92));
    };
    img.onerror = () => resolve(url);
    img.src = url;
  });
}

function showAttached() {
  const strip = $("attachments");
  strip.replaceChildren();
  attached.forEach((url, i) => {
    const item = document.createElement("div");
    item.className = "attachment";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "Remove this image";
    remove.addEventListener("click", () => {
      attached.splice(i, 1);
      showAttached();
    });
    item.append(thumbnail(url), remove);
    strip.appendChild(item);
  });
}

async function ask(text) {
  const conversation = history; // "New chat" replaces the array; this answer stays with its own conversation
  const images = attached;
  attached = [];
  showAttached();
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  conversation.push({ role: "user", content: images.length ? [...parts, { type: "text", text }] : text });
  bubble("user", text, images);
  const div = bubble("assistant", "");
  const body = div.querySelector(".text");
  const times = { start: performance.now(), first: 0, last: 0 };
  let usage = null;
  let stopped = false;
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: controller.signal,
      body: JSON.stringify({
        model: modelId,
        messages: conversation,
        temperature: Number($("temperature").value) || 0,
        stream: true,
        stream_options: { include_usage: true },
      }),
    });
    if (response.status === 401) {
      apiKey = prompt("This server needs its API key:");
      if (apiKey) sessionStorage.setItem("mlxinfer-api-key", apiKey);
      throw new Error("an API key is needed; send the message again");
    }
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const data of serverEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && (delta.content || delta.reasoning_content)) {
        times.last = performance.now();
        times.first = times.first || times.last;
        if (delta.reasoning_content) thinkingOf(div).textContent += delta.reasoning_content;
        if (delta.content) body.textContent += delta.content;
        div.scrollIntoView({ block: "end" });
      }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      stopped = true;
    } else {
      div.classList.add("error");
      body.textContent += (body.textContent ? "\n" : "") + `Error: ${error.message}`;
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  if (!div.classList.contains("error")) conversation.push({ role: "assistant", content: body.textContent });
  else conversation.pop(); // the question failed: leave it out of the conversation
  showStats(div, usage, times, stopped);
  div.dataset.done = "true";
  $("status").textContent = "";
  refreshStatus();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("input").disabled = busy;
  $("status").textContent = busy ? "generating…" : "";
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  ask(text).then(() => $("input").focus());
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("attach").addEventListener("click", () => $("image-file").click());
$("image-file").addEventListener("change", (event) => {
  attach(event.target.files);
  event.target.value = "";
});
$("input").addEventListener("paste", (event) => {
  const files = [...event.clipboardData.files];
  if (files.length) {
    event.preventDefault();
    attach(files);
  }
});
document.addEventListener("dragover", (event) => {
  event.preventDefault();
  document.body.classList.add("dropping");
});
document.addEventListener("dragleave", () => document.body.classList.remove("dropping"));
document.addEventListener("drop", (event) => {
  event.preventDefault();
  document.body.classList.remove("dropping");
  attach(event.dataTransfer.files);
});
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  attached = [];
  showAttached();
  $("messages").replaceChildren();
});
refreshStatus();
