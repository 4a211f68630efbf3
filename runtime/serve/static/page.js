// The page of `runtime serve` (runtime/serve/page.py serves it). It reads GET info once, then
// streams POST v1/images/generations with fetch() and a body reader (EventSource cannot POST)
// and draws every event as it arrives: previews, tokens done, and per image its tau, method and
// seed. URLs are relative, so the page works under a proxy's prefix (--root-path).
//
// What a test (tests/test_serve_page.py) reads from the DOM:
//   body[data-state]              loading | idle | running | done | error
//   .card[data-index=i]           one per image: data-state waiting | decoding | done | failed,
//                                 data-partials (previews shown), its <img> the latest picture
//   #request-seed                 the request's run seed (the one typed, or the server's draw)
"use strict";

const $ = (id) => document.getElementById(id);
let info = null;        // GET info: model, method, class names or text, size, limits
let running = null;     // the AbortController of the request in flight

function setState(state, message) {
  document.body.dataset.state = state;
  if (message !== undefined) $("status").textContent = message;
}

async function errorMessage(answer) {
  // OpenAI's error body: {"error": {"message", "type", "param", "code"}}
  try {
    const body = await answer.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: fall through */ }
  return `${answer.status} ${answer.statusText}`;
}

async function loadInfo() {
  const answer = await fetch("info");
  if (!answer.ok) throw new Error(`GET info: ${await errorMessage(answer)}`);
  info = await answer.json();
  const names = info.names.length > 1 ? ` (also ${info.names.slice(1).join(", ")})` : "";
  $("about").textContent = `Model ${info.model}${names}, method ${info.method}, ${info.size} images ` +
    `of ${info.tokens_per_image} tokens; server ${info.version}.`;
  if (info.prompt === "class") {
    const select = $("class");
    for (let id = 0; id < info.num_classes; id++) {
      const name = info.class_names ? info.class_names[id] : null;
      select.add(new Option(name ? `${id}: ${name}` : String(id), String(id)));
    }
    $("class-row").hidden = false;
  } else {
    $("caption-row").hidden = false;
  }
  $("n").max = String(info.max_images);
  $("partials").max = String(info.max_partial_images);
  if (info.api_key_required) {
    $("key-row").hidden = false;
    $("key").value = sessionStorage.getItem("lantern-api-key") || "";
  }
  $("go").disabled = false;
  setState("idle", "");
}

// Server-sent events from a streamed body: yields {event, data} per block ("\n\n"-separated).
async function* serverEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// A whole-number field's digits as the server wrote them: seeds run to 2**63 and JSON.parse
// rounds past 2**53 (an image's seed derived from the run seed usually is that large).
function digits(data, field) {
  const found = data.match(new RegExp(`"${field}":\\s*(\\d+)`));
  return found ? found[1] : "?";
}

// what a card shows until its first preview: one gray pixel (128, 128, 128), as previews paint
// what is not known yet
// (an <img> without a source shows a broken-image icon)
const PLACEHOLDER = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNoaGgAAAMEAYFL09IQAAAAAElFTkSuQmCC";

function makeCard(index) {
  const card = document.createElement("figure");
  card.className = "card";
  card.dataset.index = String(index);
  card.dataset.state = "waiting";
  card.dataset.partials = "0";
  const img = document.createElement("img");
  img.alt = `image ${index}`;
  img.src = PLACEHOLDER;
  const bar = document.createElement("progress");
  bar.max = info.tokens_per_image;
  bar.value = 0;
  const caption = document.createElement("figcaption");
  for (const part of ["tokens", "tau", "method", "image-seed"]) {
    const span = document.createElement("span");
    span.className = part;
    caption.append(span);
  }
  caption.querySelector(".tokens").textContent = `image ${index}: waiting for a slot`;
  card.append(img, bar, caption);
  return card;
}

function readForm() {
  const body = { n: Number($("n").value), stream: true };
  body.prompt = info.prompt === "class" ? $("class").value : $("caption").value.trim();
  if (!body.prompt) throw new Error("type a caption");
  const partials = Number($("partials").value || 0);
  if (partials > 0) body.partial_images = partials;
  const seed = $("seed").value.trim();
  if (seed !== "") {
    if (!/^[0-9]+$/.test(seed) || Number(seed) > Number.MAX_SAFE_INTEGER)
      throw new Error(`seed: give digits only, at most ${Number.MAX_SAFE_INTEGER}`);
    body.seed = Number(seed);
  }
  return body;
}

function reproduceLine(lines) {  // lines: {index: the image's `reproduce` command}
  const byLine = new Map();
  for (const [index, line] of Object.entries(lines)) byLine.set(line, [...(byLine.get(line) || []), index]);
  const parts = [...byLine].map(([line, indices]) =>
    byLine.size > 1 ? `image${indices.length > 1 ? "s" : ""} ${indices.join(", ")}: ${line}` : line);
  return `Reproduce offline (with the server's model, device and profile flags): ${parts.join("; ")}`;
}

async function generate(event) {
  event.preventDefault();
  if (running) return;
  let body;
  try {
    body = readForm();
  } catch (err) {
    setState("error", err.message);
    return;
  }
  const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
  if (info.api_key_required) {
    const key = $("key").value.trim();
    sessionStorage.setItem("lantern-api-key", key);
    if (key) headers.Authorization = `Bearer ${key}`;
  }
  const images = $("images");
  images.replaceChildren(...Array.from({ length: body.n }, (_, i) => makeCard(i)));
  $("request").hidden = true;
  running = new AbortController();
  $("go").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  const taus = [];
  const reproduce = {};
  let completed = 0;
  setState("running", `Generating ${body.n} image${body.n > 1 ? "s" : ""}\u2026`);
  try {
    const answer = await fetch("v1/images/generations", {
      method: "POST", headers, body: JSON.stringify(body), signal: running.signal,
    });
    if (!answer.ok) throw new Error(await errorMessage(answer));
    for await (const { event: kind, data } of serverEvents(answer.body)) {
      if (data === "[DONE]") break;
      const message = JSON.parse(data);
      if (kind === "error") throw new Error(message.error.message);
      const card = images.querySelector(`.card[data-index="${message.index}"]`);
      if (!card) continue;
      const tokens = card.querySelector(".tokens");
      if (kind === "image_generation.progress" || kind === "image_generation.partial_image") {
        card.dataset.state = "decoding";
        card.querySelector("progress").value = message.tokens_done;
        tokens.textContent = `image ${message.index}: ${message.tokens_done} / ${info.tokens_per_image} tokens`;
      }
      if (kind === "image_generation.progress" && message.steps > 0) {  // live: tokens after the first per step
        card.querySelector(".tau").textContent = `tau ${((message.tokens_done - 1) / message.steps).toFixed(2)} ` +
          `so far, ${info.method}`;
      }
      if (kind === "image_generation.partial_image") {
        card.querySelector("img").src = `data:image/png;base64,${message.b64_json}`;
        card.dataset.partials = String(Number(card.dataset.partials) + 1);
      } else if (kind === "image_generation.completed") {
        card.querySelector("img").src = `data:image/${message.output_format};base64,${message.b64_json}`;
        tokens.textContent = `image ${message.index}: ${info.tokens_per_image} tokens, ` +
          `${card.dataset.partials} preview${card.dataset.partials === "1" ? "" : "s"}`;
        card.querySelector(".tau").textContent = `tau ${message.stats.tau.toFixed(2)} tokens per step`;
        card.querySelector(".method").textContent = `method ${message.method}, ` +
          `${message.stats.latency_s.toFixed(1)} s (queued ${message.stats.queue_s.toFixed(1)} s)`;
        card.querySelector(".image-seed").textContent = `image seed ${digits(data, "image_seed")}`;
        card.dataset.state = "done";
        taus.push(message.stats.tau);
        completed += 1;
        const seed = digits(data, "seed");
        $("request-seed").textContent = seed;
        reproduce[message.index] = message.reproduce;
        $("reproduce").textContent = reproduceLine(reproduce);
        const mean = taus.reduce((a, b) => a + b, 0) / taus.length;
        $("summary").textContent = `${completed} of ${body.n} done, mean tau ${mean.toFixed(2)}`;
        $("request").hidden = false;
      }
    }
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    if (completed < body.n) throw new Error(`the stream ended with ${completed} of ${body.n} images`);
    setState("done", `Done in ${seconds} s.`);
  } catch (err) {
    for (const card of images.querySelectorAll('.card:not([data-state="done"])')) card.dataset.state = "failed";
    setState("error", err.name === "AbortError" ? "Stopped." : err.message);
  } finally {
    running = null;
    $("go").disabled = false;
    $("stop").disabled = true;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("ask").addEventListener("submit", generate);
  $("stop").addEventListener("click", () => running && running.abort());
  $("reuse").addEventListener("click", () => { $("seed").value = $("request-seed").textContent; });
  loadInfo().catch((err) => setState("error", err.message));
});
