// localllm's web chat: conversations in this browser's localStorage, answers streamed from the
// server's /v1/chat/completions. Model output goes through marked, then DOMPurify, before it
// reaches the page; everything else is set as text.
"use strict";

const STORE_KEY = "localllm.chat.conversations";
const SETTINGS_KEY = "localllm.chat.settings";
const API_KEY_KEY = "localllm.chat.apiKey";
const MODEL_KEY = "localllm.chat.model";
const DEFAULT_SETTINGS = { system: "", temperature: 0.7, top_p: 0.95, max_tokens: 1024 };

const meta = (name) => document.querySelector(`meta[name="${name}"]`).content;
const $ = (id) => document.getElementById(id);

const state = {
  conversations: [], // [{id, title, model, messages: [{role, content, reasoning, tool_calls, images, ...}], updated}]
  currentId: null,
  settings: { ...DEFAULT_SETTINGS },
  streaming: null, // {controller, message} while an answer streams
  editing: null, // the index of the user message being edited
  attachments: [], // data: URLs of the images for the next message
  vision: false,
};

// ---------------------------------------------------------------- storage

function load() {
  try { state.conversations = JSON.parse(localStorage.getItem(STORE_KEY)) || []; } catch { state.conversations = []; }
  try { state.settings = { ...DEFAULT_SETTINGS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY)) }; } catch { /* defaults */ }
  state.currentId = state.conversations.length ? state.conversations[0].id : null;
}

function save() {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify(state.conversations));
  } catch (err) {
    showNotice(`Could not keep the conversations in this browser: ${err.message}`);
  }
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newConversation() {
  const conv = { id: crypto.randomUUID(), title: "New chat", model: $("model").value, messages: [], updated: Date.now() };
  state.conversations.unshift(conv);
  state.currentId = conv.id;
  return conv;
}

// ---------------------------------------------------------------- the server

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  headers[meta("localllm-chat-page-header")] = meta("localllm-chat-page-token");
  const key = localStorage.getItem(API_KEY_KEY);
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function askForKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("api-key").value = "";
    dialog.addEventListener("close", () => {
      const key = $("api-key").value.trim();
      if (key) localStorage.setItem(API_KEY_KEY, key);
      resolve(Boolean(key));
    }, { once: true });
    dialog.showModal();
  });
}

// fetch with the page's headers; a 401 asks for the key once and tries again.
async function api(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const response = await fetch(path, { ...options, headers: authHeaders() });
    if (response.status !== 401 || attempt > 0 || !(await askForKey())) return response;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && (body.error.message || body.error)) || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function loadModels() {
  const select = $("model");
  const response = await api("/v1/models");
  if (!response.ok) {
    $("model-status").textContent = `Could not list the models: ${await errorText(response)}`;
    return;
  }
  const models = (await response.json()).data.map((m) => m.id);
  select.replaceChildren(...models.map((id) => new Option(id, id)));
  const conv = current();
  const wanted = (conv && conv.model) || localStorage.getItem(MODEL_KEY);
  if (wanted && models.includes(wanted)) select.value = wanted;
  await modelChanged();
}

async function modelChanged() {
  const model = $("model").value;
  if (!model) return;
  localStorage.setItem(MODEL_KEY, model);
  const conv = current();
  if (conv && !state.streaming) { conv.model = model; save(); }
  let loaded = false;
  try {
    const ps = await api("/api/ps");
    if (ps.ok) loaded = (await ps.json()).models.some((m) => m.name === model);
  } catch { /* the status line only */ }
  $("model-status").textContent = loaded ? "loaded" : "loads with the first message";
  state.vision = false;
  try {
    const show = await api("/api/show", { method: "POST", body: JSON.stringify({ model }) });
    if (show.ok) state.vision = ((await show.json()).capabilities || []).includes("vision");
  } catch { /* text only */ }
  $("attach").hidden = !state.vision;
  if (!state.vision) clearAttachments();
}

// ---------------------------------------------------------------- rendering

function markdown(element, text) {
  const html = marked.parse(text || "", { async: false, gfm: true });
  element.innerHTML = DOMPurify.sanitize(html, { USE_PROFILES: { html: true },
    FORBID_TAGS: ["style", "form", "input", "textarea", "select", "button"], FORBID_ATTR: ["style"] });
  for (const link of element.querySelectorAll("a")) {
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  }
  for (const block of element.querySelectorAll("pre code")) hljs.highlightElement(block);
}

function messageElement(message, index, conv) {
  const el = document.createElement("div");
  el.className = `message ${message.role}`;
  el.dataset.index = String(index);
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : (message.model || conv.model || "assistant");
  el.append(role);
  if (message.images && message.images.length) {
    const images = document.createElement("div");
    images.className = "images";
    for (const url of message.images) {
      const img = document.createElement("img");
      img.src = url;
      img.alt = "attached image";
      images.append(img);
    }
    el.append(images);
  }
  if (message.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = message === (state.streaming && state.streaming.message) && !message.content
      ? "Thinking…" : "Reasoning";
    const text = document.createElement("div");
    text.className = "reasoning-text";
    text.textContent = message.reasoning;
    details.append(summary, text);
    el.append(details);
  }
  for (const call of message.tool_calls || []) {
    const details = document.createElement("details");
    details.className = "tool-call";
    const summary = document.createElement("summary");
    summary.textContent = `Tool call: ${call.function.name}`;
    const args = document.createElement("pre");
    args.textContent = call.function.arguments;
    details.append(summary, args);
    el.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  if (message.role === "user") content.textContent = message.content;
  else markdown(content, message.content);
  el.append(content);
  if (message.error) {
    const error = document.createElement("div");
    error.className = "error";
    error.textContent = message.error;
    el.append(error);
  }
  const streaming = state.streaming && state.streaming.message === message;
  if (streaming || message.stopped || message.finish_reason === "length") {
    const status = document.createElement("div");
    status.className = "status";
    status.textContent = streaming ? (message.content || message.reasoning ? "…" : "waiting for the model…")
      : message.stopped ? "stopped" : "cut at the token limit";
    el.append(status);
  }
  if (!state.streaming) el.append(actionsFor(message, index, conv));
  return el;
}

function actionsFor(message, index, conv) {
  const actions = document.createElement("div");
  actions.className = "actions";
  const button = (label, handler) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.className = label.toLowerCase();
    b.addEventListener("click", handler);
    actions.append(b);
  };
  if (message.role === "user") button("Edit", () => startEdit(index));
  if (message.role === "assistant") {
    button("Copy", () => navigator.clipboard && navigator.clipboard.writeText(message.content));
    if (index === conv.messages.length - 1) button("Regenerate", () => regenerate());
  }
  return actions;
}

let pendingRender = 0; // a renderSoon's timer

function renderMessages() {
  const conv = current();
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  box.replaceChildren(...(conv ? conv.messages.map((m, i) => messageElement(m, i, conv)) : []));
  if (atBottom || state.streaming) box.scrollTop = box.scrollHeight;
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((conv) => {
    const li = document.createElement("li");
    li.className = conv.id === state.currentId ? "current" : "";
    li.dataset.id = conv.id;
    const title = document.createElement("button");
    title.type = "button";
    title.className = "title";
    title.textContent = conv.title;
    title.addEventListener("click", () => switchTo(conv.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.title = "Delete this conversation";
    remove.addEventListener("click", () => deleteConversation(conv.id));
    li.append(title, remove);
    return li;
  }));
}

function renderComposer() {
  const busy = Boolean(state.streaming);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("model").disabled = busy;
  $("editing").hidden = state.editing === null;
}

function render() {
  clearTimeout(pendingRender);
  pendingRender = 0;
  renderConversations();
  renderMessages();
  renderComposer();
}

function renderSoon() { // at most every 40 ms while tokens stream (a timer: frames stop in a hidden tab)
  if (!pendingRender) pendingRender = setTimeout(() => { pendingRender = 0; renderMessages(); }, 40);
}

function showNotice(text) {
  const notice = $("notice");
  notice.textContent = text;
  notice.hidden = !text;
}

// ---------------------------------------------------------------- conversations

function switchTo(id) {
  if (state.streaming) return;
  state.currentId = id;
  state.editing = null;
  const conv = current();
  if (conv && conv.model && [...$("model").options].some((o) => o.value === conv.model)) {
    $("model").value = conv.model;
    modelChanged();
  }
  showNotice("");
  render();
}

function deleteConversation(id) {
  if (state.streaming && state.currentId === id) return;
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations.length ? state.conversations[0].id : null;
  save();
  render();
}

function exportConversations() {
  const blob = new Blob([JSON.stringify({ exported: new Date().toISOString(), conversations: state.conversations },
    null, 2)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = "localllm-conversations.json";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

function startEdit(index) {
  const conv = current();
  state.editing = index;
  $("prompt").value = conv.messages[index].content;
  $("prompt").focus();
  renderComposer();
}

// ---------------------------------------------------------------- sending

function requestMessages(conv) {
  const out = [];
  if (state.settings.system.trim()) out.push({ role: "system", content: state.settings.system });
  for (const m of conv.messages) {
    if (m.role === "user") {
      const content = m.images && m.images.length
        ? [{ type: "text", text: m.content }, ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))]
        : m.content;
      out.push({ role: "user", content });
    } else if (!m.error || m.content) {
      const message = { role: "assistant", content: m.content || "" };
      if (m.tool_calls && m.tool_calls.length) message.tool_calls = m.tool_calls;
      out.push(message);
    }
  }
  return out;
}

async function send(text) {
  let conv = current();
  if (!conv) conv = newConversation();
  if (state.editing !== null) {
    conv.messages.splice(state.editing);
    state.editing = null;
  }
  conv.messages.push({ role: "user", content: text, images: state.attachments.slice() });
  if (conv.title === "New chat") conv.title = text.slice(0, 60) || "New chat";
  clearAttachments();
  await answer(conv);
}

async function regenerate() {
  const conv = current();
  if (!conv || state.streaming) return;
  if (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
  await answer(conv);
}

async function answer(conv) {
  const model = $("model").value;
  conv.model = model;
  conv.updated = Date.now();
  const message = { role: "assistant", content: "", reasoning: "", tool_calls: [], model };
  conv.messages.push(message);
  const controller = new AbortController();
  state.streaming = { controller, message };
  showNotice("");
  save();
  render();
  const s = state.settings;
  const body = {
    model, stream: true, messages: requestMessages({ messages: conv.messages.slice(0, -1) }),
    temperature: s.temperature, top_p: s.top_p, max_tokens: s.max_tokens,
    priority: Number(meta("localllm-interactive-priority")),
    context_overflow: "truncate-middle", // a long chat keeps its system prompt and latest turns
  };
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      signal: controller.signal });
    if (!response.ok) {
      message.error = await errorText(response);
    } else {
      const dropped = response.headers.get("x-context-dropped-messages");
      if (dropped) showNotice(`The chat is longer than the model's context: ${dropped} earlier message(s) were left out of this answer.`);
      $("model-status").textContent = "loaded";
      await readStream(response, message);
    }
  } catch (err) {
    if (err.name === "AbortError") message.stopped = true;
    else message.error = `The request failed: ${err.message}`;
  } finally {
    state.streaming = null;
    conv.updated = Date.now();
    save();
    render();
  }
}

async function readStream(response, message) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        apply(JSON.parse(data), message);
      }
      renderSoon();
    }
  }
}

function apply(chunk, message) {
  if (chunk.error) {
    message.error = chunk.error.message || String(chunk.error);
    return;
  }
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.content) message.content += delta.content;
    if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
    for (const call of delta.tool_calls || []) {
      const slot = message.tool_calls[call.index] ||= { id: call.id, type: "function", function: { name: "", arguments: "" } };
      if (call.id) slot.id = call.id;
      if (call.function && call.function.name) slot.function.name += call.function.name;
      if (call.function && call.function.arguments) slot.function.arguments += call.function.arguments;
    }
    if (choice.finish_reason) message.finish_reason = choice.finish_reason;
  }
}

function stop() {
  if (state.streaming) state.streaming.controller.abort();
}

// ---------------------------------------------------------------- images

function clearAttachments() {
  state.attachments = [];
  $("attachments").replaceChildren();
}

function attach(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => {
      state.attachments.push(reader.result);
      const img = document.createElement("img");
      img.src = reader.result;
      img.alt = file.name;
      $("attachments").append(img);
    };
    reader.readAsDataURL(file);
  }
}

// ---------------------------------------------------------------- settings

function showSettings() {
  const s = state.settings;
  $("system").value = s.system;
  $("temperature").value = s.temperature;
  $("top-p").value = s.top_p;
  $("max-tokens").value = s.max_tokens;
}

function readSettings() {
  const number = (id, fallback) => {
    const v = Number($(id).value);
    return Number.isFinite(v) && $(id).value !== "" ? v : fallback;
  };
  state.settings = {
    system: $("system").value,
    temperature: number("temperature", DEFAULT_SETTINGS.temperature),
    top_p: number("top-p", DEFAULT_SETTINGS.top_p),
    max_tokens: Math.max(1, Math.round(number("max-tokens", DEFAULT_SETTINGS.max_tokens))),
  };
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(state.settings));
}

// ---------------------------------------------------------------- wiring

function init() {
  hljs.configure({ ignoreUnescapedHTML: true });
  load();
  showSettings();
  render();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.streaming || !$("model").value) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    if (state.streaming) return;
    newConversation();
    state.editing = null;
    save();
    render();
    $("prompt").focus();
  });
  $("cancel-edit").addEventListener("click", () => { state.editing = null; $("prompt").value = ""; renderComposer(); });
  $("export").addEventListener("click", exportConversations);
  $("sidebar-toggle").addEventListener("click", () => $("sidebar").classList.toggle("open"));
  $("conversations").addEventListener("click", () => $("sidebar").classList.remove("open"));
  $("model").addEventListener("change", modelChanged);
  $("settings-toggle").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
  });
  for (const id of ["system", "temperature", "top-p", "max-tokens"]) $(id).addEventListener("change", readSettings);
  $("attach").addEventListener("click", () => $("image-input").click());
  $("image-input").addEventListener("change", (event) => { attach(event.target.files); event.target.value = ""; });
  window.addEventListener("storage", (event) => { // another tab changed the conversations
    if (event.key === STORE_KEY && !state.streaming) {
      const id = state.currentId;
      load();
      if (state.conversations.some((c) => c.id === id)) state.currentId = id;
      render();
    }
  });
  loadModels();
}

document.addEventListener("DOMContentLoaded", init);
