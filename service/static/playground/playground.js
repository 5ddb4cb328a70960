// qtts playground: plain JavaScript, no build step, no third-party code.
//
// Synthesis goes through POST /v1/audio/speech with stream_format "sse" and response_format
// "pcm": every event carries a chunk of 16-bit PCM (24 kHz mono) that is scheduled on the Web
// Audio graph as it arrives, so the first audio plays while the server still synthesizes; the
// last event carries the request's timings (qtts extension of speech.audio.done).
"use strict";

const SAMPLE_RATE = 24000;
const KEY_STORE = "qtts.apiKey"; // sessionStorage: the key lives as long as this tab
const $ = (id) => document.getElementById(id);

// What the page did, in numbers (read by the browser test through window.qttsPlayground).
const state = {
  model: null,
  running: null,          // {controller} while a synthesis runs (one at a time)
  downloading: false,     // while a download is being made (one at a time)
  playing: 0,             // audio sources scheduled and not ended yet
  chunks: [],             // Float32Array pieces of the last result
  nSamples: 0,
  seed: null,
  request: null,          // the body of the last synthesis request
  t0: 0,                  // performance.now() at submit
  firstAudioAt: null,     // ... when the first samples were scheduled
  ttfaShownAt: null,      // ... when the first-audio time was written on the page
  responseEndAt: null,    // ... when the response's last byte arrived
  done: null,             // the speech.audio.done event
  meter: { frames: 0, nonzero: 0, peak: 0 },
  scheduled: 0,           // samples handed to the audio graph
  errors: [],
};
window.qttsPlayground = state;

// ---- API access ------------------------------------------------------------------------------

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  // a key no header can carry is not sent: the server's 401 asks for the key again
  return key && !keyProblem(key) ? { Authorization: "Bearer " + key } : {};
}

function api(path, init = {}) {
  const headers = Object.assign({}, init.headers || {}, authHeaders());
  return fetch(path, Object.assign({}, init, { headers }));
}

// The API's JSON error ({"error": {"message", "field", ...}}) in words.
async function describeError(resp) {
  let message = resp.statusText || "request failed";
  let field = null;
  try {
    const body = await resp.json();
    if (body && body.error) {
      message = body.error.message || message;
      field = body.error.field || body.error.param || null;
    } else if (body && body.detail) {
      message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    }
  } catch (e) {
    // not JSON: keep the status text
  }
  return `Error ${resp.status}: ${message}` + (field ? ` (field: ${field})` : "");
}

function showError(text) {
  const el = $("error");
  el.textContent = text;
  el.hidden = false;
  state.errors.push(text);
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function setStatus(text) {
  $("status").textContent = text;
}

// ---- API key prompt ----------------------------------------------------------------------------

// Why a key cannot be sent, or null: a request header carries ISO-8859-1 characters only (the
// browser refuses any other with an opaque error on every request), and no control characters.
function keyProblem(key) {
  for (const ch of key) {
    const code = ch.codePointAt(0);
    if (code > 0xff) {
      const hex = code.toString(16).toUpperCase().padStart(4, "0");
      return `The API key contains "${ch}" (U+${hex}), which a request header cannot carry ` +
        "(ISO-8859-1 characters only): check the key.";
    }
    if ((code < 0x20 && code !== 0x09) || code === 0x7f) {
      return "The API key contains a control character, which a request header cannot carry: " +
        "check the key.";
    }
  }
  return null;
}

function showKeyError(text) {
  const el = $("key-error");
  el.textContent = text || "";
  el.hidden = !text;
  $("key-input").setAttribute("aria-invalid", text ? "true" : "false");
}

function askKey(why) {
  const dialog = $("key-dialog");
  $("key-why").textContent = why ||
    "This server asks for an API key (QTTS_API_KEY). It is kept in this tab's session only.";
  const stored = sessionStorage.getItem(KEY_STORE) || "";
  $("key-input").value = stored;
  showKeyError(stored ? keyProblem(stored) : null);
  return new Promise((resolve) => {
    const form = $("key-form");
    const finish = (ok) => {
      form.removeEventListener("submit", onSubmit);
      $("key-cancel").removeEventListener("click", onCancel);
      dialog.removeEventListener("cancel", onCancel);
      if (dialog.open) dialog.close();
      resolve(ok);
    };
    const onSubmit = (ev) => {
      ev.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      const problem = keyProblem(key);
      if (problem) {
        showKeyError(problem);
        $("key-input").focus();
        return;
      }
      showKeyError(null);
      sessionStorage.setItem(KEY_STORE, key);
      finish(true);
    };
    const onCancel = (ev) => {
      ev.preventDefault();
      finish(false);
    };
    form.addEventListener("submit", onSubmit);
    $("key-cancel").addEventListener("click", onCancel);
    dialog.addEventListener("cancel", onCancel); // Esc
    dialog.showModal();
    $("key-input").focus();
  });
}

// GET that asks for the key on 401 and tries again.
async function getJson(path) {
  for (;;) {
    const resp = await api(path);
    if (resp.status === 401) {
      const text = await describeError(resp);
      if (await askKey(text + ". Enter the server's API key:")) continue;
      throw new Error(text);
    }
    if (!resp.ok) throw new Error(await describeError(resp));
    return resp.json();
  }
}

// ---- model, voices, languages ------------------------------------------------------------------

// values: strings (shown as they are) or [value, label] pairs
function fillSelect(select, values, preferred) {
  select.textContent = "";
  for (const v of values) {
    const [value, label] = Array.isArray(v) ? v : [v, v];
    const opt = document.createElement("option");
    opt.value = value;
    opt.textContent = label;
    select.appendChild(opt);
  }
  if (preferred && [...select.options].some((o) => o.value === preferred)) {
    select.value = preferred;
  }
}

// A Base model speaks cloned voices only; it makes them (POST /v1/audio/voices) when its file
// keeps the two encoders. A CustomVoice model has built-in voices.
function speaksClones(model) {
  return model.model_type === "base";
}

function clones(model) {
  return speaksClones(model) && model.parts.includes("speaker_encoder") &&
    model.parts.includes("codec_encoder");
}

async function loadModel(preferredVoice) {
  try {
    const models = await getJson("/v1/models");
    state.model = models.data[0];
    const voices = await getJson("/v1/audio/voices");
    // the built-in voices, then the caller's cloned ones (by id, shown by name)
    const cloned = voices.data.filter((v) => v.object === "audio.voice")
      .map((v) => [v.id, `${v.name} (cloned)`]);
    fillSelect($("voice"), [...voices.voices, ...cloned], preferredVoice);
    // the language chosen before a reload (a new key, a new voice) stays chosen
    fillSelect($("language"), [...new Set(["auto", ...voices.languages])],
      $("language").value || "auto");
    $("clone").hidden = !clones(state.model);
    const note = state.model.synthetic ? " (synthetic test model: its audio is noise)" : "";
    setStatus(`Model ${state.model.id}${note}: ready.`);
    if (speaksClones(state.model) && !cloned.length) {
      setStatus(`Model ${state.model.id}${note}: clone a voice below to speak.`);
    }
    if (!state.model.text) {
      setStatus(`Model ${state.model.id} cannot speak text in this build (decoder only).`);
    }
  } catch (e) {
    showError(e.message);
    setStatus("Could not load the model's voices.");
  }
}

async function cloneVoice() {
  clearError();
  const file = $("clone-audio").files[0];
  if (!file) {
    showError("Choose a reference audio file to clone (field: audio_sample).");
    return;
  }
  const form = new FormData();
  form.append("audio_sample", file, file.name);
  form.append("name", $("clone-name").value.trim() || file.name.replace(/\.[^.]*$/, ""));
  const transcript = $("clone-transcript").value.trim();
  if (transcript) form.append("transcript", transcript);
  $("clone-go").disabled = true;
  setStatus("Cloning (the server encodes the reference)…");
  try {
    for (;;) {
      const resp = await api("/v1/audio/voices", { method: "POST", body: form });
      if (resp.status === 401) {
        const text = await describeError(resp);
        if (await askKey(text + ". Enter the server's API key:")) continue;
        showError(text);
        setStatus("Not cloned.");
        return;
      }
      if (!resp.ok) {
        showError(await describeError(resp));
        setStatus("Not cloned.");
        return;
      }
      const voice = await resp.json();
      await loadModel(voice.id);
      setStatus(`Cloned "${voice.name}" (${voice.mode}, ${voice.reference_seconds} s of ` +
        "reference): it is the selected voice now.");
      return;
    }
  } catch (e) {
    showError(`The request failed: ${e.message}`);
    setStatus("Not cloned.");
  } finally {
    $("clone-go").disabled = false;
  }
}

// ---- audio graph -------------------------------------------------------------------------------

let ctx = null;
let sink = null;       // the meter worklet, or the speakers where worklets are unavailable
let nextTime = 0;
let sources = [];

async function audioGraph() {
  if (!ctx) {
    ctx = new AudioContext({ sampleRate: SAMPLE_RATE });
    sink = ctx.destination;
    if (ctx.audioWorklet) { // secure contexts only (https, or loopback)
      try {
        await ctx.audioWorklet.addModule("/playground/meter.js");
        const meter = new AudioWorkletNode(ctx, "qtts-meter");
        meter.port.onmessage = (ev) => {
          state.meter = ev.data;
        };
        meter.connect(ctx.destination);
        sink = meter;
      } catch (e) {
        sink = ctx.destination;
      }
    }
  }
  if (ctx.state === "suspended") await ctx.resume();
}

function play(samples) {
  const buf = ctx.createBuffer(1, samples.length, SAMPLE_RATE);
  buf.copyToChannel(samples, 0);
  const src = ctx.createBufferSource();
  src.buffer = buf;
  src.connect(sink);
  const at = Math.max(nextTime, ctx.currentTime + 0.05);
  src.start(at);
  nextTime = at + samples.length / SAMPLE_RATE;
  sources.push(src);
  state.playing = sources.length;
  src.onended = () => {
    if (!sources.includes(src)) return; // stopped: stopAudio() let it go already
    sources = sources.filter((s) => s !== src);
    state.playing = sources.length;
    updateButtons(); // the last source ended: nothing left to stop
  };
  state.scheduled += samples.length;
}

function stopAudio() {
  for (const s of sources) {
    try { s.stop(); } catch (e) { /* not started yet */ }
  }
  sources = [];
  state.playing = 0;
  nextTime = 0;
}

// ---- PCM -----------------------------------------------------------------------------------------

let carry = null; // an odd byte left over between events

function pcmToFloat(bytes) {
  if (carry !== null) {
    const joined = new Uint8Array(bytes.length + 1);
    joined[0] = carry;
    joined.set(bytes, 1);
    bytes = joined;
    carry = null;
  }
  if (bytes.length % 2) {
    carry = bytes[bytes.length - 1];
    bytes = bytes.subarray(0, bytes.length - 1);
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
  const out = new Float32Array(bytes.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32768;
  return out;
}

function base64Bytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function allSamples() {
  const out = new Float32Array(state.nSamples);
  let o = 0;
  for (const c of state.chunks) {
    out.set(c, o);
    o += c.length;
  }
  return out;
}

// The inverse of pcmToFloat's /32768: the server's s16 samples again, bit for bit.
function toInt16(s) {
  return Math.max(-32768, Math.min(32767, Math.round(s * 32768)));
}

function wavBlob(samples) {
  const n = samples.length;
  const buf = new ArrayBuffer(44 + 2 * n);
  const v = new DataView(buf);
  const str = (o, s) => { for (let i = 0; i < s.length; i++) v.setUint8(o + i, s.charCodeAt(i)); };
  str(0, "RIFF"); v.setUint32(4, 36 + 2 * n, true); str(8, "WAVE");
  str(12, "fmt "); v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true);
  v.setUint32(24, SAMPLE_RATE, true); v.setUint32(28, 2 * SAMPLE_RATE, true);
  v.setUint16(32, 2, true); v.setUint16(34, 16, true);
  str(36, "data"); v.setUint32(40, 2 * n, true);
  for (let i = 0; i < n; i++) v.setInt16(44 + 2 * i, toInt16(samples[i]), true);
  return new Blob([buf], { type: "audio/wav" });
}

function pcmBlob(samples) {
  const out = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) out[i] = toInt16(samples[i]);
  return new Blob([out.buffer], { type: "audio/pcm" });
}

// ---- waveform --------------------------------------------------------------------------------------

let drawPending = false;

function drawWave() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    const canvas = $("wave");
    const w = Math.max(1, Math.round(canvas.clientWidth * (window.devicePixelRatio || 1)));
    const h = Math.max(1, Math.round(canvas.clientHeight * (window.devicePixelRatio || 1)));
    if (canvas.width !== w) canvas.width = w;
    if (canvas.height !== h) canvas.height = h;
    const g = canvas.getContext("2d");
    g.fillStyle = "#0f1722";
    g.fillRect(0, 0, w, h);
    g.fillStyle = "#58a6ff";
    const total = state.nSamples;
    if (!total) return;
    const per = total / w;
    let col = 0;
    let lo = 1;
    let hi = -1;
    let seen = 0;
    let next = per;
    for (const c of state.chunks) {
      for (let i = 0; i < c.length; i++) {
        const s = c[i];
        if (s < lo) lo = s;
        if (s > hi) hi = s;
        seen++;
        if (seen >= next) {
          const y0 = (1 - hi) * h / 2;
          const y1 = (1 - lo) * h / 2;
          g.fillRect(col, y0, 1, Math.max(1, y1 - y0));
          col++;
          next += per;
          lo = 1;
          hi = -1;
        }
      }
    }
  });
}

// ---- timings -------------------------------------------------------------------------------------

const fmtMs = (s) => `${Math.round(s * 1000)} ms`;

function showTimings() {
  const total = (state.responseEndAt - state.t0) / 1000;
  const audio = state.nSamples / SAMPLE_RATE;
  $("stat-total").textContent = fmtMs(total);
  $("stat-audio").textContent = `${audio.toFixed(2)} s`;
  const q = (state.done && state.done.qtts) || null;
  if (q && q.ttfa_seconds != null && state.firstAudioAt !== null) {
    $("stat-ttfa").textContent =
      `${fmtMs((state.firstAudioAt - state.t0) / 1000)} (server ${fmtMs(q.ttfa_seconds)})`;
  }
  if (q && q.rtf != null) {
    $("stat-rtf").textContent = `${q.rtf.toFixed(3)} (wall ${(total / Math.max(audio, 1e-9)).toFixed(3)})`;
  } else if (audio > 0) {
    $("stat-rtf").textContent = `${(total / audio).toFixed(3)} (wall)`;
  }
  const table = $("stages");
  const body = table.tBodies[0];
  body.textContent = "";
  const rows = q && q.stages ? Object.entries(q.stages) : [];
  if (q) {
    if (q.queue_seconds != null) rows.unshift(["queue", q.queue_seconds]);
    if (q.synth_seconds != null) rows.push(["synthesis (all stages)", q.synth_seconds]);
  }
  for (const [name, seconds] of rows) {
    const tr = document.createElement("tr");
    const a = document.createElement("td");
    const b = document.createElement("td");
    a.textContent = name;
    b.textContent = Number(seconds).toFixed(4);
    tr.append(a, b);
    body.appendChild(tr);
  }
  table.hidden = rows.length === 0;
}

function resetResult() {
  state.chunks = [];
  state.nSamples = 0;
  state.firstAudioAt = null;
  state.ttfaShownAt = null;
  state.responseEndAt = null;
  state.done = null;
  state.scheduled = 0;
  carry = null;
  for (const id of ["stat-ttfa", "stat-rtf", "stat-audio", "stat-total"]) $(id).textContent = "–";
  $("stages").hidden = true;
  drawWave();
}

// ---- synthesis ---------------------------------------------------------------------------------------

function requestBody() {
  const seedText = $("seed").value.trim();
  let seed;
  if (seedText === "") {
    seed = crypto.getRandomValues(new Uint32Array(1))[0];
  } else {
    seed = Number(seedText); // the server checks the range and says which field is wrong
  }
  const body = {
    model: state.model ? state.model.id : "qtts",
    input: $("text").value,
    voice: $("voice").value || "default",
    response_format: "pcm",
    stream_format: "sse",
    speed: Number($("speed").value),
    seed,
  };
  const language = $("language").value;
  if (language && language !== "auto") body.language = language;
  const instruct = $("instruct").value.trim();
  if (instruct) body.instructions = instruct;
  const maxSeconds = $("max-seconds").value.trim();
  if (maxSeconds !== "") body.max_seconds = Number(maxSeconds);
  return body;
}

function handleEvent(block) {
  for (const line of block.split("\n")) {
    if (!line.startsWith("data:")) continue;
    const ev = JSON.parse(line.slice(5).trim());
    if (ev.type === "speech.audio.delta") {
      const samples = pcmToFloat(base64Bytes(ev.audio));
      if (!samples.length) continue;
      state.chunks.push(samples);
      state.nSamples += samples.length;
      play(samples);
      if (state.firstAudioAt === null) {
        state.firstAudioAt = performance.now();
        $("stat-ttfa").textContent = fmtMs((state.firstAudioAt - state.t0) / 1000);
        state.ttfaShownAt = performance.now();
        setStatus("Playing while the server synthesizes…");
      }
      drawWave();
    } else if (ev.type === "speech.audio.done") {
      state.done = ev;
    }
  }
}

async function synthesize() {
  if (state.running) return;
  clearError(); // the server checks the input and says which field is wrong
  if (state.model && speaksClones(state.model) && !$("voice").value) {
    showError("This Base model speaks cloned voices only: clone one first (Clone a voice).");
    return;
  }
  // This run holds the page from here, before the first await (the first run loads the audio
  // worklet): a second click or Ctrl+Enter meanwhile starts nothing.
  const run = { controller: new AbortController() };
  state.running = run;
  updateButtons();
  try {
    await audioGraph();
    run.controller.signal.throwIfAborted(); // Stop (or Esc) while the audio graph was loading
    stopAudio();
    resetResult();
    const body = requestBody();
    state.seed = body.seed;
    state.request = body;
    setStatus(`Synthesizing (seed ${body.seed})…`);
    state.t0 = performance.now();
    const resp = await api("/v1/audio/speech", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: run.controller.signal,
    });
    if (!resp.ok) {
      const text = await describeError(resp);
      showError(text);
      setStatus("The server refused the request.");
      if (resp.status === 401 && await askKey(text + ". Enter the server's API key:")) {
        finishRun(run);
        return synthesize();
      }
      return;
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = pending.indexOf("\n\n")) >= 0) {
        handleEvent(pending.slice(0, cut));
        pending = pending.slice(cut + 2);
      }
    }
    state.responseEndAt = performance.now();
    if (!state.done) {
      showError("The stream ended before the audio was complete (the server or the connection " +
        "dropped it); what arrived is kept.");
    }
    showTimings();
    setStatus(`Done: ${(state.nSamples / SAMPLE_RATE).toFixed(2)} s of audio, seed ${body.seed}.`);
  } catch (e) {
    if (e.name === "AbortError") {
      setStatus("Stopped.");
    } else {
      showError(`The request failed: ${e.message}`);
      setStatus("Failed.");
    }
  } finally {
    finishRun(run);
  }
}

// The end of one run: it clears that run's hold only (never a newer run's).
function finishRun(run) {
  if (state.running !== run) return;
  state.running = null;
  updateButtons();
}

// Synthesize while nothing runs; Stop while a request runs or its audio still plays; Download
// when there is a result and no synthesis or download is under way.
function updateButtons() {
  $("go").disabled = state.running !== null;
  $("stop").disabled = state.running === null && sources.length === 0;
  $("download").disabled = state.running !== null || state.downloading || state.nSamples === 0;
}

function canStop() {
  return state.running !== null || sources.length > 0;
}

function stop() {
  if (state.running) {
    state.running.controller.abort(); // its run says "Stopped." as it ends
  } else if (sources.length) {
    setStatus("Stopped (the result is kept).");
  }
  stopAudio();
  updateButtons();
}

async function download() {
  if (!state.nSamples || state.running || state.downloading) return;
  clearError();
  const fmt = $("format").value;
  let blob;
  if (fmt === "wav") {
    blob = wavBlob(allSamples());
  } else if (fmt === "pcm") {
    blob = pcmBlob(allSamples());
  } else {
    // Compressed formats come from the server: the same request (same seed) as one file,
    // one download at a time (each one is a whole synthesis on the server).
    setStatus(`Encoding as ${fmt} on the server (same request, seed ${state.seed})…`);
    const body = Object.assign({}, state.request, {
      response_format: fmt, stream_format: "audio", stream: false,
    });
    state.downloading = true;
    updateButtons();
    try {
      const resp = await api("/v1/audio/speech", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      if (!resp.ok) {
        showError(await describeError(resp));
        setStatus("Download failed.");
        return;
      }
      blob = await resp.blob();
    } catch (e) {
      showError(`The download failed: ${e.message}`);
      setStatus("Download failed.");
      return;
    } finally {
      state.downloading = false;
      updateButtons();
    }
  }
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `qtts-${state.seed}.${fmt}`;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 60000);
  setStatus(`Saved ${a.download}.`);
}

// ---- wiring --------------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    synthesize();
  });
  $("text").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
      ev.preventDefault();
      synthesize();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && canStop() && !$("key-dialog").open) stop();
  });
  $("clone-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    cloneVoice();
  });
  $("stop").addEventListener("click", stop);
  $("download").addEventListener("click", download);
  $("key-button").addEventListener("click", async () => {
    if (await askKey()) {
      clearError();
      loadModel($("voice").value);
    }
  });
  $("speed").addEventListener("input", () => {
    $("speed-out").textContent = Number($("speed").value).toFixed(2);
  });
  window.addEventListener("resize", drawWave);
  loadModel();
});
